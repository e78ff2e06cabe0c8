"""`specula.certify.power`: the distortion the check's distribution test detects, and the bound it rests on.

The non-central chi-square against scipy; the worst-case bound (any alternative of total variation δ has
non-centrality >= 4nδ²) by simulating the alternative that attains it; the control's distortion computed exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specula.certify.power import (
    POWER,
    cells_tv,
    chi2_critical,
    detectable_tv,
    noncentral_chi2_sf,
    required_noncentrality,
    samples_for_tv,
    tilt,
    tilted_tv,
)


@pytest.mark.parametrize(("df", "lam", "x"), [(1, 5.0, 3.8), (10, 30.0, 25.0), (50, 80.0, 90.0), (7, 0.0, 11.0)])
def test_noncentral_chi_square_matches_scipy(df, lam, x):
    expected = stats.ncx2.sf(x, df, lam) if lam else stats.chi2.sf(x, df)
    assert noncentral_chi2_sf(x, df, lam) == pytest.approx(expected, rel=1e-6)
    assert chi2_critical(5e-4, df) == pytest.approx(stats.chi2.isf(5e-4, df), rel=1e-6)


def test_detectable_distortion_shrinks_with_samples_and_the_plan_inverts_it():
    level = 5e-4
    assert detectable_tv(400, 10, level) > detectable_tv(1600, 10, level)
    assert detectable_tv(1600, 10, level) == pytest.approx(detectable_tv(400, 10, level) / 2, rel=1e-6)
    n = samples_for_tv(0.1, 2, 10, level)
    assert detectable_tv(2 * n, 10, level) <= 0.1 < detectable_tv(2 * (n - 1), 10, level)
    assert detectable_tv(1000, 0, level) == 1.0 and required_noncentrality(0, level) == float("inf")


@pytest.mark.parametrize(("cells", "n"), [([0.3, 0.2, 0.15, 0.15, 0.1, 0.1], 500),
                                         ([0.5, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05], 200)])
def test_every_alternative_attaining_the_bound_is_detected_with_the_stated_power(cells, n):
    # q moves δ = detectable_tv of probability onto a set of cells of mass m, in proportion to p, and off the rest
    # (the shapes for which λ is least, 4nδ² at m = 1/2). Every such set: the simulated Pearson chi-square at
    # level 5e-4 must reject with the power every verdict states.
    rng = np.random.default_rng(0)
    p, level, trials = np.array(cells), 5e-4, 4000
    delta = detectable_tv(n, len(p) - 1, level)
    critical = stats.chi2.isf(level, len(p) - 1)
    worst = 1.0
    for bits in range(1, 2 ** len(p) - 1):
        up = np.array([(bits >> i) & 1 for i in range(len(p))], dtype=bool)
        m = p[up].sum()
        if delta >= 1 - m:
            continue  # no valid q of this shape
        q = np.where(up, p * (1 + delta / m), p * (1 - delta / (1 - m)))
        assert q.sum() == pytest.approx(1.0) and abs(q - p).sum() / 2 == pytest.approx(delta)
        counts = rng.multinomial(n, q, size=trials)
        statistic = ((counts - n * p) ** 2 / (n * p)).sum(axis=1)
        worst = min(worst, float(np.mean(statistic > critical)))
    assert worst >= POWER - 0.02, worst  # 4000 trials: sd 0.006


def test_the_controls_distortion_is_computed_exactly_through_the_cells():
    probs = torch.tensor([0.5, 0.3, 0.2])
    assert torch.allclose(tilt(probs, 1.0), probs.double())
    assert torch.allclose(tilt(probs, 2.0), probs.double().sqrt() / probs.double().sqrt().sum())
    # Two tokens, the same distribution after every prefix; cells: the three likeliest sequences.
    rows = {(): probs, (0,): probs, (1,): probs, (2,): probs}
    cells = {(0, 0): 0.25, (0, 1): 0.15, (1, 0): 0.15}
    assert tilted_tv(rows, cells, 1.0) == pytest.approx(0.0, abs=1e-7)  # float32 rows
    q = tilt(probs, 2.0)
    other = {(a, b): float(probs[a] * q[b]) for a, b in cells}  # the first token is the target's own
    assert tilted_tv(rows, cells, 2.0) == pytest.approx(cells_tv(cells, other))
    assert cells_tv(cells, other) == pytest.approx((sum(abs(other[k] - cells[k]) for k in cells)
                                                    + abs(sum(other.values()) - sum(cells.values()))) / 2)
