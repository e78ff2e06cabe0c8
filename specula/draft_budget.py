"""How deep each sequence may draft when B sequences share one target forward.

A verify pass over k tokens costs v(k) — on a CPU a few one-token steps for k = 16, not one — and
drafting pays only when it yields more tokens than that. With B sequences packed (`specula.runtime.packed`)
one pass costs v(B·(1 + n(d))) for drafts of depth d holding n(d) nodes each: the matmuls fill up, and
speculation that helps one user slows sixteen. `DraftBudget` picks, per batch size, the depth d that
maximises expected tokens per second for the batch:

    B · τ(d) / (v(B·(1 + n(d))) + B · c(d))

with v the measured verify-cost curve (`specula calibrate`'s, or measured when the server starts) — for one sequence
alone, that curve scaled and topped up to what its cycles are timed at (`VerifyCost`: a drafted cycle costs more
than its bare forward) — c(d) the drafting seconds of a depth-d draft (`DraftCost`: a fixed part and a part per
level, fitted to the drafts served),
n(d) the mean nodes a draft holds down to depth d, and
τ(d) = 1 + Σ_{i≤d} P(a cycle accepts ≥ i drafts), all measured on the traffic served (P(accepted ≥ i) as the
product of the conditional rates P(depth j accepted | depth j - 1 accepted), j ≤ i, each over the cycles that tested
depth j: the cap allowed it, whatever the drafter then drafted, and every depth above it was accepted). Before any
traffic each conditional rate starts at `PRIOR_ACCEPTANCE` with the weight of `PRIOR_CYCLES` cycles, and one
sequence in about 60 passes drafts uncapped so that depths a cap hides keep being measured (one
sequence at a time: sixteen uncapped trees at once would double that cycle's cost). A method whose
drafts do not pay on this machine thus falls back towards plain decoding, at any batch size. Drafts of
different kinds (`DraftTree.kind`: the suffix drafter's source and match length) are accepted at different
rates, so each kind also gets its own τ, n and depth, starting from the pooled ones: at four sequences a long
match in the conversation still pays three levels while a one-token match in the answer corpus pays none. Each kind
is planned in two shapes, the whole tree and its main chain alone (the first child at each level,
`DraftTree.main_chain`, measured on every draft since the acceptor judges a first child the same with siblings or
without): where the siblings are seldom the ones accepted, a narrower verify wins. The plan takes each conditional
rate one standard error up, so that a depth given up on few cycles is drafted again until its estimate is sure. A
fixed table (``--draft-budget 1:8,4:2,8:0``) replaces all of this.

One generation at a time (`specula.generate`, `specula generate`, `specula bench`) is the same plan at batch size
1 (`Speculator`'s ``draft_budget="auto"``, the default for every drafting method): its curve is measured once per
machine, target and weight format (~1 s) and kept in Specula's cache (`cached_curve`). It matters on a machine
where verification is dear: on a 2-core AVX2 EPYC a forward over 8 tokens costs 2.46 one-token steps (a Zen 4:
~1.3), and the suffix drafter's 8-node trees lost to plain decoding at T=1 (0.83x) where one node won (1.04x).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_json
from specula.runtime.cycle_cost import DraftCost, VerifyCost
from specula.runtime.decode_threads import spare_cpus
from specula.runtime.float32_layout import machine_key
from specula.runtime.model_source import cache_dir
from specula.runtime.verify_cost import measure_verify_curve, verify_cost

log = logging.getLogger(__name__)
CURVE_FILE = "verify-curves.json"  # in Specula's cache: {machine, target and format: {n: seconds}}
CURVE_REPEATS = 5  # timed rounds of a cached curve: measured once per machine, so worth a steadier median

DRAFT_BUDGETS = ("auto", "off")  # a Speculator's: caps from the measured curve and acceptance, or none
DEFAULT_MAX_BATCH = 16  # sequences per packed forward: SmolLM2 q4_1 151 tok/s at 16 vs 134 at 8, 164 at 32 (2x latency)
PRIOR_ACCEPTANCE = 0.5  # P(depth i accepted | depth i-1 accepted) before any traffic
PRIOR_CYCLES = 4  # how many cycles' weight that prior carries
# One sequence in this many passes drafts as deep as the method likes: every EXPLORE_EVERY * B + 1 sequence-cycles
# at B sequences a pass, so that the exploring draft costs a pass the same share at any batch (it was one
# sequence-cycle in 61: at 16 sequences an uncapped 8-node draft beside 16 one-token rows every ~4 passes, which
# cost the server ~5 % at 16 clients), and the + 1 moves it to the next position of the batch each time.
EXPLORE_EVERY = 61
REPLAN_EVERY = 32  # cycles observed between two plans
# A kind of draft drafts at least one level until this many of its own cycles were observed: planned from the pooled
# estimate alone, a kind first seen when the pool looked poor was capped at 0 and, drafting nothing, never learned
# better (a repeating poem's long matches, at tau 1.11 and 75 tokens/s where the uncapped drafter ran 184).
LEARN_CYCLES = 8
MAX_DEPTH = 32  # depths tracked


def check_draft_budget(value: object, where: str = "") -> str:
    """``value`` if it names a Speculator's draft budget (`DRAFT_BUDGETS`), else a SpeculaError (``where`` first)."""
    if not isinstance(value, str) or value not in DRAFT_BUDGETS:
        raise SpeculaError(f"{where}draft_budget must be one of {', '.join(DRAFT_BUDGETS)}, got {value!r}")
    return value


def parse_budget_table(text: str) -> dict[int, int]:
    """``"1:8,4:2,8:0"`` → {1: 8, 4: 2, 8: 0}: from batch size 4 on, drafts at most 2 deep, and so on."""
    table = {}
    for item in text.split(","):
        batch, sep, depth = item.strip().partition(":")
        if not sep or not batch.strip().isdigit() or not depth.strip().isdigit() or int(batch) < 1:
            raise SpeculaError(f"a draft budget is 'batch:depth' pairs like 1:8,4:2,8:0 (batch >= 1, depth >= 0); "
                               f"got {text!r}")
        table[int(batch)] = int(depth)
    if 1 not in table:
        raise SpeculaError(f"a draft budget table must say what batch size 1 drafts (e.g. 1:8,...); got {text!r}")
    return table


@dataclass
class DepthCaps:
    """What one sequence may draft this cycle: ``deepest`` bounds the proposal (None: as deep as the drafter
    likes), ``by_kind`` is a tighter cap for drafts of a known kind (`DraftTree.kind`), and a draft of a kind in
    ``chain_kinds`` ("" standing for every kind not in ``by_kind``) keeps only its main chain
    (`DraftTree.main_chain`): its siblings cost more verification than they win."""

    deepest: int | None
    by_kind: dict[str, int | None] = field(default_factory=dict)
    chain_kinds: frozenset[str] = frozenset()

    def cap(self, kind: str) -> tuple[int | None, bool]:
        """(depth cap, main chain only) for a draft of ``kind``."""
        listed = kind in self.by_kind
        return (self.by_kind[kind] if listed else self.deepest), (kind if listed else "") in self.chain_kinds


class _Acceptance:
    """Per depth i (index i-1), as served: the cycles that tested depth i (the cap allowed it and every depth above
    was accepted), those that accepted it too, and the draft nodes there per cycle whose cap allowed it.

    Acceptance is kept as these conditional rates, P(depth i accepted | depth i - 1 accepted), so that a cycle whose
    cap cut its draft says nothing of the depths below the cap: counted as a failure there (as P(accepted >= i) over
    the cycles allowing depth i was), a draft capped at one level and accepted whole every time still looked no
    better at two levels than the prior, so it was never drafted two deep again (the 1-deep cap held a repeating
    poem at tau 1.08, 75 tokens/s, where the uncapped suffix drafter ran 179).
    """

    def __init__(self, prior: list[float]):
        self.tested = [float(PRIOR_CYCLES)] * MAX_DEPTH
        self.passed = [PRIOR_CYCLES * p for p in prior]
        self.allowed = [float(PRIOR_CYCLES)] * MAX_DEPTH
        self.nodes = [float(PRIOR_CYCLES)] * MAX_DEPTH
        self.cycles = 0  # cycles observed

    def observe(self, nodes_per_depth: Sequence[int], accepted: int, allowed: int) -> None:
        self.cycles += 1
        depth = min(len(nodes_per_depth), MAX_DEPTH)
        for i in range(allowed):
            self.allowed[i] += 1
            self.nodes[i] += nodes_per_depth[i] if i < depth else 0
        for i in range(min(allowed, accepted + 1)):
            self.tested[i] += 1
            self.passed[i] += accepted > i

    def rates(self, optimistic: bool = False) -> list[float]:
        """P(depth i accepted | depth i - 1 accepted) for i = 1, 2, …; ``optimistic``: one standard error above
        (an upper confidence bound), so that a depth measured on few cycles is drafted until it is known not to pay.
        Planned from the estimates alone, a plan of depth 0 drafted nothing and so learned only from the rare
        uncapped draft: merged eagle3 at T=0 stayed at tau 1.04 in one run and reached 2.34 in another."""
        rates = [p / t for p, t in zip(self.passed, self.tested, strict=True)]
        if not optimistic:
            return rates
        return [min(1.0, r + math.sqrt(r * (1 - r) / t)) for r, t in zip(rates, self.tested, strict=True)]

    def tau(self, depth: int, optimistic: bool = False) -> float:
        tau, reach = 1.0, 1.0
        for rate in self.rates(optimistic)[:min(depth, MAX_DEPTH)]:
            reach *= rate
            tau += reach
        return tau

    def draft_nodes(self, depth: int) -> float:
        return sum(self.nodes[i] / self.allowed[i] for i in range(min(depth, MAX_DEPTH)))


class _KindAcceptance:
    """One kind's acceptance (every kind's, for the pool): of its drafts whole (``tree``) and of their main chains
    alone (``chain``, `DraftTree.main_chain`). A main chain's node is accepted exactly as often with its siblings
    beside it as without (the acceptor judges the first child first), so every draft measures its chain, while a
    draft pruned to its chain says nothing of the whole tree."""

    def __init__(self, tree_prior: list[float], chain_prior: list[float]):
        self.tree, self.chain = _Acceptance(tree_prior), _Acceptance(chain_prior)
        self.cycles = 0  # cycles observed
        self.wider = False  # some draft held more than its main chain

    def observe(self, nodes_per_depth: Sequence[int], accepted: int, allowed: int, chain: tuple[int, int] | None,
                chain_only: bool) -> None:
        self.cycles += 1
        if not chain_only:
            self.tree.observe(nodes_per_depth, accepted, allowed)
            self.wider |= chain is None or chain[0] < sum(nodes_per_depth)
        if chain is not None:
            self.chain.observe([1] * chain[0], chain[1], allowed)

    def shapes(self) -> list[tuple[_Acceptance, bool]]:
        """(acceptance, main chain only) of the shapes worth planning: the chain once its drafts were wider and it
        has `LEARN_CYCLES` cycles of data (before, its prior would compete with the trees' measurements)."""
        if self.wider and self.chain.cycles >= LEARN_CYCLES:
            return [(self.tree, False), (self.chain, True)]
        return [(self.tree, False)]


class DraftBudget:
    """``caps(batch_size)`` → how deep one sequence may draft this cycle, asked per sequence; ``budget(batch_size)``
    is its ``deepest`` alone (None: as deep as the drafter likes).

    ``curve``: {n: seconds of one forward over n tokens}; ``table``: a fixed {batch size: depth} instead.
    `observe` takes each verified cycle's draft (nodes per depth), accepted drafts, drafting seconds, the cap
    it was drafted under and its kind. Drafts of every kind are pooled into one estimate; a kind (the suffix
    drafter's "conversation match 3-4", say) also gets its own, starting from the pooled one, and its own
    depth: at sixteen sequences a row costs about a third of a token, so only the drafts accepted more often
    than that pay — the long matches in the conversation, not the one-token matches in the answer corpus.
    """

    def __init__(self, curve: Mapping[int, float] | None = None, table: Mapping[int, int] | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, timed: bool = True):
        if curve is None and table is None:
            raise ValueError("a draft budget needs a verify-cost curve or a table")
        self.curve = dict(curve or {})
        self.table = dict(sorted(table.items())) if table else None
        self.max_batch = max_batch
        self.pooled = _KindAcceptance([PRIOR_ACCEPTANCE] * MAX_DEPTH, [PRIOR_ACCEPTANCE] * MAX_DEPTH)
        self.kinds: dict[str, _KindAcceptance] = {}
        self.deepest = 0  # the deepest draft seen: the drafter's own depth
        self.draft_cost = DraftCost()
        # One sequence's cycles priced as timed (`VerifyCost`); None: by the curve alone, the same plan on any machine
        self.verify_cost = VerifyCost(self.curve) if timed and curve else None
        self._plans: dict[int, DepthCaps] = {}
        self._observed = 0
        self._until_explore = EXPLORE_EVERY  # sequence-cycles before the next uncapped draft

    def observe(self, nodes_per_depth: Sequence[int], accepted: int, draft_seconds: float,
                cap: int | None = None, kind: str = "", chain: tuple[int, int] | None = None,
                chain_only: bool = False, verify_seconds: float | None = None) -> None:
        """One verified cycle of one sequence: its draft's node count at depth 1, 2, …, the drafts accepted, the
        seconds spent drafting, the depth the budget allowed (None: uncapped), the draft's kind, its main chain's
        (length, nodes accepted) (None: the draft is a chain, or unknown), whether it was pruned to that chain, and
        the seconds from its proposal to its commit where the sequence was verified alone (None: packed with others,
        where the forward's time is not its own).

        Every depth the cap allowed counts, drafted or not: a drafter that drafts deep only when it is sure
        (prompt lookup finding a match, Ada predicting a long run) must not look surer than it is."""
        depth = min(len(nodes_per_depth), MAX_DEPTH)
        self.deepest = max(self.deepest, depth)
        allowed = self.deepest if cap is None else min(cap, self.deepest)
        if chain is None and all(n == 1 for n in nodes_per_depth):
            chain = (depth, accepted)  # the draft is its own main chain
        self.pooled.observe(nodes_per_depth, accepted, allowed, chain, chain_only)
        if kind:
            if kind not in self.kinds:
                self.kinds[kind] = _KindAcceptance(self.pooled.tree.rates(), self.pooled.chain.rates())
            self.kinds[kind].observe(nodes_per_depth, accepted, allowed, chain, chain_only)
        if depth:
            self.draft_cost.observe(depth, draft_seconds)
        if verify_seconds is not None and self.verify_cost is not None:
            self.verify_cost.observe(1 + sum(nodes_per_depth), verify_seconds)
        self._observed += 1
        if self._observed % REPLAN_EVERY == 0:
            self._plans.clear()

    def served_tau(self, depth: int, kind: str = "") -> float:
        """τ(d): 1 + Σ_{i ≤ d} P(accepted ≥ i), as served so far (for drafts of ``kind``; "": all)."""
        return self.kinds.get(kind, self.pooled).tree.tau(depth)

    def draft_nodes(self, depth: int, kind: str = "") -> float:
        """n(d): mean nodes of a draft down to depth d, as served so far (for drafts of ``kind``; "": all)."""
        return self.kinds.get(kind, self.pooled).tree.draft_nodes(depth)

    def __call__(self, batch: int) -> int | None:
        return self.caps(batch).deepest

    def caps(self, batch: int) -> DepthCaps:
        if self.table is not None:
            return DepthCaps(self.table[max(b for b in self.table if b <= batch)])
        if self.deepest == 0:
            return DepthCaps(None)
        self._until_explore -= 1
        if self._until_explore <= 0:
            self._until_explore = EXPLORE_EVERY * batch + 1
            return DepthCaps(None)
        timed = self.verify_cost
        if batch == 1 and timed is not None and timed.plain_n == 0 and timed.n >= LEARN_CYCLES:
            return DepthCaps(0)  # one plain cycle, timed, to price the drafted ones against (`VerifyCost`)
        if batch not in self._plans:
            caps = {kind: self.best_cap(batch, kind) for kind in self.kinds}
            for kind, (depth, chain) in caps.items():
                if depth == 0 and self.kinds[kind].cycles < LEARN_CYCLES:
                    caps[kind] = (1, chain)
            caps[""] = self.best_cap(batch)
            depths = [depth for depth, _ in caps.values()]
            by_kind = {kind: depth for kind, (depth, _) in caps.items() if kind}
            chain_kinds = frozenset(kind for kind, (_, chain) in caps.items() if chain)
            self._plans[batch] = DepthCaps(None if None in depths else max(depths), by_kind, chain_kinds)
        return self._plans[batch]

    def best_cap(self, batch: int, kind: str = "") -> tuple[int | None, bool]:
        """(depth, main chain only) with the most expected tokens per second for ``batch`` sequences drafting like
        drafts of ``kind`` ("": all drafts; depth None: uncapped), each conditional acceptance rate taken one
        standard error up (`_Acceptance.rates`). One sequence's verify is priced as timed where timings exist
        (`VerifyCost`), a packed batch's by the curve."""
        stats = self.kinds.get(kind, self.pooled)
        timed = self.verify_cost if batch == 1 else None

        def rate(acceptance: _Acceptance, d: int) -> float:
            tokens = round(batch * (1 + acceptance.draft_nodes(d)))
            verify = timed(tokens) if timed is not None else verify_cost(self.curve, tokens)
            return batch * acceptance.tau(d, optimistic=True) / (verify + batch * self.draft_cost(d))

        options = [(rate(acceptance, d), -d, not chain, d, chain)
                   for acceptance, chain in stats.shapes() for d in range(self.deepest + 1)]
        *_, depth, chain = max(options)  # the fastest; of equals the shallowest, whole trees before chains
        return (None if depth == self.deepest else depth), chain

    def best_depth(self, batch: int, kind: str = "") -> int | None:
        """The depth of `best_cap` (None: uncapped)."""
        return self.best_cap(batch, kind)[0]

    def plan(self, max_batch: int | None = None, kind: str = "") -> dict[int, int | None]:
        """{batch size: deepest draft} for 1..max_batch as things stand (for inspection and tests)."""
        return {b: self.best_depth(b, kind) if self.table is None else self(b)
                for b in range(1, (max_batch or self.max_batch) + 1)}


def measured_curve(target, max_batch: int, repeats: int = 2) -> dict[int, float]:
    """Seconds of one target forward over n tokens, n = 1, 2, 4, … up to 16 per sequence at ``max_batch``,
    measured now on the loaded target (a few seconds on SmolLM2), for the draft budget."""
    sizes, n = [], 1
    while n <= min(16 * max_batch, 256):
        sizes.append(n)
        n *= 2
    # A 64-token prefix where the context allows it and all the sizes still fit after it (a 40-token context limit
    # had every measurement fail, and with it the first generation).
    prefix = [i % max(2, target.vocab_size) for i in range(max(1, min(64, target.max_length - sizes[-1])))]
    # On a fork: packed batches run eager, and a compiled target would compile every size measured here.
    return measure_verify_curve(target.fork(), prefix, sizes, repeats=repeats)


def curve_key(target) -> str:
    """What a verify-cost curve depends on: the machine (CPU, vector ISA, torch, threads), whether decode steps choose
    their thread count (`specula.runtime.decode_threads`: torch's setting says 1 either way, but a step may then run
    on 2), device, target and format."""
    spare = spare_cpus(torch.device(target.device))
    steps = "decode steps on torch's threads" if spare is None else f"decode steps on 1-{spare} threads as timed"
    return f"{machine_key()} | {steps} | {target.device} | {target.name} | {target.weights} | {target.dtype}"


def cached_curve(target) -> dict[int, float]:
    """The verify-cost curve of one sequence (n = 1 … 16) for ``target`` on this machine: read from Specula's cache,
    else measured now (about a second on SmolLM2 in q4_1) and kept there. A cache file that cannot be read is
    measured over and rewritten, never trusted half."""
    path, key = cache_dir() / CURVE_FILE, curve_key(target)
    try:
        curves = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(curves, dict):
            curves = {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        curves = {}
    try:
        curve = {int(n): float(t) for n, t in curves[key].items()}
        if curve and all(t > 0 for t in curve.values()):
            return curve
    except (KeyError, AttributeError, TypeError, ValueError):
        pass
    curve = measured_curve(target, 1, repeats=CURVE_REPEATS)
    curves[key] = {str(n): t for n, t in curve.items()}
    try:
        atomic_write_json(path, curves)
    except OSError as err:  # a read-only cache costs a second a process, not the generation
        log.warning("could not keep the verify-cost curve in %s: %s", path, err)
    return curve
