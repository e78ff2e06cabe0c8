"""The draft budget of one generation at a time (`Speculator`'s ``draft_budget="auto"``): each cycle drafts only as
deep as pays on this machine, the output stays the target's, and the verify-cost curve it plans with is measured once
and cached."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import STORIES, STORY_PROMPTS
from test_lossless_sampling import (
    ALPHA,
    E2E_PARAMS,
    N_E2E,
    PLD_PROMPT,
    accept_bonus_from_unmodified_p,
    exact_sequence_distribution,
    fit_pvalues,
)

import specula
import specula.draft_budget as draft_budget
from specula.cli import main
from specula.decoding import Sequence, generate_tokens
from specula.draft_budget import CURVE_FILE, DraftBudget, cached_curve
from specula.drafters.suffix import SuffixDrafter
from specula.drafters.vanilla import VanillaDrafter
from specula.errors import SpeculaError
from specula.runtime.cycle_cost import VerifyCost
from specula.runtime.forward import FeatureRequest
from specula.runtime.target import Target
from specula.sampling import SamplingParams
from specula.tree import DraftTree

NEW_TOKENS = 32
# A CPU-like curve on which a second draft level pays only when it is accepted often.
CURVE = {1: 1.0, 2: 1.05, 4: 1.5, 8: 2.5, 16: 4.5}


@pytest.mark.parametrize("method", ["pld", "suffix"])
def test_the_budgeted_greedy_output_is_the_uncapped_output(method):
    budgeted = specula.load(STORIES, method=method, dtype="float32", profile=False)
    uncapped = specula.load(STORIES, method=method, dtype="float32", profile=False, draft_budget="off")
    assert budgeted.budget is not None and uncapped.budget is None
    for prompt in STORY_PROMPTS[:3]:
        assert budgeted.generate(prompt, NEW_TOKENS, raw=True).token_ids == \
            uncapped.generate(prompt, NEW_TOKENS, raw=True).token_ids
    assert budgeted.budget.deepest > 0  # it planned from drafts it saw


def test_sampling_under_an_adaptive_budget_keeps_the_target_distribution():
    """Each run's caps depend on the runs before it (what the budget learned, the probe after a whole acceptance),
    never on the current cycle's coins, so every run is still a draw from the target's distribution. The control,
    the same runs with the textbook residual bug, must fail: the test has the power to see a lossy acceptor. (On a
    curve where a second level costs more, the budget keeps these drafts one deep and the bug, which shows after a
    rejection at depth 2, stays out of sight of 800 runs: p 0.38.)"""
    target = Target.load(STORIES, dtype="float32")
    prompt = torch.tensor(target.tokenizer(PLD_PROMPT)["input_ids"], dtype=torch.long)
    exact = exact_sequence_distribution(target, prompt, E2E_PARAMS, 4)
    flat = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.2, 16: 2.0}  # verifying up to 4 tokens costs one step
    for acceptor, lossless in ((None, True), (accept_bonus_from_unmodified_p, False)):
        # priced by the curve alone (timed=False): the plan, and so the test's power, must not depend on this machine
        budget, counts, sizes = DraftBudget(flat, max_batch=1, timed=False), Counter(), Counter()
        for seed in range(N_E2E):
            tokens, stats = generate_tokens(target, SuffixDrafter(max_match=8), prompt, 4, E2E_PARAMS, seed=seed,
                                            stop_on_eos=False, acceptor=acceptor, budget=budget)
            counts[tuple(tokens)] += 1
            sizes.update(stats.tree_sizes)
        assert sizes[1] and sizes[2], sizes  # drafts of one node and of two were judged
        assert (min(fit_pvalues(counts, exact, 4).values()) >= ALPHA) == lossless


def test_greedy_output_with_the_budget_equals_vanilla():
    vanilla = specula.load(STORIES, method="vanilla", dtype="float32", profile=False)
    assert vanilla.budget is None  # plain decoding has nothing to cap
    budgeted = specula.load(STORIES, method="suffix", dtype="float32", profile=False)
    for prompt in STORY_PROMPTS[:4]:
        assert budgeted.generate(prompt, NEW_TOKENS, raw=True).token_ids == \
            vanilla.generate(prompt, NEW_TOKENS, raw=True).token_ids


def test_a_draft_capped_and_accepted_whole_does_not_hide_the_next_level():
    """A cycle capped at one level says nothing of the second: counted as a miss there, a draft accepted whole at its
    cap every time never looked worth a second level, and a repeating answer stayed at τ ≈ 1.1."""
    budget = DraftBudget(CURVE, max_batch=1)
    for _ in range(200):
        budget.observe([1] * 8, 1, 0.0, cap=1)  # capped at 1, accepted whole
    assert budget.served_tau(1) > 1.9
    assert budget.best_depth(1) is None or budget.best_depth(1) >= 2


def test_a_kind_first_seen_when_drafts_did_not_pay_still_drafts_until_it_has_data_of_its_own():
    """Planned from the pooled estimate alone, a kind first met after many rejected drafts was capped at 0 and, never
    drafting, never learned that it is accepted almost always (a repeating poem at τ 1.11)."""
    budget = DraftBudget({1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0, 16: 5.0}, max_batch=1)  # a second token costs half a step
    for _ in range(64):
        budget.observe([1] * 8, 0, 0.0, kind="short match")  # nothing accepted: drafting does not pay
    budget.observe([1] * 8, 8, 0.0, cap=None, kind="long match")
    budget._plans.clear()  # plan now, not at the next replanning
    assert budget.best_depth(1) == 0  # the pool's estimate, where the kind's starts, says do not draft
    assert budget.caps(1).by_kind["long match"] >= 1  # but it drafts, to learn
    for _ in range(40):
        budget.observe([1] * 8, 1, 0.0, cap=1, kind="long match")  # accepted whole at its cap each time
    assert budget.best_depth(1, "long match") != 0


def test_a_draft_rarely_accepted_is_capped_at_one_sequence():
    budget = DraftBudget(CURVE, max_batch=1)
    for i in range(200):
        budget.observe([1] * 8, 1 if i % 10 == 0 else 0, 0.0)  # uncapped 8-token chains, 10 % first-token accepted
    assert budget.best_depth(1) in (0, 1)


class GreedyOracle:
    """Proposes the target's own greedy continuation (known in advance) as a chain as deep as allowed."""

    features = FeatureRequest()

    def __init__(self, continuation: list[int], prompt_length: int):
        self.continuation, self.prompt_length = continuation, prompt_length

    def start(self, prompt, target_out):
        pass

    def propose(self, context, max_depth, params, generator):
        done = len(context) - self.prompt_length  # tokens already generated (the root is the last of them)
        return DraftTree.chain(int(context[-1]), self.continuation[done:done + max(0, max_depth)])

    def observe(self, accepted, target_out):
        pass

    def fork(self):
        return self


def oracle_sequence(oracle: type[GreedyOracle], budget: DraftBudget) -> tuple[Target, Sequence, list[int], list[int]]:
    """(target, a greedy generation drafted by ``oracle`` under ``budget`` with its prompt run, the greedy
    continuation, the tokens so far)."""
    speculator = specula.load(STORIES, method="vanilla", dtype="float32", profile=False)
    prompt = speculator.encode(STORY_PROMPTS[0], raw=True)
    greedy, _ = generate_tokens(speculator.target, speculator.drafter, prompt, NEW_TOKENS, SamplingParams(),
                                stop_on_eos=False)
    sequence = Sequence(speculator.target, oracle(greedy, len(prompt)), prompt, NEW_TOKENS, SamplingParams(),
                        stop_on_eos=False, budget=budget)
    return speculator.target, sequence, greedy, sequence.advance(sequence.block().run(speculator.target))


def test_a_draft_accepted_whole_at_its_cap_is_followed_by_one_a_level_deeper():
    target, sequence, greedy, out = oracle_sequence(GreedyOracle, DraftBudget(table={1: 1}))
    drafted = []
    while not sequence.done:
        block = sequence.block()
        drafted.append(len(block.tokens) - 1)
        out += sequence.advance(block.run(target))
    assert out == greedy
    assert drafted[:4] == [1, 2, 3, 4]  # the table says 1; each whole acceptance allows one level more


def test_the_verify_cost_curve_is_measured_once_and_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))
    target = specula.load(STORIES, dtype="float32", profile=False).target
    measured = []
    real = draft_budget.measured_curve
    monkeypatch.setattr(draft_budget, "measured_curve", lambda *a, **k: measured.append(1) or real(*a, **k))
    first = cached_curve(target)
    assert sorted(first) == [1, 2, 4, 8, 16] and all(t > 0 for t in first.values())
    assert cached_curve(target) == first and len(measured) == 1  # the second time from the cache
    (tmp_path / CURVE_FILE).write_text("{not json")
    assert cached_curve(target) and len(measured) == 2  # a damaged file is measured over...
    assert json.loads((tmp_path / CURVE_FILE).read_text())  # ...and rewritten whole
    target.weights = "int8"  # another format is another curve
    cached_curve(target)
    assert len(measured) == 3 and len(json.loads((tmp_path / CURVE_FILE).read_text())) == 2
    # Decode steps that choose their own thread count (one or two) cost otherwise than steps held to torch's one
    # thread, though torch's setting reads 1 in both: another curve.
    chosen = draft_budget.spare_cpus(torch.device("cpu")) is not None  # as this process runs
    monkeypatch.setattr(draft_budget, "spare_cpus", lambda device: None if chosen else 2)  # the other way
    cached_curve(target)
    assert len(measured) == 4 and len(json.loads((tmp_path / CURVE_FILE).read_text())) == 3


def test_an_unknown_draft_budget_is_refused_before_loading():
    with pytest.raises(SpeculaError, match="draft_budget"):
        specula.load("/nonexistent/model", method="suffix", draft_budget="sometimes")


def test_the_command_line_refuses_an_unknown_draft_budget(capsys):
    assert main(["generate", "--prompt", "Hi", "--draft-budget", "sometimes"]) == 2
    assert "--draft-budget" in capsys.readouterr().err


def test_a_bench_label_may_turn_the_budget_off():
    from specula.bench.config import method_specs

    spec, = method_specs(["s"], {"s": {"method": "suffix", "draft_budget": "off"}})
    assert spec.options["draft_budget"] == "off"
    with pytest.raises(SpeculaError, match="draft_budget"):
        method_specs(["s"], {"s": {"method": "suffix", "draft_budget": "never"}})


def test_measuring_the_curve_leaves_the_loaded_targets_cache_as_it_was(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))  # nothing cached: measured now
    speculator = specula.load(STORIES, method="suffix", dtype="float32", profile=False)
    target = speculator.target
    target.prefill(torch.tensor([1, 2, 3]))
    target.commit()
    assert speculator.budget is not None and (tmp_path / CURVE_FILE).is_file()
    assert target.length == 3


def primed_to_prune_siblings(curve: dict[int, float]) -> DraftBudget:
    """A budget that saw 200 trees of two nodes a level whose accepted path always ran down the main chain (priced by
    the curve alone: what this machine's cycles cost must not change the plan a test reads)."""
    budget = DraftBudget(curve, max_batch=1, timed=False)
    for i in range(200):
        accepted = [0, 1, 2, 4][i % 4]
        budget.observe([2] * 4, accepted, 0.0, chain=(4, accepted))
    return budget


STEEP = {1: 1.0, 2: 1.3, 4: 1.9, 8: 3.0, 16: 5.0}  # every node verified costs


def test_siblings_that_never_win_are_pruned_to_the_main_chain():
    budget = primed_to_prune_siblings(STEEP)
    assert budget.best_cap(1)[1] and "" in budget.caps(1).chain_kinds
    siblings_win = DraftBudget(STEEP, max_batch=1)  # the same trees, but half the acceptances ran through a sibling
    for i in range(200):
        accepted = [0, 1, 2, 4][i % 4]
        siblings_win.observe([2] * 4, accepted, 0.0, chain=(4, accepted if i % 8 < 4 else 0))
    assert not siblings_win.best_cap(1)[1]


def test_a_draft_pruned_to_its_main_chain_says_nothing_of_the_whole_tree():
    budget = primed_to_prune_siblings(STEEP)
    before = budget.served_tau(4)
    for _ in range(50):
        budget.observe([1] * 4, 0, 0.0, chain=(4, 0), chain_only=True)  # the chain rejected: the tree not tried
    assert budget.served_tau(4) == before


class SiblingOracle(GreedyOracle):
    """The target's greedy continuation as the main chain, each level with a wrong sibling beside it."""

    def propose(self, context, max_depth, params, generator):
        done = len(context) - self.prompt_length
        right = self.continuation[done:done + max(0, max_depth)]
        tokens, parents = [int(context[-1])], [-1]
        for token in right:
            parent = len(tokens) - 1 if len(tokens) == 1 else len(tokens) - 2  # the last chain node
            tokens += [token, (token + 1) % 50]
            parents += [parent, parent]
        return DraftTree(torch.tensor(tokens), parents)


def test_a_draft_pruned_to_its_main_chain_decodes_the_greedy_text():
    target, sequence, greedy, out = oracle_sequence(SiblingOracle, primed_to_prune_siblings(STEEP))
    chains = 0
    while not sequence.done:
        block = sequence.block()
        chains += sequence.draft_chain_only and sequence.nodes_per_depth == [1] * (len(block.tokens) - 1)
        out += sequence.advance(block.run(target))
    assert out == greedy
    assert chains > 0  # drafts were pruned to their chains, and the chains were accepted


def test_the_curve_is_measured_within_a_short_context_limit(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))  # nothing cached: measured now
    speculator = specula.load(STORIES, method="suffix", dtype="float32", profile=False, max_length=40)
    assert sorted(cached_curve(speculator.target)) == [1, 2, 4, 8, 16]
    result = speculator.generate(STORY_PROMPTS[0], max_new_tokens=100, stop_on_eos=False)
    assert result.stats.stop_reason == "context_length"


def test_verify_seconds_are_fitted_as_the_curve_scaled_plus_what_a_draft_adds():
    """v(k) = s · curve(k) + fixed + per_node · (k - 1) for a drafted block, s · curve(1) for a plain one."""
    cost = VerifyCost(CURVE)
    assert cost(4) == CURVE[4] and cost.scale == 1.0  # nothing timed yet: the curve
    for tokens in (1, 2, 5, 9, 1, 3):
        for _ in range(20):
            cost.observe(tokens, 1.5 * cost.curve[1] if tokens == 1 else
                         1.5 * VerifyCost(CURVE)(tokens) + 0.3 + 0.05 * (tokens - 1))
    assert abs(cost.scale - 1.5) < 1e-9
    assert abs(cost(1) - 1.5) < 1e-9
    for tokens in (2, 6, 16):
        assert abs(cost(tokens) - (1.5 * VerifyCost(CURVE)(tokens) + 0.3 + 0.05 * (tokens - 1))) < 1e-9


def test_a_draft_whose_cycles_cost_more_than_the_curve_says_is_not_drafted_alone():
    """One node accepted 20 % of the time pays on a curve where a second token costs 2 % more (1.2 / 1.02 tokens a
    step), not where a cycle with a draft is timed 0.4 steps dearer than a plain one: the cost of having a draft at
    all (mask, a second logits row, the acceptor) that bare forwards do not show. Packed with others, where a cycle's
    seconds are not its own, the plan stays the curve's."""
    curve = {1: 1.0, 2: 1.02, 4: 1.1, 8: 1.5, 16: 2.5, 32: 4.5}
    plans = {}
    for timed in (True, False):
        budget = DraftBudget(curve, max_batch=4, timed=timed)
        for i in range(400):
            budget.observe([1], int(i % 5 == 0), 0.0, cap=1, verify_seconds=1.5 * 1.02 + 0.4)
            budget.observe([], 0, 0.0, verify_seconds=1.5)
        plans[timed] = budget.plan()
    assert plans[False][1] != 0 and plans[True][1] == 0
    assert plans[True][2] == plans[False][2]


def test_a_budget_that_timed_only_drafted_cycles_asks_for_a_plain_one():
    """A drafted cycle's seconds split into the curve scaled to the served context and what the draft adds only
    against a plain cycle's: until one is timed the plan is the curve's, and after a few drafted cycles the budget
    asks for a plain one (a drafter that always drafts would otherwise never show what its drafts cost)."""
    budget = DraftBudget(CURVE, max_batch=1)
    for _ in range(12):
        budget.observe([1] * 4, 4, 0.0, verify_seconds=3.0)
    assert budget.verify_cost(5) == budget.verify_cost.curve[4] + (budget.verify_cost.curve[8] - CURVE[4]) / 4
    assert budget.caps(1).deepest == 0
    budget.observe([], 0, 0.0, verify_seconds=1.2)
    assert budget.caps(1).deepest != 0
    assert abs(budget.verify_cost(1) - 1.2) < 1e-9 and budget.verify_cost(5) > 1.2 * CURVE[4]


def test_a_sequence_times_its_verify_only_when_it_runs_alone():
    speculator = specula.load(STORIES, method="suffix", dtype="float32", profile=False)
    budget = DraftBudget(CURVE, max_batch=2)
    prompt = speculator.encode(STORY_PROMPTS[0], raw=True)
    generate_tokens(speculator.target, speculator.drafter, prompt, NEW_TOKENS, SamplingParams(), budget=budget)
    timed = (budget.verify_cost.plain_n, budget.verify_cost.n)
    assert sum(timed) > 0 and budget.verify_cost.scale > 0
    sequence = Sequence(speculator.target, speculator.drafter, prompt, NEW_TOKENS, SamplingParams(), budget=budget)
    for _ in range(8):  # as a batch of two would call it: the forward's seconds are shared, not this sequence's
        sequence.advance(sequence.block(batch=2).run(speculator.target))
    assert (budget.verify_cost.plain_n, budget.verify_cost.n) == timed  # nothing timed


def test_sampling_with_drafts_pruned_to_their_main_chains_keeps_the_target_distribution():
    """At T=1 a budget that keeps only each draft's main chain (its siblings never won) still draws every run from the
    target's distribution, and the control with the textbook residual bug fails: pruning happens before the cycle's
    coins, so the acceptor judges a chain as it would any draft."""
    target = Target.load(STORIES, dtype="float32")
    prompt = torch.tensor(target.tokenizer(PLD_PROMPT)["input_ids"], dtype=torch.long)
    exact = exact_sequence_distribution(target, prompt, E2E_PARAMS, 4)
    greedy, _ = generate_tokens(target, VanillaDrafter(), prompt, 4, SamplingParams(), stop_on_eos=False)
    for acceptor, lossless in ((None, True), (accept_bonus_from_unmodified_p, False)):
        budget, counts, chains = primed_to_prune_siblings(STEEP), Counter(), 0
        for seed in range(N_E2E):
            sequence = Sequence(target, SiblingOracle(greedy, len(prompt)), prompt, 4, E2E_PARAMS, seed=seed,
                                stop_on_eos=False, acceptor=acceptor, budget=budget)
            tokens = []
            while not sequence.done:
                block = sequence.block()
                chains += sequence.draft_chain_only and len(block.tokens) > 1
                tokens += sequence.advance(block.run(target))
            counts[tuple(tokens)] += 1
        assert chains > N_E2E // 2, chains  # most runs verified a draft pruned to its chain
        assert (min(fit_pvalues(counts, exact, 4).values()) >= ALPHA) == lossless
