"""Turning logits into the distribution a token is drawn from.

Temperature, top-k and top-p follow `transformers` exactly: logits are cast to
float32, then warped in the order temperature → top-k → top-p (the order
`GenerationMixin._get_logits_processor` uses), then softmax. The same function
serves the target and every drafter, so both sides of a speculative sampling
step see identically processed distributions. Temperature 0 means greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specula.errors import SpeculaError

MIN_TEMPERATURE = 1e-6  # logits up to ~1e4 stay finite in float32 when divided by it
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64-bit seeds


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
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpeculaError(f"{name} must be a number, got {value!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise SpeculaError(f"top_k must be a whole number, got {self.top_k!r}")
        if not (0.0 <= self.temperature < math.inf):  # also rejects NaN
            raise SpeculaError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            # Dividing logits by it overflows float32 to inf and the softmax to NaN.
            raise SpeculaError(f"temperature {self.temperature} is too small to sample with (below "
                               f"{MIN_TEMPERATURE:g}); use 0 for greedy decoding")
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
    """Draw one token id from ``probs`` [V], by inverting its cumulative distribution at one uniform draw
    (`sample_rows`): `torch.multinomial` drew V exponentials for it, ~1.1 ms for SmolLM2's 49k vocabulary on a CPU
    core, every sampled decode step and every speculative cycle at T > 0 (a fifth of eagle3's non-forward time)."""
    # On the distribution's device, where the decode's generator lives (as in `accept_speculative`).
    uniform = torch.rand(1, generator=generator, device=probs.device)
    return int(sample_rows(probs[None], uniform)[0].item())


def sample_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] by inverting its cumulative distribution at ``uniforms`` [B] in
    [0, 1): returns int64 [B] (``uniforms`` [B, k]: k i.i.d. tokens per row, int64 [B, k]). Exact sampling, but
    one cumulative sum for the whole batch instead of `torch.multinomial`'s V exponential draws per row (about 1 ms
    per row for a 49k vocabulary on a CPU core).
    A token of probability zero is never drawn (the search takes the first index whose cumulative mass exceeds
    the point). The sum runs in float64 where the device has it: in float32 a 49k-term running sum rounds each
    token's share by up to ~1e-7, a distortion of the distribution up to ~1e-3 in total variation."""
    exact = torch.float32 if probs.device.type == "mps" else torch.float64  # MPS has no float64
    cdf = probs.to(exact).cumsum(dim=-1)
    points = uniforms.to(cdf.device, exact).reshape(probs.shape[0], -1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, points, right=True).clamp_max(probs.shape[-1] - 1)
    return tokens.view(uniforms.shape)


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from ``logits`` [V]: argmax when greedy, else a sample."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    return sample(probabilities(logits, params), generator)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device``, seeded when ``seed`` is given (else from fresh entropy)."""
    check_seed(seed)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def check_seed(seed: int | None) -> None:
    """A seed must be a whole number in [0, 2**64 - 1] (or None for fresh entropy)."""
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise SpeculaError(f"seed must be a whole number in [0, 2**64 - 1], got {seed!r}")
