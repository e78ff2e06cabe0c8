"""`specula.check`: certify on the user's own setup that a method's output is the target's output.

"Lossless" here means: at temperature 0 the method's tokens equal plain greedy decoding of the
target, token for token, except where the target's two best logits tie within the floating-point
noise of the weight dtype (`specula.divergence`); at temperature > 0 the method's output is
distributed exactly as the target's own sampling at the same temperature / top-k / top-p.

Two parts, each against the target itself, never against a fixture:

1. T = 0. Vanilla and the method decode the same prompts greedily. At each prompt's first
   divergence the target's logits for vanilla's prefix are recomputed (a one-token step, and the
   method's verify shape) and the divergence is classified near-tie or real. Any real one fails.
2. T > 0. For the first ``prefixes`` prompts, ``samples`` runs of the method's full loop with
   different seeds each draw the first ``tokens`` new tokens; `specula.certify.distribution_test` compares
   them with the target's exact probabilities (a likelihood z-test and a pooled chi-square,
   Bonferroni-combined; the module explains the choice). Exactly ``tokens`` new tokens are asked
   for, so the loop prunes its drafts to fit and acceptance, residual resampling and the bonus
   token all land inside the tested window: the first token comes from the prefill, the first
   speculative cycle drafts up to ``tokens`` − 2 deep (4 tokens: acceptance at depths 1 and 2, the
   bonus after a fully accepted path, multi-round siblings in trees).
   **Power control in the same run**: the same loop and the same test, with the method's acceptor
   judging drafts against the target at a temperature off by 10 % (`ShiftedTemperatureAcceptor`).
   Its output is exactly the target's at 1.1 T from the second token on, a planted error the test
   must reject; if it does not, the verdict is "inconclusive": with this many samples the check
   could not have failed.

Cost. The runs of one prompt share the target's forwards through a `ForwardMemo`: a forward whose
exact history (every cache operation since the prefill) was seen before is answered from memory, so
the runs are bit for bit those of plain decoding and the test is unchanged; only repeated work goes.
Runs share the prefill always and their verify passes until their tokens part (a few hundred distinct
histories per prompt instead of one forward per cycle per run); the control reuses the method's
seeds, so it shares each run's history up to its acceptor's first different decision. A draft model (sps)
answers through a memo of its own the same way (its prefill and its drafts until the runs part). The exact
probabilities are computed once per distinct prefix, as token trees on one prefill
(`specula.certify.exact_distribution`). On stories260k with pld and the defaults, the T > 0 part's target
forwards go from 4647 loop forwards plus 27 batched exact ones to 626 plus 12 (4021 answered from
memory); the T = 0 part (878 forwards, vanilla one token at a time) is then the larger part.

Defaults (300 samples per prompt, 2 prompts, 4 tokens). On stories260k the control's likelihood z is
about 5 to 7.5 (p below 1e-5, against alpha 1e-3), and planted bugs (an off-by-one residual, a draft
sampled at 1.5 T, a bonus token drawn from the draft) reach |z| > 5. Every count is an option: a
target whose distribution is sharper needs more samples, and the control says so.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch

from specula.acceptance import Acceptance
from specula.api import Speculator
from specula.certify.distribution_test import MIN_EXPECTED, fit, likely_sequences, token_statistics
from specula.certify.exact_distribution import ExactDistribution
from specula.certify.forward_memo import ForwardMemo
from specula.certify.report import CheckReport, SamplingResult
from specula.chat.template import conversation_ids
from specula.decoding import generate_tokens
from specula.divergence import check_greedy, compute_dtype
from specula.drafters.vanilla import VanillaDrafter
from specula.errors import SpeculaError
from specula.files.jsonl import json_lines
from specula.methods import DEFAULT_TARGET, build_speculator
from specula.runtime.target import Target
from specula.sampling import SamplingParams
from specula.tree import DraftTree

ALPHA = 1e-3
CONTROL_FACTOR = 1.1
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


class ShiftedTemperatureAcceptor:
    """The power control: ``base`` (the method's own acceptor) judging drafts against the target's
    distribution at ``factor`` times the temperature. Accepted drafts, residual draws and bonus tokens
    then follow the target at that temperature: a planted error the distribution test must reject."""

    lossless = False

    def __init__(self, base, factor: float = CONTROL_FACTOR):
        self.base, self.factor = base, factor

    def __call__(self, tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> Acceptance:
        if not params.greedy:
            params = SamplingParams(params.temperature * self.factor, params.top_k, params.top_p)
        return self.base(tree, target_logits, params, generator)


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


def _draft_model(drafter) -> Target | None:
    """The separate draft model a drafter runs (sps), or None (heads and lookups run no model of their own)."""
    draft = getattr(drafter, "draft", None)
    return draft if isinstance(draft, Target) else None


def _memoized(drafter):
    """``drafter``, or a copy whose draft model (sps) answers through its own `ForwardMemo`: a draft model's
    forwards are as deterministic as the target's, and every run of a prompt repeats its prefill."""
    draft = _draft_model(drafter)
    if draft is None:
        return drafter
    memoized = copy.copy(drafter)
    memoized.draft = ForwardMemo(draft)
    return memoized


def _sample(target, drafter, acceptor, ids: torch.Tensor, params: SamplingParams, tokens: int,
            seeds: range) -> tuple[list[tuple[int, ...]], int, int]:
    """(the first ``tokens`` new tokens of one loop run per seed, draft tokens proposed, draft tokens accepted).

    ``target`` is the speculator's target or a `ForwardMemo` of it, ``drafter`` its drafter or `_memoized` copy:
    the runs are the same either way.
    """
    sequences, drafted, accepted = [], 0, 0
    for seed in seeds:
        new, stats = generate_tokens(target, drafter, ids, tokens, params, seed=seed,
                                     stop_on_eos=False, acceptor=acceptor)
        sequences.append(tuple(new))
        drafted += sum(stats.tree_sizes)
        accepted += sum(stats.accepted_lengths)
    return sequences, drafted, accepted


def check_sampling(speculator, prompts: list[torch.Tensor], params: SamplingParams, samples: int, tokens: int,
                   seed: int, alpha: float) -> SamplingResult:
    """Part 2: the distribution test of the method's loop and of the planted-error control.

    Cost: every run goes through one `ForwardMemo` per prompt, so runs that share their history (the
    prompt's prefill always; then each verify pass until their sampled tokens part, and the control,
    which reuses the method's seeds, until its acceptor first decides otherwise) share the target's
    forwards; the runs themselves are bit for bit those of plain decoding (see `specula.certify.forward_memo`).
    The exact probabilities are computed once per distinct prefix, as token trees
    (`specula.certify.exact_distribution`).
    """
    control = ShiftedTemperatureAcceptor(speculator.acceptor)
    drafted = accepted = 0
    method_data, control_data = [], []
    for k, ids in enumerate(prompts):
        seeds = range(seed + k * samples, seed + (k + 1) * samples)  # the control reuses the method's seeds
        memo, drafter = ForwardMemo(speculator.target), _memoized(speculator.drafter)
        drawn, proposed, kept = _sample(memo, drafter, speculator.acceptor, ids, params, tokens, seeds)
        planted, _, _ = _sample(memo, drafter, control, ids, params, tokens, seeds)
        del memo, drafter  # their remembered outputs and cache entries
        drafted, accepted = drafted + proposed, accepted + kept
        exact = ExactDistribution(speculator.target, ids, params)
        cells = likely_sequences(exact, tokens, MIN_EXPECTED / samples)
        statistics = token_statistics(exact, drawn + planted)
        speculator.target.reset()
        method_data.append((drawn, statistics, cells))
        control_data.append((planted, statistics, cells))
    description = f"the method's acceptor judging against the target at {CONTROL_FACTOR:g} x T"
    return SamplingResult(params.temperature, params.top_p, params.top_k, alpha, len(prompts), samples, tokens,
                          drafted, accepted, fit(method_data), fit(control_data), description)


def check(target: str | Path | None = None, method: str = "vanilla", draft: str | Path | None = None, *,
          speculator=None, prompts: list[str] | None = None, n: int = 8, max_new_tokens: int = 64,
          temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, samples: int = 300, prefixes: int = 2,
          tokens: int = 4, seed: int = 0, alpha: float = ALPHA, dtype: str = "auto", device: str = "cpu",
          **options: Any) -> CheckReport:
    """Check that ``method`` on ``target`` is lossless; returns the report (``report.exit_code``, ``.table()``).

    The method is built by ``specula.load(target, method, draft, dtype=, device=, **options)`` (the registry) unless a
    ready ``speculator`` is given. ``prompts`` (default: `DEFAULT_PROMPTS`): the first ``n`` are decoded
    greedily for up to ``max_new_tokens``; the first ``prefixes`` are sampled ``samples`` times each for
    ``tokens`` new tokens at ``temperature``/``top_p``/``top_k`` (temperature 0 skips this part).
    """
    started = time.perf_counter()
    params = SamplingParams(temperature, top_k, top_p)  # bad sampling settings fail before any model loads
    for name, value, least in (("n", n, 1), ("max_new_tokens", max_new_tokens, 1), ("samples", samples, 10),
                               ("prefixes", prefixes, 1), ("tokens", tokens, 2)):
        if not isinstance(value, int) or value < least:
            raise SpeculaError(f"{name} must be a whole number >= {least}, got {value!r}")
    if not 0 < alpha < 1:
        raise SpeculaError(f"alpha must be in (0, 1), got {alpha}")
    texts = list(DEFAULT_PROMPTS if prompts is None else prompts)
    if not texts or any(not isinstance(t, str) or not t.strip() for t in texts):
        raise SpeculaError("prompts must be a non-empty list of non-empty strings")
    if speculator is None:
        speculator = build_speculator(target if target is not None else DEFAULT_TARGET, method=method, draft=draft,
                                      dtype=dtype, device=device, **options)

    vanilla = Speculator(speculator.target, "vanilla", VanillaDrafter())
    greedy_ids = [encode_prompt(speculator, t, max_new_tokens) for t in texts[:n]]
    greedy = check_greedy(speculator, vanilla, greedy_ids, max_new_tokens)
    sampling = None
    if not params.greedy:
        sample_ids = [encode_prompt(speculator, t, tokens) for t in texts[:prefixes]]
        sampling = check_sampling(speculator, sample_ids, params, samples, tokens, seed, alpha)
    target_name = speculator.target.name
    draft_name = None if draft is None else Path(draft).name
    draft_model = _draft_model(speculator.drafter)  # sps: a model whose format is part of what was checked
    if draft_name is not None and draft_model is not None:
        draft_name += f", {_precision(draft_model)}"
    return CheckReport(target_name, speculator.method, draft_name,
                       _precision(speculator.target), str(speculator.target.device), greedy,
                       sampling, time.perf_counter() - started)


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
