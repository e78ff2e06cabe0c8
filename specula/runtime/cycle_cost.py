"""What a cycle of one sequence costs as served, fitted online from its timings, for the draft budget
(`specula.draft_budget`): the drafting seconds by draft depth (`DraftCost`) and the verifying seconds by block
size (`VerifyCost`).

The verify-cost curve (`specula.runtime.verify_cost`) times bare target forwards after a fixed prefix. A served
cycle costs more than its forward, and more with a draft than without: on a 2-core AVX2 EPYC (SmolLM2 q4_1, one
thread) a plain cycle verified in 14.6 ms where the curve's one-token forward took 9.8 (the context is longer, and
the logits, the acceptor and the commit come on top), and one draft node made the cycle 2.1 ms (15 %) dearer where
the curve's forwards of 2 and 1 tokens differ by 0.4 ms (the ancestor mask and positions, the logits of a second
row, the acceptor judging a draft). Planned with the curve alone, the budget bought τ that cost more than it
planned: at T=1 it ran 0.92-1.03x plain decoding where one node a cycle ran 1.00-1.11x.
"""

from __future__ import annotations

from collections.abc import Mapping

from specula.runtime.verify_cost import verify_cost

# Timings count with weight (1 - 1/TIMED_WINDOW)^age, in cycles of their kind (plain or drafted): the cost of a cycle
# moves as the context grows and the machine's other load comes and goes (30 % between two runs of one command).
TIMED_WINDOW = 128


def _line(n: float, x: float, y: float, xx: float, xy: float) -> tuple[float, float, float]:
    """Least squares y = fixed + slope · x from the (weighted) sums of n points: (fixed, slope, spread of x), both
    parts at least 0; with no spread in x, slope 0 and fixed the mean of y."""
    mean_x, mean_y = x / n, y / n
    spread = xx / n - mean_x ** 2
    if spread < 1e-9:
        return max(0.0, mean_y), 0.0, spread
    slope = max(0.0, (xy / n - mean_x * mean_y) / spread)
    return max(0.0, mean_y - slope * mean_x), slope, spread


class DraftCost:
    """Drafting seconds of a cycle against its draft's depth, fitted as c(d) = fixed + d · per_level by least
    squares over the drafts served (both parts at least 0).

    A head drafts one forward per level, but a suffix or prompt lookup pays mostly per cycle: served at one
    client, the bundled suffix drafter's cycles took ~0.3 ms a level when priced per level alone, which made an
    8-deep draft look 2.6 ms dear and capped one client at depth 4 (96.6 tokens/s on 12 MT-bench first turns, in
    process) where the fit gives 106.8. Drafts all of one depth cannot tell the parts apart: then the mean
    seconds per level prices every level, as before."""

    def __init__(self):
        self.n = self.depth = self.seconds = self.depth2 = self.depth_seconds = 0.0

    def observe(self, depth: int, seconds: float) -> None:
        self.n += 1
        self.depth += depth
        self.seconds += seconds
        self.depth2 += depth * depth
        self.depth_seconds += depth * seconds

    def __call__(self, depth: int) -> float:
        if depth == 0 or self.n == 0:
            return 0.0
        fixed, per_level, spread = _line(self.n, self.depth, self.seconds, self.depth2, self.depth_seconds)
        if spread < 1e-9:
            return depth * self.seconds / self.depth
        return fixed + depth * per_level


class VerifyCost:
    """Seconds from a draft's proposal to its commit (the target forward over the block, the acceptor, the commit,
    the drafter's observe) against the block's tokens, as timed on cycles of a sequence verified alone:

        v(k) = s · curve(k) + [k > 1] · (fixed + per_node · (k - 1))

    s, the plain cycles' timed seconds over the curve's one-token forward, carries the curve's shape to the served
    context; the draft cycles' seconds beyond s · curve(k) are what having a draft costs, fitted as a fixed part and a
    part per draft node. Both are weighted towards recent cycles (`TIMED_WINDOW`). Until a plain cycle is timed this
    is the curve alone (drafted cycles' seconds cannot be split into s and the extra without one: `DraftBudget` asks
    for a plain cycle once it has timed a few drafted ones); before any drafted cycle the extra is 0."""

    def __init__(self, curve: Mapping[int, float]):
        self.curve = dict(curve)
        self.plain_n = self.plain_ratio = 0.0  # weighted count and sum of timed / curve(1) over plain cycles
        # weighted sums over drafted cycles of 1, nodes, timed, curve(k), nodes², nodes · timed, nodes · curve(k)
        self.n = self.nodes = self.timed = self.bare = self.nodes2 = self.nodes_timed = self.nodes_bare = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One cycle verified alone: its block's tokens (the root and the draft nodes) and its verify seconds."""
        keep = 1.0 - 1.0 / TIMED_WINDOW
        bare = verify_cost(self.curve, tokens)
        if tokens <= 1:
            self.plain_n = self.plain_n * keep + 1.0
            self.plain_ratio = self.plain_ratio * keep + seconds / bare
            return
        nodes = tokens - 1
        self.n, self.nodes = self.n * keep + 1.0, self.nodes * keep + nodes
        self.nodes2 = self.nodes2 * keep + nodes ** 2
        self.timed, self.bare = self.timed * keep + seconds, self.bare * keep + bare
        self.nodes_timed = self.nodes_timed * keep + nodes * seconds
        self.nodes_bare = self.nodes_bare * keep + nodes * bare

    @property
    def scale(self) -> float:
        """s: a plain cycle's timed seconds over the curve's one-token forward (1 before any plain cycle)."""
        return self.plain_ratio / self.plain_n if self.plain_n else 1.0

    def extra(self, nodes: int) -> float:
        """What a draft of ``nodes`` nodes adds to the cycle beyond s times the curve's forward (0 for no draft, and
        before any plain cycle)."""
        if nodes <= 0 or self.n == 0 or self.plain_n == 0:
            return 0.0
        s = self.scale  # the extra is fitted to timed - s · curve(k), linear in s: from the sums, for today's s
        fixed, per_node, _ = _line(self.n, self.nodes, self.timed - s * self.bare, self.nodes2,
                                   self.nodes_timed - s * self.nodes_bare)
        return fixed + per_node * nodes

    def __call__(self, tokens: int) -> float:
        """v(k): the expected verify seconds of a block of ``tokens`` tokens (fractional sizes interpolate)."""
        return self.scale * verify_cost(self.curve, tokens) + self.extra(tokens - 1)
