"""Statistical evidence that speculative sampling is lossless at temperature > 0.

Losslessness means: the tokens the decode loop emits are distributed exactly as the target's own
sampling distribution (after temperature / top-k / top-p), whatever the drafter proposes. We check
it two ways, each with a chi-square goodness-of-fit test against the exactly computed distribution:

1. Acceptor level, on a synthetic Markov "model" over a 6-token vocabulary: the target's next-token
   distribution after token t is softmax(TARGET_LOGITS[t]) and the draft's is a deliberately
   different softmax(DRAFT_LOGITS[t]). Chains and trees, sampled drafts (draft_probs = q) and
   deterministic drafts (draft_probs None: point-mass proposals), with and without warping.
2. End to end through ``generate_tokens`` with real models (stories260k target, llama2xs draft)
   for sps (sampled chain drafts) and pld (deterministic chain drafts).

Every test is paired with deliberately broken acceptors that the same test must reject, which
shows the tests have the power to see a loss of exactness, not just that they pass.

Statistics. Each check is Pearson's chi-square goodness of fit at significance ALPHA = 1e-3.
All randomness is seeded, so the outcome is deterministic; the threshold bounds the chance that
a correct implementation fails for an unlucky choice of seed (<= 1e-3 per statistic, <= 3% over the
28 statistics checked for the correct acceptor), while the broken acceptors reach p-values of 1e-20
(end to end) and below 1e-200 (acceptor level).
Cells whose expected count is below MIN_EXPECTED = 5 (the usual validity condition of the
chi-square approximation) are pooled into one cell; an observation in a cell of probability zero
(e.g. a token removed by top-k) fails the test outright.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import LLAMA2XS, STORIES
from scipy import stats

from specula.acceptance import Acceptance, Acceptor
from specula.decoding import generate_tokens
from specula.drafters import merged
from specula.drafters.draft_model import DraftModelDrafter
from specula.drafters.merged import graft
from specula.drafters.prompt_lookup import PromptLookupDrafter
from specula.runtime.plain_model import transformers_model
from specula.runtime.target import Target
from specula.sampling import SamplingParams, probabilities, sample
from specula.tree import DraftTree

ALPHA = 1e-3
MIN_EXPECTED = 5.0


# Tiny tensors: intra-op threads only add overhead and contention on a shared machine.
pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------------------------
# Chi-square helpers
# ---------------------------------------------------------------------------------------------


def chi_square_pvalue(observed: Counter, exact: dict) -> float:
    """Goodness of fit of ``observed`` outcome counts to the ``exact`` outcome probabilities.

    Cells with expected count < MIN_EXPECTED are pooled together (and the pool, if still too
    small, is merged with the smallest remaining cell). An outcome with exact probability 0 that
    was observed makes the fit impossible: p-value 0.
    """
    total = sum(observed.values())
    if any(exact.get(outcome, 0.0) <= 0.0 for outcome in observed):
        return 0.0
    outcomes = sorted((o for o, prob in exact.items() if prob > 0.0), key=lambda o: exact[o])
    norm = sum(exact[o] for o in outcomes)
    expected = np.array([total * exact[o] / norm for o in outcomes])
    counts = np.array([observed.get(o, 0) for o in outcomes], dtype=float)
    small = expected < MIN_EXPECTED
    cells_exp, cells_obs = list(expected[~small]), list(counts[~small])
    if small.any():
        pool_exp, pool_obs = expected[small].sum(), counts[small].sum()
        if pool_exp < MIN_EXPECTED and cells_exp:  # ascending order: index 0 is the smallest big cell
            pool_exp, pool_obs = pool_exp + cells_exp.pop(0), pool_obs + cells_obs.pop(0)
        cells_exp.append(pool_exp)
        cells_obs.append(pool_obs)
    assert len(cells_exp) >= 2, "too few cells for a chi-square test; raise the sample size"
    return float(stats.chisquare(cells_obs, cells_exp).pvalue)


def marginal(distribution: dict | Counter, position: int) -> dict:
    """Marginal of element ``position`` of tuple outcomes (works for probabilities and counts)."""
    out: dict = {}
    for outcome, weight in distribution.items():
        out[outcome[position]] = out.get(outcome[position], 0) + weight
    return out


def fit_pvalues(observed: Counter, exact: dict, length: int) -> dict[str, float]:
    """p-values of the joint of the first ``length`` tokens and of each position's marginal."""
    pvalues = {"joint": chi_square_pvalue(observed, exact)}
    for position in range(length):
        pvalues[f"position {position + 1}"] = chi_square_pvalue(
            Counter(marginal(observed, position)), marginal(exact, position))
    return pvalues


# ---------------------------------------------------------------------------------------------
# Deliberately broken acceptors (same call signature as accept_speculative / Acceptor)
# ---------------------------------------------------------------------------------------------


def accept_bonus_from_unmodified_p(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                                   generator: torch.Generator | None) -> Acceptance:
    """Bug: after a rejection the target distribution is NOT replaced by the residual
    norm(max(0, p - q)) (or p with the rejected token zeroed, for a point mass): later siblings and
    the bonus token use the unmodified p. The textbook mistake in speculative sampling."""
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        p = probabilities(target_logits[node], params)
        for child in tree.children(node):
            x = tokens[child]
            u = float(torch.rand((), generator=generator))
            q_x = 1.0 if tree.draft_probs is None else float(tree.draft_probs[child][x])
            if u * q_x < p[x]:
                node = child
                path.append(node)
                break
        else:
            return Acceptance(path, sample(p, generator))


def accept_first_child_always(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                              generator: torch.Generator | None) -> Acceptance:
    """Bug: every draft on the first-child path is accepted, the bonus is sampled from the target."""
    node, path = 0, [0]
    while tree.children(node):
        node = tree.children(node)[0]
        path.append(node)
    return Acceptance(path, sample(probabilities(target_logits[node], params), generator))


def accept_siblings_against_original_p(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                                       generator: torch.Generator | None) -> Acceptance:
    """Bug specific to trees: every sibling is tested against the ORIGINAL p (no residual update
    between siblings); only the bonus token uses the residual left by all rejected siblings. On a
    chain (one child per node) this coincides with the correct rule, so only tree tests can see it."""
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        p = probabilities(target_logits[node], params)
        residual = p.clone()
        for child in tree.children(node):
            x = tokens[child]
            u = float(torch.rand((), generator=generator))
            q = None if tree.draft_probs is None else tree.draft_probs[child]
            q_x = 1.0 if q is None else float(q[x])
            if u * q_x < p[x]:
                node = child
                path.append(node)
                break
            residual = residual.clone()
            if q is None:
                residual[x] = 0.0
            else:
                residual = torch.clamp(residual - q, min=0.0)
            residual = residual / residual.sum()
        else:
            return Acceptance(path, sample(residual, generator))


# ---------------------------------------------------------------------------------------------
# 1. Acceptor level: synthetic Markov target and draft over V = 6 tokens
# ---------------------------------------------------------------------------------------------

V = 6
ROOT = 0
_logit_gen = torch.Generator().manual_seed(20240223)
# Row t: logits of the token that follows token t. The target's next-token distribution therefore
# depends on the token of the node it is read at, so using the wrong row of target_logits (e.g. the
# parent's instead of the accepted child's) changes the joint of consecutive tokens.
TARGET_LOGITS = 1.5 * torch.randn(V, V, generator=_logit_gen)
# The draft is the target plus noise: it agrees partly (total variation 0.2-0.35 per row, 0.2-0.6
# once warped), so acceptances, rejections, residual resampling and bonus tokens after a fully
# accepted path all occur often.
DRAFT_LOGITS = TARGET_LOGITS + torch.randn(V, V, generator=_logit_gen)

# 10000 sequences per case (a few seconds each). Power: with 6 cells (one token's marginal, df = 5) a
# chi-square test at ALPHA = 1e-3 detects, with probability 0.9, any deviation of Cohen's effect size
# w = sqrt(sum (p' - p)^2 / p) >= 0.054 (noncentrality N w^2 = 29); with the 36-cell joint of two
# tokens (df = 35), w >= 0.072. The broken acceptors below deviate by far more (min p-values below
# 1e-200), so N is not the limiting factor; 10000 keeps the file within its time budget.
N_ACCEPTOR = 10000
EMITTED = 2  # tokens per simulated sequence: the joint of two consecutive emitted tokens is tested


@dataclass(frozen=True)
class TreeCase:
    """How the synthetic drafter builds a tree rooted at the last emitted token.

    branching[d]: number of children of every node at depth d (a chain of 3 is (1, 1, 1)).
    sampled:      children drawn i.i.d. from q(. | parent token), draft_probs rows = that q;
                  otherwise the top-b tokens of q, with draft_probs None (point-mass proposals).
    params:       sampling params; q is warped with the same params (warp-consistent).
    """

    branching: tuple[int, ...]
    sampled: bool
    params: SamplingParams = SamplingParams(temperature=1.0)
    grafted: tuple[int, ...] = ()  # a point-mass tree of this branching grafted on (`specula.drafters.merged`)


WARPED = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
CASES = {
    "chain3-sampled": TreeCase((1, 1, 1), sampled=True),
    "chain3-deterministic": TreeCase((1, 1, 1), sampled=False),
    "tree3x2-sampled": TreeCase((3, 2), sampled=True),
    "tree3x2-deterministic": TreeCase((3, 2), sampled=False),
    "tree3x2-sampled-warped": TreeCase((3, 2), sampled=True, params=WARPED),
    "tree3x2-deterministic-warped": TreeCase((3, 2), sampled=False, params=WARPED),
    # What merged drafting verifies at T > 0: sampled head nodes, and beside and below them the point-mass
    # nodes of a second drafter (one-hot rows), grafted where their tokens coincide.
    "tree2x1-sampled-grafted": TreeCase((2, 1), sampled=True, grafted=(2, 2)),
}


class SyntheticDrafter:
    """Proposes a tree from the last emitted token with the synthetic draft q(. | token) (warped by
    the case's params). Nodes are laid out breadth first, so parents come before children."""

    def __init__(self, case: TreeCase, seed: int):
        self.case = case
        self.q_probs = probabilities(DRAFT_LOGITS, case.params)  # [V, V] float32, row t = q(. | t)
        q = self.q_probs.double().numpy()
        self.cdf = np.cumsum(q / q.sum(axis=1, keepdims=True), axis=1)
        self.top = np.argsort(-q, axis=1, kind="stable")  # deterministic drafts: most probable first
        self.rng = np.random.default_rng(seed)

    def propose(self, root: int) -> DraftTree:
        tree = self._grow(root, self.case.branching, self.case.sampled)
        if self.case.grafted:
            tree = graft(tree, self._grow(root, self.case.grafted, sampled=False))
        return tree

    def _grow(self, root: int, branching: tuple[int, ...], sampled: bool) -> DraftTree:
        tokens, parents, frontier = [root], [-1], [0]
        for width in branching:
            next_frontier = []
            for node in frontier:
                t = tokens[node]
                if sampled:  # i.i.d. draws from q(. | t), with replacement
                    kids = np.searchsorted(self.cdf[t], self.rng.random(width), side="right").clip(max=V - 1)
                else:
                    kids = self.top[t, :width]
                for kid in kids.tolist():
                    tokens.append(kid)
                    parents.append(node)
                    next_frontier.append(len(tokens) - 1)
            frontier = next_frontier
        token_tensor = torch.tensor(tokens)
        draft_probs = None
        if sampled:
            # Row i is the distribution node i was sampled from, q(. | token of its parent); row 0 unused.
            draft_probs = self.q_probs[token_tensor[[0, *parents[1:]]]]
        return DraftTree(token_tensor, parents, draft_probs)


@dataclass
class SimulationResult:
    counts: Counter  # (first emitted token, second emitted token) -> count
    accepted_drafts: int  # total accepted draft tokens over all cycles
    rejected_cycles: int  # cycles where the bonus token replaced a rejected draft (no draft accepted)


def simulate(acceptor, case: TreeCase, n: int, seed: int) -> SimulationResult:
    """Run the decode loop on the synthetic model ``n`` times and record the first EMITTED tokens.

    One acceptor call only determines the tokens of its own cycle: the first emitted token always,
    the second one only if a draft was accepted (otherwise it comes from the next cycle, drafted from
    the bonus token). So, like ``generate_tokens``, we run cycles until EMITTED tokens exist: draft a
    tree from the last token, verify it with the target rows TARGET_LOGITS[tree.tokens] (row i is the
    target's distribution after node i), emit accepted drafts + next_token. Whatever the cycle
    boundaries, the exact joint of the first two emitted tokens is p(a | ROOT) * p(b | a).
    """
    params = case.params
    drafter = SyntheticDrafter(case, seed)
    generator = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    accepted = rejected = 0
    for _ in range(n):
        emitted: list[int] = []
        last = ROOT
        while len(emitted) < EMITTED:
            tree = drafter.propose(last)
            result = acceptor(tree, TARGET_LOGITS[tree.tokens], params, generator)
            emitted += tree.tokens[result.accepted_nodes[1:]].tolist() + [result.next_token]
            last = emitted[-1]
            accepted += result.accepted_drafts
            rejected += result.accepted_drafts == 0
        counts[tuple(emitted[:EMITTED])] += 1
    return SimulationResult(counts, accepted, rejected)


def exact_markov_joint(params: SamplingParams) -> dict:
    """Exact probability of each pair (a, b) of first two emitted tokens: p(a | ROOT) p(b | a)."""
    p = probabilities(TARGET_LOGITS, params).double()
    p = p / p.sum(dim=-1, keepdim=True)
    return {(a, b): float(p[ROOT, a] * p[a, b]) for a in range(V) for b in range(V)}


def acceptor_pvalues(acceptor, case_name: str, seed: int = 0) -> tuple[dict[str, float], SimulationResult]:
    case = CASES[case_name]
    result = simulate(acceptor, case, N_ACCEPTOR, seed)
    return fit_pvalues(result.counts, exact_markov_joint(case.params), EMITTED), result


def test_synthetic_draft_differs_from_target():
    # Precondition of every acceptor-level test: a draft equal to the target would make any
    # acceptor look lossless. Total variation distance >= 0.15 in every row (checked, not assumed).
    for params in (SamplingParams(temperature=1.0), WARPED):
        p, q = probabilities(TARGET_LOGITS, params), probabilities(DRAFT_LOGITS, params)
        tv = 0.5 * (p - q).abs().sum(dim=-1)
        assert bool((tv > 0.15).all()), tv


@pytest.mark.parametrize("case_name", list(CASES))
def test_speculative_sampling_matches_target_distribution(case_name):
    # Under a correct acceptor the p-values are uniform on [0, 1]. The lowest one with seed 0 is the
    # first-token marginal of chain3-sampled (~2e-3); seeds 1-8 give 0.1-0.66 there and 80000 pooled
    # draws 0.32, i.e. plain chance, not a bias.
    pvalues, result = acceptor_pvalues(Acceptor(), case_name)
    # Non-vacuous: drafts were accepted and rejected many times (both branches of the rule ran).
    assert result.accepted_drafts > N_ACCEPTOR // 10 and result.rejected_cycles > N_ACCEPTOR // 10
    assert min(pvalues.values()) >= ALPHA, pvalues


@pytest.mark.parametrize("case_name", ["chain3-sampled", "tree3x2-sampled", "tree3x2-deterministic",
                                       "tree2x1-sampled-grafted"])
def test_broken_residual_acceptor_is_rejected(case_name):
    pvalues, _ = acceptor_pvalues(accept_bonus_from_unmodified_p, case_name)
    assert min(pvalues.values()) < ALPHA, pvalues


@pytest.mark.parametrize("case_name", ["chain3-sampled", "tree3x2-sampled", "tree3x2-deterministic",
                                       "tree2x1-sampled-grafted"])
def test_always_accepting_acceptor_is_rejected(case_name):
    pvalues, _ = acceptor_pvalues(accept_first_child_always, case_name)
    assert min(pvalues.values()) < ALPHA, pvalues


@pytest.mark.parametrize("case_name", ["tree3x2-sampled", "tree3x2-deterministic", "tree2x1-sampled-grafted"])
def test_sibling_rounds_without_residual_update_are_rejected(case_name):
    pvalues, _ = acceptor_pvalues(accept_siblings_against_original_p, case_name)
    assert min(pvalues.values()) < ALPHA, pvalues


def graft_judging_shared_nodes_as_point_masses(head: DraftTree, suffix: DraftTree) -> DraftTree:
    """The merge's own way of failing: where a point-mass node falls on a sampled one, judge the shared node by
    the point-mass rule (a one-hot row) instead of by the q it was drawn from."""
    tree = merged.graft(head, suffix)
    tokens, shared = tree.tokens.tolist(), []
    for node in range(1, len(suffix)):  # walk suffix paths through the merged tree
        at = 0
        for token in suffix.tokens[suffix.path_to(node)[1:]].tolist():
            at = next(c for c in tree.children(at) if tokens[c] == token)
        if at < len(head):
            shared.append(at)
    probs = tree.draft_probs.clone()
    for node in shared:
        probs[node] = 0.0
        probs[node, tokens[node]] = 1.0
    return DraftTree(tree.tokens, tree.parents, probs)


def test_a_graft_judging_sampled_nodes_by_the_point_mass_rule_is_rejected(monkeypatch):
    assert "graft" in globals()  # the drafter below calls this module's name, which the patch replaces
    monkeypatch.setitem(globals(), "graft", graft_judging_shared_nodes_as_point_masses)
    pvalues, result = acceptor_pvalues(Acceptor(), "tree2x1-sampled-grafted")
    assert result.accepted_drafts > N_ACCEPTOR // 10
    assert min(pvalues.values()) < ALPHA, pvalues


# ---------------------------------------------------------------------------------------------
# 2. End to end through generate_tokens with real models
# ---------------------------------------------------------------------------------------------

E2E_PARAMS = SamplingParams(temperature=1.0, top_k=5)
# 4 new tokens: the first comes from the prefill (no speculation); the first speculative cycle may
# then draft 2 tokens (max_depth = 4 - 1 - 1), so acceptance at depth 1 and 2, the residual after a
# rejection at either depth and the bonus token after a fully accepted chain all occur; tokens 2-4
# go through acceptance. With top_k = 5 the exact joint has at most 5^4 = 625 outcomes, computed by
# 1 + 5 + 25 + 125 prefix forwards of the transformers model (independent of specula's runtime).
E2E_NEW_TOKENS = 4
# 800 runs per method (~10 ms each on an idle core, ~20 ms on a busy shared machine). After pooling,
# the joint of the 4 tokens keeps 24-34 cells and the per-position marginals 5-23. At ALPHA = 1e-3 that
# detects (power 0.9) effect sizes w >= 0.19 (df 4) up to w >= 0.26 (df 36); the broken acceptor
# below deviates by w ~ 0.4 with these prompts and is rejected with p-values around 1e-20 and below.
N_E2E = 800
# Among the story prompts of conftest, the one where llama2xs disagrees most with stories260k on the
# second token (top-5 total variation ~0.5): it makes the broken acceptor's deviation large (Cohen's
# w ~ 0.4 on the position-2 marginal by a one-step calculation), where e.g. "One day, a little girl
# named Lily" (w ~ 0.08) would leave that bug invisible at this N.
SPS_PROMPT = "A friendly dragon lived on a hill"
# pld drafts by copying what followed an earlier occurrence of the newest n-gram: this prompt repeats
# itself, so lookups hit and the target accepts a fair share of them (about 1 draft per run).
PLD_PROMPT = 'Lily said, "Hi!" Tom said, "Hi!" Lily said, "Hi!" Tom said'


@pytest.fixture(scope="module")
def models():
    target = Target.load(STORIES, dtype="float32")
    draft = Target.load(LLAMA2XS, dtype="float32", role="draft")
    return target, draft


def encode(target: Target, text: str) -> torch.Tensor:
    return torch.tensor(target.tokenizer(text)["input_ids"], dtype=torch.long)


@torch.inference_mode()
def exact_sequence_distribution(target: Target, prompt: torch.Tensor, params: SamplingParams,
                                length: int) -> dict:
    """Exact probability of every sequence of ``length`` new tokens under the target's own sampling,
    from batched forwards of the plain transformers model over every positive-probability prefix."""
    prefixes = {(): 1.0}
    for _ in range(length):
        keys = list(prefixes)
        batch = torch.stack([torch.cat([prompt, torch.tensor(k, dtype=torch.long)]) for k in keys])
        logits = transformers_model(target.model)(input_ids=batch).logits[:, -1].float()
        probs = probabilities(logits, params).double()
        grown = {}
        for row, key in enumerate(keys):
            for token in torch.nonzero(probs[row]).flatten().tolist():
                grown[key + (token,)] = prefixes[key] * float(probs[row, token])
        prefixes = grown
    total = sum(prefixes.values())
    return {k: v / total for k, v in prefixes.items()}


def run_generation(target: Target, drafter, prompt: torch.Tensor, acceptor=None,
                   seed0: int = 0) -> tuple[Counter, int]:
    counts: Counter = Counter()
    accepted = 0
    for seed in range(seed0, seed0 + N_E2E):
        tokens, stats_ = generate_tokens(target, drafter, prompt, E2E_NEW_TOKENS, E2E_PARAMS, seed=seed,
                                         stop_on_eos=False, acceptor=acceptor)
        assert len(tokens) == E2E_NEW_TOKENS
        counts[tuple(tokens)] += 1
        accepted += sum(stats_.accepted_lengths)
    return counts, accepted


def e2e_pvalues(models, method: str, acceptor=None) -> tuple[dict[str, float], int]:
    target, draft = models
    if method == "sps":
        drafter, prompt = DraftModelDrafter(draft, num_tokens=3), encode(target, SPS_PROMPT)
    else:
        drafter, prompt = PromptLookupDrafter(num_tokens=10), encode(target, PLD_PROMPT)
    exact = exact_sequence_distribution(target, prompt, E2E_PARAMS, E2E_NEW_TOKENS)
    counts, accepted = run_generation(target, drafter, prompt, acceptor)
    return fit_pvalues(counts, exact, E2E_NEW_TOKENS), accepted


@pytest.mark.parametrize("method", ["sps", "pld"])
def test_generate_tokens_sampling_matches_target_distribution(models, method):
    pvalues, accepted = e2e_pvalues(models, method)
    # Non-vacuous: speculation really happened (about 0.95 accepted drafts per run for either method).
    assert accepted > N_E2E // 2, accepted
    assert min(pvalues.values()) >= ALPHA, pvalues


@pytest.mark.parametrize("method", ["sps", "pld"])
def test_generate_tokens_with_broken_residual_acceptor_is_rejected(models, method):
    # The same end-to-end test, run with an acceptor that skips the residual update (see
    # accept_bonus_from_unmodified_p): it must fail, for sampled (sps) and point-mass (pld) drafts.
    pvalues, accepted = e2e_pvalues(models, method, acceptor=accept_bonus_from_unmodified_p)
    assert accepted > N_E2E // 2, accepted
    assert min(pvalues.values()) < ALPHA, pvalues


def test_batched_inverse_cdf_sampling_draws_each_token_at_its_probability_and_never_a_zero():
    from specula.sampling import sample_rows

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2], [0.1, 0.0, 0.0, 0.0, 0.9]])
    edges = sample_rows(probs, torch.tensor([0.0, 1.0 - 2 ** -24]))
    assert edges.tolist() == [1, 4]  # the first and the last token of non-zero mass at the ends of [0, 1)
    generator = torch.Generator().manual_seed(0)
    draws = 20_000
    tokens = sample_rows(probs[:1].expand(draws, -1), torch.rand(draws, generator=generator))
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[0] == 0 and counts[2] == 0
    expected = probs[0].double() * draws
    sigma = (expected * (1 - probs[0].double())).sqrt()
    assert bool(((counts - expected).abs() <= 5 * sigma + 1e-9).all()), counts
