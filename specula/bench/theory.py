"""The theory of speculative decoding's speed (lecture notes, "Analysis 1, 3, 5"), plus a tree version.

With per-token acceptance rate α (i.i.d.), γ drafted tokens per cycle and cost
coefficient c (one draft step over one target step):

- expected tokens per cycle      E = (1 − α^(γ+1)) / (1 − α)
- expected improvement factor    E / (γc + 1)

The lecture's factor assumes verifying γ + 1 tokens costs one target step. On a
CPU it does not, so `hardware_improvement` divides by γc + v(γ+1)/v(1) with
v(n) the measured time of one target forward over n tokens.

For trees, `best_tree` assumes only the rank of a node among its siblings
decides how likely it is accepted (a position-only model, as Sequoia assumes):
p[k] = P(the rank-k child is accepted | its parent was). A node's value is the
product of p along its path, the expected tokens per cycle of a tree are
1 + the sum of its node values, and the best tree of N nodes takes the N most
valuable nodes. Cycle time = depth × draft step + v(N + 1).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from specula.runtime.verify_cost import verify_cost


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens per cycle with γ drafts: (1 − α^(γ+1)) / (1 − α); γ + 1 when α = 1."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def improvement_factor(alpha: float, gamma: int, c: float) -> float:
    """The lecture's expected walltime improvement: (1 − α^(γ+1)) / ((1 − α)(γc + 1))."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def hardware_improvement(alpha: float, gamma: int, c: float, curve: Mapping[int, float] | None = None) -> float:
    """Expected improvement when verifying γ + 1 tokens costs v(γ+1)/v(1) target steps (the lecture's if None)."""
    verify = 1.0 if not curve else verify_cost(curve, gamma + 1) / verify_cost(curve, 1)
    return expected_tokens(alpha, gamma) / (gamma * c + verify)


def best_gamma(alpha: float, c: float, curve: Mapping[int, float] | None = None, max_gamma: int = 16) -> int:
    """γ in 1..max_gamma with the highest expected improvement (ties go to the shorter draft)."""
    return max(range(1, max_gamma + 1), key=lambda g: (hardware_improvement(alpha, g, c, curve), -g))


def _best_nodes(rank_acceptance: Sequence[float], max_depth: int, max_nodes: int) -> list[tuple[float, int, int]]:
    """Most valuable nodes first: (value, depth, parent index in this list or -1), up to ``max_nodes``."""
    p = [min(max(float(x), 0.0), 1.0) for x in rank_acceptance]
    heap = [(-p[k], k, 1, -1) for k in range(len(p)) if p[k] > 0]  # (-value, rank, depth, parent)
    heapq.heapify(heap)
    chosen: list[tuple[float, int, int]] = []
    while heap and len(chosen) < max_nodes:
        negative, _, depth, parent = heapq.heappop(heap)
        chosen.append((-negative, depth, parent))
        if depth < max_depth:
            index = len(chosen) - 1
            for k in range(len(p)):
                if p[k] > 0:
                    heapq.heappush(heap, (negative * p[k], k, depth + 1, index))
    return chosen


def tree_plan(rank_acceptance: Sequence[float], nodes: int, depth: int) -> dict:
    """Expected tokens per cycle and shape of the best ``nodes``-node tree no deeper than ``depth``."""
    chosen = _best_nodes(rank_acceptance, depth, nodes)
    layer_sizes: dict[int, int] = {}
    children: dict[int, int] = {}
    for _, d, parent in chosen:
        layer_sizes[d] = layer_sizes.get(d, 0) + 1
        children[parent] = children.get(parent, 0) + 1
    expanded: dict[int, int] = {}  # nodes with children, per layer
    for parent in children:
        d = 0 if parent < 0 else chosen[parent][1]
        expanded[d] = expanded.get(d, 0) + 1
    return {
        "nodes": len(chosen),
        "depth": max(layer_sizes, default=0),
        "expected_tokens": 1.0 + sum(v for v, _, _ in chosen),
        "top_k": max([*children.values(), *expanded.values(), 1]),
    }


def best_tree(rank_acceptance: Sequence[float], draft_step: float, curve: Mapping[int, float],
              max_nodes: int = 128, max_depth: int = 12) -> dict:
    """Node budget and depth with the highest predicted tokens/s, and the prediction.

    ``draft_step``: seconds per draft step (one layer of the tree);
    ``curve``: {tokens: seconds} of one target forward. The best-first order of
    `_best_nodes` makes its first N nodes the best N-node tree, so one pass per
    depth limit covers every budget.
    """
    step = verify_cost(curve, 1)
    best_rate, best_key = 1.0 / step, (0, 0)  # drafting nothing: plain decoding
    for depth_limit in range(1, max_depth + 1):
        total, deepest = 1.0, 0
        for count, (value, depth, _) in enumerate(_best_nodes(rank_acceptance, depth_limit, max_nodes), start=1):
            total += value
            deepest = max(deepest, depth)
            rate = total / (deepest * draft_step + verify_cost(curve, count + 1))
            if rate > best_rate * (1 + 1e-9):
                best_rate, best_key = rate, (count, depth_limit)
    nodes, depth_limit = best_key
    plan = tree_plan(rank_acceptance, nodes, depth_limit) if nodes else {
        "nodes": 0, "depth": 0, "expected_tokens": 1.0, "top_k": 1}
    plan["tokens_per_s"] = best_rate
    plan["predicted_speedup"] = best_rate * step
    return plan
