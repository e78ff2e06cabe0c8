"""The verification cost curve v(n): seconds of one target forward over n tokens, measured and interpolated.

Speculation pays only when the tokens a draft wins outweigh what verifying it costs, and on a CPU a
forward over k tokens costs more than one over a single token. `specula calibrate` measures the curve
into the profile, the server measures it when it starts (`specula.draft_budget`), and the bench's theory
(`specula.bench.theory`) predicts speedups from it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping

import torch

from specula.runtime.target import FeatureRequest

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def verify_cost(curve: Mapping[int, float], n: int) -> float:
    """Time of one target forward over ``n`` tokens, linearly interpolated between measured sizes."""
    sizes = sorted(curve)
    if not sizes:
        raise ValueError("empty verify-cost curve")
    if n <= sizes[0]:
        return curve[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:], strict=False):
        if n <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)
    if len(sizes) == 1:
        return curve[sizes[0]]
    lo, hi = sizes[-2], sizes[-1]  # extrapolate with the last slope
    return curve[hi] + (curve[hi] - curve[lo]) * (n - hi) / (hi - lo)



def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a timing ends when the GPU is done, not when Python returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_verify_curve(target, prefix: list[int], sizes=VERIFY_SIZES, repeats: int = 5,
                         features: FeatureRequest | None = None) -> dict[int, float]:
    """{n: median seconds of one target forward over n tokens after ``prefix``}; sizes that do not fit are skipped.

    The sizes are timed in interleaved rounds (every size once per round, the first round a warm-up), so a
    slow stretch of a shared or virtual machine slows every size alike instead of one: on this project's
    2-core VM one-token steps of the same model vary by 20 % from minute to minute.
    """
    device = target.device
    target.prefill(torch.tensor(prefix, dtype=torch.long, device=device))
    sizes = [n for n in sizes if len(prefix) + n <= target.max_length]
    times = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            tokens = torch.tensor([prefix[i % len(prefix)] for i in range(n)], dtype=torch.long, device=device)
            mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            sync(device)
            start = time.perf_counter()
            target.forward(tokens, mask, features=features or FeatureRequest())  # the method's own graphs
            sync(device)
            if r:  # the first round is a warm-up
                times[n].append(time.perf_counter() - start)
            target.commit([])  # keep nothing: the prefix stays as it was
    return {n: statistics.median(t) for n, t in times.items()}
