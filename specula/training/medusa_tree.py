"""Sizing a Medusa tree from measured head accuracies (training time): the most probable rank paths.

After training, `specula.training.medusa_trainer` measures each head's per-rank accuracy on held-out
samples and keeps the tree that maximises expected accepted drafts for a node budget; the drafter
(`specula.drafters.medusa`) only reads the saved choices.
"""

from __future__ import annotations

import heapq

import torch

from specula.drafters.medusa import check_choices
from specula.errors import SpeculaError


def build_choices(accuracy: torch.Tensor, nodes: int) -> list[list[int]]:
    """The ``nodes`` most probable rank paths, grown greedily from the root (the Medusa paper's sparse tree).

    accuracy [K, R]: accuracy[k, r] is the measured probability that head k + 1's rank-r token is the
    right one. A path's probability is the product of its ranks' accuracies (heads taken as
    independent), which never exceeds its parent's, so always adding the most probable child of a
    node already in the tree yields the ``nodes`` most probable paths, a connected tree maximising
    the expected number of accepted drafts under that model. Ties go to shallower, lower-rank paths.
    """
    if accuracy.ndim != 2 or accuracy.numel() == 0:
        raise SpeculaError("head accuracies must be a [heads, ranks] table")
    if nodes < 1:
        raise SpeculaError(f"a Medusa tree needs at least one node, got {nodes}")
    acc = accuracy.double().clamp(0.0, 1.0).tolist()
    heads, ranks = len(acc), len(acc[0])
    chosen: list[tuple[int, ...]] = []
    frontier = [(-acc[0][r], 1, (r,)) for r in range(ranks)]
    heapq.heapify(frontier)
    while frontier and len(chosen) < nodes:
        negative, depth, path = heapq.heappop(frontier)
        chosen.append(path)
        if depth < heads:
            for r in range(ranks):
                heapq.heappush(frontier, (negative * acc[depth][r], depth + 1, path + (r,)))
    return check_choices([list(p) for p in chosen])


def expected_accepted(choices: list[list[int]], accuracy: torch.Tensor) -> float:
    """Expected accepted drafts per cycle of a tree under the independence model of `build_choices`."""
    acc = accuracy.double().tolist()
    total = 0.0
    for path in choices:
        if len(path) > len(acc) or max(path) >= len(acc[0]):
            continue  # ranks beyond the measured table count as never right
        prob = 1.0
        for depth, rank in enumerate(path):
            prob *= acc[depth][rank]
        total += prob
    return total
