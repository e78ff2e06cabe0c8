"""How many tokens each sequence may draft when B sequences share one target forward.

At batch size 1 a verify pass over k tokens costs v(k) ≈ a few one-token steps on a CPU, and drafting
pays when it yields more tokens than that. With B sequences packed (`specula.packed`), one pass costs
v(B·(d+1)) for d drafts each: the matmuls fill up, and speculation that helps one user slows sixteen.
`DraftBudget` picks, per batch size, the d that maximises expected tokens per second for the batch:

    B · τ(d) / (v(B·(d+1)) + B · d · c)

with v the measured verify-cost curve (`specula calibrate`'s, or measured when the server starts),
c the measured draft cost per drafted token, and τ(d) = 1 + Σ_{i≤d} P(a cycle accepts ≥ i drafts), the
acceptance measured on the traffic the server has served (per depth: accepted at least i / drafted at
least i, so a cap on d does not bias the depths it leaves). Until traffic arrives, each depth starts at
`PRIOR_ACCEPTANCE` with the weight of `PRIOR_CYCLES` cycles. At batch size 1 the method drafts as
configured (its options were chosen for one sequence). A fixed table (``--draft-budget 1:8,4:2,8:0``)
replaces all of this.
"""

from __future__ import annotations

from collections.abc import Mapping

from specula.bench.theory import verify_cost
from specula.errors import SpeculaError

DEFAULT_MAX_BATCH = 16  # sequences per packed forward: SmolLM2 q4_1 151 tok/s at 16 vs 134 at 8, 164 at 32 (2x latency)
PRIOR_ACCEPTANCE = 0.5  # P(depth i accepted | depth i-1 accepted) before any traffic
PRIOR_CYCLES = 4  # how many cycles' weight that prior carries
MAX_DEPTH = 16  # depths tracked


def parse_budget_table(text: str) -> dict[int, int]:
    """``"1:8,4:2,8:0"`` → {1: 8, 4: 2, 8: 0}: from batch size 4 on, at most 2 drafts per sequence, and so on."""
    table = {}
    for item in text.split(","):
        batch, sep, drafts = item.strip().partition(":")
        if not sep or not batch.strip().isdigit() or not drafts.strip().isdigit() or int(batch) < 1:
            raise SpeculaError(f"a draft budget is 'batch:drafts' pairs like 1:8,4:2,8:0 (batch >= 1, drafts >= 0); "
                               f"got {text!r}")
        table[int(batch)] = int(drafts)
    if 1 not in table:
        raise SpeculaError(f"a draft budget table must say what batch size 1 drafts (e.g. 1:8,...); got {text!r}")
    return table


class DraftBudget:
    """``budget(batch_size)`` → the most draft tokens per sequence (None: as many as the drafter proposes).

    ``curve``: {n: seconds of one forward over n tokens}; ``table``: a fixed {batch size: drafts} instead.
    `observe` feeds each finished cycle's drafted depth, accepted drafts and drafting seconds.
    """

    def __init__(self, curve: Mapping[int, float] | None = None, table: Mapping[int, int] | None = None,
                 max_batch: int = 16):
        if curve is None and table is None:
            raise ValueError("a draft budget needs a verify-cost curve or a table")
        self.curve = dict(curve or {})
        self.table = dict(sorted(table.items())) if table else None
        self.max_batch = max_batch
        # Per depth i (1-based): cycles that drafted at least i tokens, and those that accepted at least i.
        self.drafted = [float(PRIOR_CYCLES)] * MAX_DEPTH
        self.accepted = [PRIOR_CYCLES * PRIOR_ACCEPTANCE ** (i + 1) for i in range(MAX_DEPTH)]
        self.deepest = 0  # the deepest draft seen: the drafter's own budget
        self.draft_seconds, self.draft_tokens = 0.0, 0
        self._cached: dict[int, int | None] = {}
        self._since = 0

    def observe(self, drafted: int, accepted: int, draft_seconds: float) -> None:
        """One verify cycle of one sequence: its tree's depth, the drafts accepted, the seconds spent drafting."""
        drafted = min(drafted, MAX_DEPTH)
        for i in range(drafted):
            self.drafted[i] += 1
            self.accepted[i] += accepted > i
        self.deepest = max(self.deepest, drafted)
        if drafted:
            self.draft_seconds += draft_seconds
            self.draft_tokens += drafted
        self._since += 1
        if self._since >= 32:  # re-plan every 32 cycles, not every call
            self._cached.clear()
            self._since = 0

    def expected_tokens(self, drafts: int) -> float:
        """τ(d): 1 + Σ_{i ≤ d} P(accepted ≥ i), as served so far."""
        return 1.0 + sum(self.accepted[i] / self.drafted[i] for i in range(min(drafts, MAX_DEPTH)))

    def __call__(self, batch: int) -> int | None:
        if self.table is not None:
            return self.table[max(b for b in self.table if b <= batch)]
        if batch <= 1 or self.deepest == 0:
            return None
        if batch not in self._cached:
            self._cached[batch] = self._plan(batch)
        return self._cached[batch]

    def _plan(self, batch: int) -> int | None:
        per_draft = self.draft_seconds / self.draft_tokens if self.draft_tokens else 0.0

        def rate(d: int) -> float:
            return batch * self.expected_tokens(d) / (verify_cost(self.curve, batch * (d + 1)) + batch * d * per_draft)

        best = max(range(self.deepest + 1), key=lambda d: (rate(d), -d))
        return None if best == self.deepest else best

    def plan(self, max_batch: int | None = None) -> dict[int, int | None]:
        """{batch size: drafts per sequence} for 1..max_batch as things stand (for logs and /health)."""
        return {b: self(b) for b in range(1, (max_batch or self.max_batch) + 1)}
