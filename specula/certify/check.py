"""`specula.check`: certify on the user's own setup that a method's output is the target's output.

"Lossless" here means: at temperature 0 the method's tokens equal plain greedy decoding of the
target, token for token (bit-identical where the verify pass is row-invariant, which `specula.divergence`
probes; elsewhere up to ties within the floating-point noise of the weight dtype); at temperature > 0 the
method's output is distributed exactly as the target's own sampling at the same temperature / top-k / top-p.

0. Lossy by construction. An acceptor the registry marks lossy (``acceptor.lossless`` False: Medusa's typical
   acceptance) is NOT lossless at T > 0 whatever a finite test would see: the check says so and samples
   nothing. Only its T = 0 part runs (typical acceptance is greedy matching there).
1. T = 0. Vanilla and the method decode the same prompts greedily. At each prompt's first
   divergence the target's logits for vanilla's prefix are recomputed (a one-token step, and the
   method's verify shape) and the divergence is classified: tolerance 0 on a row-invariant target,
   the dtype's near-tie tolerance elsewhere. Any real one fails.
2. T > 0 (`specula.certify.sampled`). For the first ``prefixes`` prompts, runs of the method's full loop
   with different seeds each draw the first ``tokens`` new tokens; `specula.certify.distribution_test`
   compares them with the target's exact probabilities. The number of runs is planned first, from the
   exact probabilities alone, so that the test detects any distortion of ``tv`` in total variation with
   power 0.8 (`specula.certify.power`: the bound and its proof); if ``max_samples`` cannot reach it the
   verdict is "inconclusive", never "certified". Exactly ``tokens`` new tokens are asked for, so the loop
   prunes its drafts to fit and acceptance, residual resampling and the bonus token all land inside the
   tested window.
   **Power control in the same run**: the same loop and test with the method's acceptor judging drafts
   against the target's distribution tilted to a known distortion of ``tv`` through the same cells
   (`specula.certify.sampled.TiltedAcceptor`); it must be rejected, else the verdict is "inconclusive".
   Every verdict states the distortion the test detects.

Cost. The runs of one prompt share the target's forwards through a `ForwardMemo`: a forward whose
exact history (every cache operation since the prefill) was seen before is answered from memory, so
the runs are bit for bit those of plain decoding and the test is unchanged; only repeated work goes.
The exact probabilities are computed once per distinct prefix, as token trees on one prefill
(`specula.certify.exact_distribution`).
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import torch

from specula.api import Speculator
from specula.certify.report import CheckReport
from specula.certify.sampled import MAX_SAMPLES, TV, check_sampling, draft_model
from specula.chat.template import conversation_ids
from specula.divergence import check_greedy, compute_dtype
from specula.drafters.vanilla import VanillaDrafter
from specula.errors import SpeculaError
from specula.files.jsonl import json_lines
from specula.methods import DEFAULT_TARGET, build_speculator
from specula.sampling import SamplingParams

ALPHA = 1e-3
# A small bundled chat set: short, varied requests; with a chat template they become user turns.
DEFAULT_PROMPTS = [
    "Write a short story about a cat who wants to fly.",
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain why the sky is blue in two sentences.",
    "Tell me a joke about a dog and a ball.",
    "How do I make a cup of tea?",
    "Write a poem about the sea.",
    "What should I pack for a day at the beach?",
]


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a JSONL file of {"prompt": "..."} records (SpeculaError naming the bad line)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise SpeculaError(f"cannot read prompts file {path}: {err}") from err
    prompts = []
    for _, where, record in json_lines(lines, lambda number: f"{path}:{number}"):
        if not (isinstance(record, dict) and isinstance(record.get("prompt"), str) and record["prompt"].strip()):
            raise SpeculaError(f"{where}: expected an object with a non-empty string 'prompt'")
        prompts.append(record["prompt"])
    if not prompts:
        raise SpeculaError(f"prompts file {path} has no prompts")
    return prompts


def encode_prompt(speculator, prompt: str, max_new_tokens: int) -> torch.Tensor:
    """A user turn through the chat template when the tokenizer has one, else the raw text; int64 [P]."""
    limit = speculator.target.max_length - max_new_tokens - 1
    if limit < 1:
        raise SpeculaError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the "
                           f"{speculator.target.max_length}-token context")
    ids, _ = conversation_ids(speculator.tokenizer, [prompt], [], limit)
    return speculator.encode(ids)


def check(target: str | Path | None = None, method: str = "vanilla", draft: str | Path | None = None, *,
          speculator=None, prompts: list[str] | None = None, n: int = 8, max_new_tokens: int = 64,
          temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, samples: int = 300, prefixes: int = 2,
          tokens: int = 4, seed: int = 0, alpha: float = ALPHA, tv: float = TV, max_samples: int = MAX_SAMPLES,
          dtype: str = "auto", device: str = "cpu", **options: Any) -> CheckReport:
    """Check that ``method`` on ``target`` is lossless; returns the report (``report.exit_code``, ``.table()``).

    The method is built by ``specula.load(target, method, draft, dtype=, device=, **options)`` (the registry) unless a
    ready ``speculator`` is given. ``prompts`` (default: `DEFAULT_PROMPTS`): the first ``n`` are decoded
    greedily for up to ``max_new_tokens``; the first ``prefixes`` are sampled at least ``samples`` times each
    for ``tokens`` new tokens at ``temperature``/``top_p``/``top_k`` (temperature 0 skips this part), more where
    the test needs them to detect a distortion of ``tv`` (total variation) with power 0.8, up to ``max_samples``.
    A method whose acceptor is lossy by construction is not sampled: it is NOT lossless at T > 0.
    """
    started = time.perf_counter()
    params = SamplingParams(temperature, top_k, top_p)  # bad sampling settings fail before any model loads
    for name, value, least in (("n", n, 1), ("max_new_tokens", max_new_tokens, 1), ("samples", samples, 10),
                               ("prefixes", prefixes, 1), ("tokens", tokens, 2), ("max_samples", max_samples, samples)):
        if not isinstance(value, int) or value < least:
            raise SpeculaError(f"{name} must be a whole number >= {least}, got {value!r}")
    for name, value in (("alpha", alpha), ("tv", tv)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value < 1):
            raise SpeculaError(f"{name} must be in (0, 1), got {value!r}")
    texts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
        raise SpeculaError("prompts must be a non-empty list of non-empty strings")
    if speculator is None:
        speculator = build_speculator(target if target is not None else DEFAULT_TARGET, method=method, draft=draft,
                                      dtype=dtype, device=device, **options)

    vanilla = Speculator(speculator.target, "vanilla", VanillaDrafter())
    # Drafts verified whole, as the sampled runs verify them: a draft budget only chooses how deep to draft (proven
    # lossless in tests/test_draft_budget.py), and one that finds drafting unprofitable would leave nothing to check.
    speculator = copy.copy(speculator)
    speculator.draft_budget = "off"
    greedy_ids = [encode_prompt(speculator, t, max_new_tokens) for t in texts[:n]]
    greedy = check_greedy(speculator, vanilla, greedy_ids, max_new_tokens)
    sampling, lossy = None, None
    if not params.greedy and not speculator.lossless:
        # The registry's word, not a test's: no sample size makes a lossy rule lossless, and a test that misses
        # its distortion would only say the sample was too small.
        lossy = f"{getattr(speculator.acceptor, 'name', type(speculator.acceptor).__name__)} acceptance"
    elif not params.greedy:
        sample_ids = [encode_prompt(speculator, t, tokens) for t in texts[:prefixes]]
        sampling = check_sampling(speculator, sample_ids, params, samples, tokens, seed, alpha, tv, max_samples)
    target_name = speculator.target.name
    draft_name = None if draft is None else Path(draft).name
    draft = draft_model(speculator.drafter)  # sps: a model whose format is part of what was checked
    if draft_name is not None and draft is not None:
        draft_name += f", {_precision(draft)}"
    return CheckReport(target_name, speculator.method, draft_name,
                       _precision(speculator.target), str(speculator.target.device), greedy,
                       sampling, time.perf_counter() - started, lossy, params.temperature)


# A format whose kernel is not a floating-point matmul in its compute dtype says what it does instead.
_KERNEL_ARITHMETIC = {"q4_1": "8-bit activations, integer block sums"}


def _precision(target) -> str:
    """How the report names the target's numbers: its dtype, and the weight format when that is not the dtype."""
    dtype = str(target.dtype).removeprefix("torch.")
    weights = getattr(target, "weights", None)
    kernels = _KERNEL_ARITHMETIC.get(weights, f"{str(compute_dtype(target))[6:]} kernels")
    named = dtype if weights in (None, dtype) else f"{weights} weights ({kernels})"
    # A compiled step rounds differently from the eager one: it is part of what was checked.
    return named + (", compiled step" if getattr(target, "compiled", False) else "")
