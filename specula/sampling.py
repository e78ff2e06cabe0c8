"""Turning logits into the distribution a token is drawn from.

Temperature, top-k and top-p follow `transformers` exactly: logits are cast to
float32, then warped in the order temperature → top-k → top-p (the order
`GenerationMixin._get_logits_processor` uses), then softmax. The same function
serves the target and every drafter, so both sides of a speculative sampling
step see identically processed distributions. Temperature 0 means greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specula.errors import SpeculaError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy decoding.

    ``top_k == 0`` and ``top_p == 1.0`` disable those filters. Unlike
    `transformers`' GenerationConfig the default ``top_k`` is 0, not 50: by
    default sampling draws from the model's full distribution.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):  # also rejects NaN
            raise SpeculaError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SpeculaError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpeculaError(f"top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to ``logits`` [..., V]; returns float32 [..., V].

    Filtered entries are set to -inf. Must not be called for greedy params.
    """
    scores = logits.float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    vocab = scores.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass stays within 1 - top_p; the most probable token always stays.
        drop_sorted = cumulative <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution [..., V] (float32) that sampling with ``params`` draws from."""
    return torch.softmax(warp_logits(logits, params), dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from ``probs`` [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from ``logits`` [V]: argmax when greedy, else a sample."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    return sample(probabilities(logits, params), generator)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device``, seeded when ``seed`` is given (else from fresh entropy)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
