"""Testing that sampled token sequences follow the target's exact sampling distribution.

Given a prompt and n sequences of L new tokens drawn by some sampler (the speculative loop), the
null hypothesis is that every token was drawn from the target's warped distribution
p(. | prompt, earlier tokens) (temperature, top-k, top-p as `specula.sampling` applies them).
Two tests of it, both computed from the target's exact probabilities (no reference sampler; computed
once per distinct prefix by `specula.certify.exact_distribution`):

1. Likelihood z-test. For token j of sample i let s_ij = log p(x_ij | prefix) − E_p[log p] (E and Var
   under the exact conditional given the *observed* prefix). Under the null each s_ij has mean 0 given
   everything before it, so Z = Σ s_ij / sqrt(Σ Var_p[log p]) is a normalised martingale and ~N(0, 1)
   for many tokens (martingale CLT); two-sided p-value. It needs no enumeration of the V^L sequences
   and uses every sample, however rare. It is the locally most powerful test against a wrong
   temperature (the score of the inverse temperature is exactly s_ij at T = 1) and sees every bug
   that makes the output more or less confident than the target: a residual that is not the
   residual, a draft distribution that is not the one the tokens came from, a bonus token from the
   wrong distribution. Blind spot: a distortion that keeps the mean log-probability.
2. Pooled chi-square on the joint of the L tokens, the omnibus test. Cells are fixed before looking
   at the samples: every sequence whose exact probability is >= MIN_EXPECTED / n (found by a pruned
   exact enumeration of the target's tree of continuations: a sequence is no likelier than its
   prefix), one cell each, and one tail cell for all other sequences (probability 1 − their sum).
   Every expected count is >= MIN_EXPECTED, the usual validity condition. Statistics of several
   prompts add up (independent samples), as do their degrees of freedom.

The two are combined by Bonferroni: p = min(1, 2 · min(p_z, p_chi2)). An observed token that the
target gives probability 0 (outside its top-k or top-p set) makes both p-values 0.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from specula.certify.exact_distribution import ExactDistribution

MIN_EXPECTED = 5.0


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df), df >= 1 (scipy-free: the regularised upper gamma)."""
    value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                    torch.tensor(max(statistic, 0.0) / 2, dtype=torch.float64))
    return float(value)


def normal_two_sided(z: float) -> float:
    """P(|Z| >= |z|) for Z ~ N(0, 1)."""
    return math.erfc(abs(z) / math.sqrt(2.0))


@dataclass
class TokenStatistics:
    """Per observed sequence, per position j (arrays [L], float64): log p(x_j | prefix), E_p[log p], Var_p[log p]."""

    log_prob: dict[tuple[int, ...], torch.Tensor]
    mean: dict[tuple[int, ...], torch.Tensor]
    variance: dict[tuple[int, ...], torch.Tensor]


def _moments(probs: torch.Tensor) -> tuple[float, float]:
    """(E_p[log p], Var_p[log p]) of one distribution ``probs`` [V], in float64."""
    probs = probs.double()
    logs = torch.log(probs)
    plogp = torch.where(probs > 0, probs * logs, torch.zeros_like(probs))
    mean = float(plogp.sum())
    second = float(torch.where(probs > 0, plogp * logs, torch.zeros_like(probs)).sum())
    return mean, max(second - mean * mean, 0.0)


def token_statistics(exact: ExactDistribution, sequences: list[tuple[int, ...]]) -> TokenStatistics:
    """Exact conditional statistics of every distinct sequence in ``sequences`` (all of one length L).

    Each distinct prefix's distribution and moments are computed once (`ExactDistribution`).
    """
    distinct = sorted(set(sequences))
    exact.compute(seq[:j] for seq in distinct for j in range(len(seq)))
    moments: dict[tuple[int, ...], tuple[float, float]] = {}
    out = TokenStatistics({}, {}, {})
    for key in distinct:
        prefixes = [key[:j] for j in range(len(key))]
        for prefix in prefixes:
            if prefix not in moments:
                moments[prefix] = _moments(exact[prefix])
        out.log_prob[key] = torch.tensor([float(exact[p][x]) for p, x in zip(prefixes, key, strict=True)],
                                         dtype=torch.float64).log()
        out.mean[key] = torch.tensor([moments[p][0] for p in prefixes], dtype=torch.float64)
        out.variance[key] = torch.tensor([moments[p][1] for p in prefixes], dtype=torch.float64)
    return out


def likely_sequences(exact: ExactDistribution, length: int, threshold: float) -> dict[tuple[int, ...], float]:
    """Every sequence of ``length`` new tokens with exact probability >= ``threshold``, with that probability.

    Level by level, only prefixes at or above the threshold are extended (a sequence is no likelier than
    its prefix), so each level holds at most 1 / threshold prefixes.
    """
    prefixes: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        exact.compute(prefixes)
        grown: dict[tuple[int, ...], float] = {}
        for key, prob in prefixes.items():
            joint = exact[key].double() * prob
            for token in torch.nonzero(joint >= threshold).flatten().tolist():
                grown[key + (token,)] = float(joint[token])
        prefixes = grown
        if not prefixes:
            break
    return prefixes


def tested_cells(cells: dict[tuple[int, ...], float], n: int) -> dict[tuple[int, ...], float]:
    """The cells the chi-square of ``n`` samples tests besides the tail: ``cells``, less the smallest when the
    tail's expected count is below MIN_EXPECTED (that cell joins the tail)."""
    if cells and n * max(1.0 - sum(cells.values()), 0.0) < MIN_EXPECTED:
        smallest = min(cells, key=cells.get)
        return {key: prob for key, prob in cells.items() if key != smallest}
    return dict(cells)


def chi_square_df(cells: dict[tuple[int, ...], float], n: int) -> int:
    """The degrees of freedom of `chi_square` for ``n`` samples against ``cells``: its cells and tail, less one."""
    return len(tested_cells(cells, n))


def chi_square(counts: Counter, cells: dict[tuple[int, ...], float]) -> tuple[float, int]:
    """(statistic, degrees of freedom) of ``counts`` against ``cells`` + one tail cell (df 0: no test).

    ``cells``: sequence -> exact probability, chosen before sampling. A tail expected below MIN_EXPECTED
    is merged with the smallest cell (`tested_cells`).
    """
    n = sum(counts.values())
    expected = {key: n * prob for key, prob in tested_cells(cells, n).items()}
    observed = {key: counts.get(key, 0) for key in expected}
    tail_expected = max(n - sum(expected.values()), 0.0)
    tail_observed = n - sum(observed.values())
    pairs = [(observed[k], expected[k]) for k in expected] + [(tail_observed, tail_expected)]
    if len(pairs) < 2:
        return 0.0, 0
    return sum((o - e) ** 2 / e for o, e in pairs), len(pairs) - 1


@dataclass
class FitResult:
    """Outcome of the two tests over one or more prompts; p_value combines them (Bonferroni)."""

    samples: int
    z: float
    p_likelihood: float
    chi2: float
    df: int
    p_chi2: float | None
    impossible: int  # observed tokens the target gives probability 0

    @property
    def p_value(self) -> float:
        if self.impossible:
            return 0.0
        tests = [p for p in (self.p_likelihood, self.p_chi2) if p is not None]
        return min(1.0, len(tests) * min(tests))

    def as_dict(self) -> dict:
        return {"samples": self.samples, "p_value": self.p_value, "likelihood_z": self.z,
                "p_likelihood": self.p_likelihood, "chi2": self.chi2, "chi2_df": self.df, "p_chi2": self.p_chi2,
                "impossible_tokens": self.impossible}


def fit(samples: list[tuple[list[tuple[int, ...]], TokenStatistics, dict[tuple[int, ...], float]]]) -> FitResult:
    """Both tests over prompts given as (sampled sequences, their exact statistics, chi-square cells)."""
    total_s = total_var = chi2 = 0.0
    df = impossible = count = 0
    for sequences, statistics, cells in samples:
        count += len(sequences)
        for key in sequences:
            log_prob = statistics.log_prob[key]
            impossible += int(torch.isinf(log_prob).sum())
            finite = torch.isfinite(log_prob)
            total_s += float((log_prob - statistics.mean[key])[finite].sum())
            total_var += float(statistics.variance[key][finite].sum())
        statistic, freedom = chi_square(Counter(sequences), cells)
        chi2, df = chi2 + statistic, df + freedom
    z = total_s / math.sqrt(total_var) if total_var > 0 else 0.0
    p_chi2 = (0.0 if math.isinf(chi2) else chi2_sf(chi2, df)) if df else None
    return FitResult(count, z, normal_two_sided(z), chi2, df, p_chi2, impossible)
