"""Prompts the target writes itself (the Magpie technique), so any chat model can get a head with no dataset.

A chat model that is given only the beginning of a conversation up to where a user
message starts (its chat template's user prefix, e.g. ``<|im_start|>user\\n`` after the
template's default system turn) continues with a plausible user message and closes the
turn. Sampled at temperature 1 many times, that yields varied training prompts drawn
from the model's own idea of what users ask — exactly the distribution its draft head
will face. The raw messages are filtered:

- length: a message must close its turn (a reply cut off at ``max_new_tokens`` is dropped)
  and have between ``min_chars`` and ``max_chars`` characters;
- language: at least ``min_latin`` of its letters are Latin-script letters, and letters are
  at least half of its visible characters — this drops code dumps, emoji runs and other
  scripts, which a small English chat model writes badly;
- near-duplicates: a message whose word 3-grams overlap a kept message's by a Jaccard
  similarity of ``max_similarity`` or more is dropped (exact repeats included).

Generation is batched and seeded per batch, so a seed gives the same prompts every time.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tqdm.auto import tqdm

from specula.errors import SpeculaError
from specula.runtime.target import Target
from specula.training.regeneration import generate_batch

PROBE = "SpeculaUserMessageProbe"


@dataclass(frozen=True)
class SynthesisOptions:
    """How many prompts to keep and how they are sampled and filtered."""

    count: int = 200
    seed: int = 0
    temperature: float = 1.0
    max_new_tokens: int = 96
    batch_size: int = 16
    min_chars: int = 12
    max_chars: int = 600
    min_latin: float = 0.9
    max_similarity: float = 0.7
    max_attempts: int | None = None  # generations before giving up; default 6 × count

    def __post_init__(self) -> None:
        if self.count < 1 or self.batch_size < 1 or self.max_new_tokens < 1:
            raise SpeculaError("prompt synthesis needs count, batch size and max_new_tokens >= 1")
        if not (0.0 < self.temperature < float("inf")):
            raise SpeculaError(f"prompt synthesis samples: temperature must be > 0 and finite, got {self.temperature}")
        if not (0 < self.min_chars <= self.max_chars):
            raise SpeculaError(f"need 0 < min_chars <= max_chars, got {self.min_chars} and {self.max_chars}")
        if not (0.0 <= self.min_latin <= 1.0 and 0.0 < self.max_similarity <= 1.0):
            raise SpeculaError("min_latin must be in [0, 1] and max_similarity in (0, 1]")


def user_prefix_ids(tokenizer) -> list[int]:
    """Token ids of a conversation up to where the first user message's text starts (its template's prefix)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpeculaError("prompt synthesis needs a chat model: the tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROBE}], tokenize=False)
    if PROBE not in text:
        raise SpeculaError("the chat template does not place the user's message in the conversation")
    prefix = text[: text.index(PROBE)]
    ids = tokenizer(prefix, add_special_tokens=False).input_ids
    if not ids:
        raise SpeculaError("the chat template has no user prefix to continue from")
    return list(ids)


def shingles(text: str) -> frozenset[tuple[str, ...]]:
    """Word 3-grams of the normalised text (lower case, words of letters and digits); single words for short texts."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    if len(words) < 3:
        return frozenset((w,) for w in words)
    return frozenset(zip(words, words[1:], words[2:], strict=False))


def similarity(a: frozenset, b: frozenset) -> float:
    """Jaccard similarity of two shingle sets (1.0 for two empty ones)."""
    return len(a & b) / len(a | b) if a or b else 1.0


def rejection(text: str, options: SynthesisOptions) -> str:
    """Why ``text`` fails the length or language filter ("" when it passes)."""
    if not (options.min_chars <= len(text) <= options.max_chars):
        return "length"
    letters = [c for c in text if c.isalpha()]
    visible = [c for c in text if not c.isspace()]
    if not letters or len(letters) < 0.5 * len(visible):
        return "language"
    if sum(unicodedata.name(c, "").startswith("LATIN") for c in letters) < options.min_latin * len(letters):
        return "language"
    return ""


@dataclass
class SynthesisReport:
    prompts: list[str]
    generated: int
    dropped: dict[str, int]


def synthesize_prompts(target: Target, options: SynthesisOptions = SynthesisOptions(),
                       log: Callable[[str], None] | None = None, progress: bool = True) -> SynthesisReport:
    """User messages sampled from ``target``'s own chat template, filtered; deterministic for a seed."""
    prefix = user_prefix_ids(target.tokenizer)
    end_of_turn = target.eos_token_ids
    attempts = options.max_attempts or 6 * options.count
    kept: list[str] = []
    kept_shingles: list[frozenset] = []
    dropped = {"unfinished": 0, "length": 0, "language": 0, "duplicate": 0}
    generated = 0
    bar = tqdm(total=options.count, desc="prompts", disable=not progress, dynamic_ncols=True)
    for batch, size in enumerate(_batches(attempts, options.batch_size)):
        if len(kept) >= options.count:
            break
        replies = generate_batch(target, [prefix] * size, options.max_new_tokens, options.temperature,
                                 seed=(options.seed * 1_000_003 + batch) % 2**64)
        generated += size
        for reply in replies:
            if not reply or reply[-1] not in end_of_turn:
                dropped["unfinished"] += 1
                continue
            text = target.tokenizer.decode(reply, skip_special_tokens=True).strip()
            reason = rejection(text, options)
            if reason:
                dropped[reason] += 1
                continue
            grams = shingles(text)
            if any(similarity(grams, other) >= options.max_similarity for other in kept_shingles):
                dropped["duplicate"] += 1
                continue
            kept.append(text)
            kept_shingles.append(grams)
            bar.update(1)
            if len(kept) >= options.count:
                break
    bar.close()
    if log is not None:
        log(f"kept {len(kept)} of {generated} generated user messages; dropped: "
            + ", ".join(f"{k} {v}" for k, v in dropped.items()))
    return SynthesisReport(kept, generated, dropped)


def _batches(total: int, size: int) -> Iterator[int]:
    while total > 0:
        yield min(size, total)
        total -= size
