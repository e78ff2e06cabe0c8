"""What users hold: a `Speculator` (a target paired with a drafting method) with `generate` and `stream`.

`specula.load(...)` (`specula.methods.build_speculator`) checks the options and builds one.
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specula.acceptance import Acceptor
from specula.chat.template import chat_ids
from specula.decoding import GenerationStats, stream_tokens
from specula.detokenize import IncrementalDecoder
from specula.draft_budget import DraftBudget, cached_curve, check_draft_budget
from specula.drafters.base import Drafter
from specula.errors import SpeculaError
from specula.openmp import release_thread_team
from specula.runtime.target import Target
from specula.sampling import SamplingParams


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
    """A target model paired with one drafting method and an acceptance rule (lossless unless asked).

    ``draft_budget``: "auto" caps each cycle's draft where verifying it would cost more than it is expected to win,
    from this machine's verify-cost curve and the acceptance measured on this Speculator's own generations
    (`specula.draft_budget`; what `specula.load` builds); "off" verifies whatever the drafter proposes.
    """

    def __init__(self, target: Target, method: str, drafter: Drafter, acceptor: Acceptor | None = None,
                 draft_budget: str = "off"):
        check_draft_budget(draft_budget)
        self.target = target
        self.method = method
        self.drafter = drafter
        self.acceptor = acceptor or Acceptor()
        self.draft_budget = draft_budget
        self._budget: DraftBudget | None = None  # made at the first generation: its curve may need measuring
        self._busy = threading.Lock()  # one KV cache: one generation at a time

    @property
    def budget(self) -> DraftBudget | None:
        """The draft budget every generation of this Speculator shares (None: drafts are not capped)."""
        if self.draft_budget == "off" or self.method == "vanilla":
            return None
        if self._budget is None:
            self._budget = DraftBudget(cached_curve(self.target), max_batch=1)
        return self._budget

    @property
    def lossless(self) -> bool:
        """False only with the opt-in typical acceptance, whose output is not the target's distribution."""
        return bool(self.acceptor.lossless)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def encode(self, prompt: str | list[int] | torch.Tensor | None = None, *, messages: list[dict] | None = None,
               system: str | None = None, raw: bool = False, tokenizer=None) -> torch.Tensor:
        """Prompt as int64 [P].

        With a chat template, text is the user's message (after ``system``, if given) wrapped as
        ``apply_chat_template(..., add_generation_prompt=True)`` does, and ``messages`` is a whole
        conversation; ``raw=True`` (or a tokenizer without a template) tokenizes text the way
        `transformers` would (special tokens added). Token ids are used as they are. ``tokenizer``: a copy of
        this Speculator's to use instead (the server gives each thread its own).
        """
        tokenizer = tokenizer or self.tokenizer
        if system is not None and not isinstance(system, str):
            raise SpeculaError(f"system must be text (str), got {type(system).__name__}")
        if prompt is not None and not isinstance(prompt, str):
            prompt = _token_ids(prompt)
        for text in [prompt, system, *(m.get("content") for m in messages or [] if isinstance(m, dict))]:
            _check_text(text)
        ids = chat_ids(tokenizer, prompt, messages, system, raw)
        if ids is None and isinstance(prompt, str):
            if not prompt.strip():
                raise SpeculaError("the prompt is empty")
            ids = tokenizer(prompt, verbose=False).input_ids
        elif ids is None:
            if prompt is None:
                raise SpeculaError("give a prompt (text or token ids) or messages")
            ids = prompt
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
        # The target's and drafter's caches hold one generation: a second one would silently corrupt both.
        if not self._busy.acquire(blocking=False):
            raise SpeculaError("this Speculator is already generating: finish or close() the unfinished stream() "
                               "first, or load another Speculator for concurrent generations")
        try:
            text = IncrementalDecoder(self.tokenizer)
            for chunk in stream_tokens(self.target, self.drafter, ids, max_new_tokens, params, seed, stop_on_eos,
                                       acceptor=self.acceptor, stats=stats, budget=self.budget):
                yield StreamChunk(chunk, text.push(chunk))
            rest = text.finish()  # characters held back as incomplete at the last chunk
            if rest:
                yield StreamChunk([], rest)
        finally:
            self._busy.release()
            # The next generation may run on another thread (a web app's pool of workers): this thread's idle
            # OpenMP team would make GNU OpenMP stop that thread's team from spinning (`specula.openmp`).
            release_thread_team()

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


PROMPT_TYPES = "text (str), a list of token ids (int) or a 1-D integer tensor"


def _token_ids(prompt: object) -> list[int]:
    """A prompt that is not text as a list of ids, or a SpeculaError: never a silent reading of other types.

    bytes would iterate as one id per byte and floats would be truncated, so both are refused, as is a
    tensor of another rank or dtype [P] (bool included).
    """
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype == torch.bool or prompt.is_floating_point() or prompt.is_complex():
            raise SpeculaError(f"a prompt is {PROMPT_TYPES}; got a {prompt.dim()}-D {prompt.dtype} tensor")
        return prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise SpeculaError(f"a prompt is {PROMPT_TYPES}; got {type(prompt).__name__}")
    for i in prompt:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise SpeculaError(f"a prompt is {PROMPT_TYPES}; the list holds {i!r} ({type(i).__name__})")
    return [int(i) for i in prompt]


def _check_text(text: object) -> None:
    """Text must be encodable as UTF-8 (command-line bytes that are not UTF-8 arrive as lone surrogates)."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise SpeculaError(f"the prompt is not valid UTF-8 text (at character {err.start})") from None
