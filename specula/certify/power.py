"""The power of `specula check`'s distribution test: the smallest distortion it detects, and the samples it needs.

A test that finds nothing proves nothing unless it could have found something. This module turns the test's
sample sizes into the distortion it would detect, so that every verdict can state it, and the distortion the
user asks to detect into the sample size that reaches it, so that the check gathers those samples before it
certifies (or says "inconclusive" where a cap stops it).

Distortion is measured in total variation over the test's cells. For one prompt the pooled chi-square
(`specula.certify.distribution_test`) splits the space of L-token continuations into k + 1 cells fixed before
sampling (the likely sequences and one tail); the target gives them probabilities p_i, a sampler that is off
gives q_i. Its distortion there is δ = ½ Σ |q_i − p_i|: the total variation of the sampler's distribution
seen through the cells (at most its total variation over whole sequences; a change that only moves probability
inside the tail is not seen by the chi-square, only by the likelihood z-test).

The bound. Pearson's statistic over n samples is approximately non-central chi-square with k degrees of
freedom and non-centrality λ = n Σ (q_i − p_i)² / p_i (the standard large-sample power approximation, valid
under the test's own condition of >= 5 expected per cell). By Cauchy-Schwarz,

    (Σ |q_i − p_i|)² = (Σ (|q_i − p_i| / √p_i) · √p_i)² <= Σ (q_i − p_i)² / p_i · Σ p_i,

so λ >= 4 n δ² for *every* alternative of distortion δ, whatever its shape: the worst case has no free
parameter left. Prompts are independent and their statistics add, so with n samples on each of m prompts and a
distortion of at least δ on each, λ >= 4 m n δ² with df = Σ k. The chi-square rejects at level α/2 (the
Bonferroni share it has next to the z-test), so with the critical value c = χ²⁻¹(1 − α/2; df) its power is at
least P(χ'²(df, 4 m n δ²) > c). `detectable_tv` solves that for δ, `samples_for_tv` for n.

Margin. The non-central approximation is a large-sample one; at these small levels it is slightly optimistic.
Simulating Pearson's statistic against every alternative that attains the bound (q_i = p_i(1 + δ/m) on a set of
cells of mass m, p_i(1 − δ/(1 − m)) on the rest; every such set of 6 to 8 cells, random sets of 21 and 31)
gave a worst power of 0.78 where the approximation promised 0.8, and >= 0.82 where it promised 0.85. So the
check solves for PLANNED_POWER = 0.85 and states 0.8 (`POWER`); tests/test_check_power.py repeats the
simulation. That is evidence over the alternatives that attain the bound, not a proof for every alternative.
The cells depend on n (a sequence is a cell when n p >= 5), so `specula.certify.check` plans n by iterating
cells and `samples_for_tv` to a fixed point before it samples anything: the sample size is chosen from the
target's exact probabilities alone, never from the samples, so the test's level is untouched (no optional
stopping).

The control checks the bound where it matters, on the method's own loop: the method's acceptor judging drafts
against the target's distribution tilted to q ∝ p^(1/f) (the target at f times the temperature), which its
lossless rule then reproduces from the second token on. `tilted_tv` computes that control's distortion through
the same cells exactly, so f is chosen to make it the distortion the check claims to detect.
"""

from __future__ import annotations

import math

import torch

from specula.certify.distribution_test import chi2_sf

POWER = 0.8  # the power every verdict states
PLANNED_POWER = 0.85  # what the large-sample approximation is solved for, so that POWER holds (see above)
TAIL = 1e-12  # Poisson weight left out of the non-central chi-square's mixture


def chi2_critical(level: float, df: int) -> float:
    """c with P(χ²(df) >= c) = ``level`` (bisection on `chi2_sf`)."""
    low, high = 0.0, float(df) + 10.0
    while chi2_sf(high, df) > level:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if chi2_sf(middle, df) > level else (low, middle)
    return high


def noncentral_chi2_sf(x: float, df: int, noncentrality: float) -> float:
    """P(χ'²(df, λ) >= x): the Poisson(λ/2) mixture of central chi-squares with df + 2j degrees of freedom."""
    half = noncentrality / 2
    spread = 12 * math.sqrt(half + 1)
    terms = torch.arange(max(0, int(half - spread)), int(half + spread) + 2, dtype=torch.float64)
    weights = torch.exp(terms * math.log(half) - half - torch.lgamma(terms + 1)) if half > 0 else (terms == 0).double()
    tails = torch.special.gammaincc((df + 2 * terms) / 2, torch.full_like(terms, x / 2))
    return float((weights * tails).sum())


def required_noncentrality(df: int, level: float, power: float = PLANNED_POWER) -> float:
    """The least λ with P(χ'²(df, λ) > χ²⁻¹(1 − level; df)) >= ``power``; inf for df 0 (no test)."""
    if df < 1:
        return math.inf
    critical = chi2_critical(level, df)
    low, high = 0.0, 1.0
    while noncentral_chi2_sf(critical, df, high) < power:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if noncentral_chi2_sf(critical, df, middle) < power else (low, middle)
    return high


def detectable_tv(total_samples: int, df: int, level: float, power: float = PLANNED_POWER) -> float:
    """The least distortion δ (total variation over the cells, on every prompt) detected with ``power`` (as the
    large-sample approximation has it) at ``level`` by a pooled chi-square with ``df`` degrees of freedom over
    ``total_samples`` samples; 1.0 when none is (no cells, or more than any distribution can be off)."""
    if total_samples < 1:
        return 1.0
    return min(1.0, math.sqrt(required_noncentrality(df, level, power) / (4 * total_samples)))


def samples_for_tv(tv: float, prompts: int, df: int, level: float, power: float = PLANNED_POWER) -> int:
    """Samples per prompt for `detectable_tv` to reach ``tv`` over ``prompts`` prompts with ``df`` in all."""
    need = required_noncentrality(df, level, power)
    return math.inf if math.isinf(need) else math.ceil(need / (4 * prompts * tv * tv))


def tilt(probs: torch.Tensor, factor: float) -> torch.Tensor:
    """q ∝ p^(1/factor) on p's support: ``probs`` [..., V] at ``factor`` times its temperature (float64)."""
    probs = probs.double()
    powered = torch.where(probs > 0, probs.clamp_min(1e-300) ** (1 / factor), torch.zeros_like(probs))
    return powered / powered.sum(-1, keepdim=True)


def cells_tv(cells: dict[tuple[int, ...], float], other: dict[tuple[int, ...], float]) -> float:
    """½ Σ |q − p| over ``cells`` (sequence -> p) and the tail cell (1 − the sum), q from ``other``."""
    inside = sum(abs(other[key] - prob) for key, prob in cells.items())
    tail = abs((1 - sum(other.values())) - (1 - sum(cells.values())))
    return (inside + tail) / 2


def tilted_tv(rows, cells: dict[tuple[int, ...], float], factor: float) -> float:
    """The distortion through ``cells`` of the control at ``factor``: the first token from the target's p, every
    later one from `tilt`(p, factor). ``rows[prefix]``: the target's distribution [V] after that prefix (an
    `ExactDistribution` that computed every prefix of the cells)."""
    tilted: dict[tuple[int, ...], torch.Tensor] = {}
    other = {}
    for key in cells:
        prob = float(rows[()][key[0]])
        for j in range(1, len(key)):
            prefix = key[:j]
            if prefix not in tilted:
                tilted[prefix] = tilt(rows[prefix], factor)
            prob *= float(tilted[prefix][key[j]])
        other[key] = prob
    return cells_tv(cells, other)


def control_factor(rows_and_cells: list, tv: float, largest: float = 4.0) -> tuple[float, float]:
    """(f, the control's mean distortion over the prompts at f): the least temperature factor f in (1, ``largest``]
    whose control is distorted by ``tv`` on average (bisection; the distortion grows with f), or ``largest``
    when even that stays below ``tv``. ``rows_and_cells``: (rows, cells) per prompt, as for `tilted_tv`."""
    def mean_tv(factor: float) -> float:
        return sum(tilted_tv(rows, cells, factor) for rows, cells in rows_and_cells) / len(rows_and_cells)

    if mean_tv(largest) <= tv:
        return largest, mean_tv(largest)
    low, high = 1.0, largest
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if mean_tv(middle) < tv else (low, middle)
    return high, mean_tv(high)
