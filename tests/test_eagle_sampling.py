"""Sampling through eagle/eagle2/eagle3 trees at T > 0 is distributed exactly as the target samples (chi-square)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import STORIES
from test_lossless_sampling import (
    ALPHA,
    E2E_NEW_TOKENS,
    E2E_PARAMS,
    accept_bonus_from_unmodified_p,
    encode,
    exact_sequence_distribution,
    fit_pvalues,
    marginal,
    run_generation,
)

from specula.drafters.eagle import EagleDrafter
from specula.heads.eagle3_head import Eagle3Head
from specula.heads.eagle_head import EagleHead
from specula.runtime.target import Target

# Heads trained on stories260k's own continuations (recipes in their READMEs), small enough to keep here.
HEAD = Path(__file__).parent / "data" / "eagle-stories260k"
# Its draft vocabulary is 256 of the target's 512 tokens: the draft gives every other token probability 0.
EAGLE3_HEAD = Path(__file__).parent / "data" / "eagle3-stories260k"
PROMPT = "Once upon a time, Lily went to the park with a red ball."


@pytest.fixture(scope="module")
def target() -> Target:
    return Target.load(STORIES, dtype="float32")


# A grown tree, and the one level of sampled children the CPU's budgets draft (kept without growing a tree).
GROWN = {"total_tokens": 6, "depth": 3, "top_k": 2}
ONE_LEVEL = {"total_tokens": 2, "depth": 1, "top_k": 3}


def pvalues(target: Target, dynamic: bool, acceptor=None, options: dict | None = None) -> tuple[dict[str, float], int]:
    head = EagleHead.from_pretrained(HEAD)
    options = options or (GROWN if dynamic else {"choices": [[0], [1], [0, 0], [0, 1]]})
    drafter = EagleDrafter(target, head, dynamic=dynamic, **options)
    prompt = encode(target, PROMPT)
    exact = exact_sequence_distribution(target, prompt, E2E_PARAMS, E2E_NEW_TOKENS)
    counts, accepted = run_generation(target, drafter, prompt, acceptor)
    return fit_pvalues(counts, exact, E2E_NEW_TOKENS), accepted


@pytest.mark.parametrize("dynamic", [False, True], ids=["eagle", "eagle2"])
def test_eagle_tree_sampling_matches_target_distribution(target, dynamic):
    result, accepted = pvalues(target, dynamic)
    assert accepted > 500, accepted  # the head really drafted accepted tokens: the test is not vacuous
    assert min(result.values()) >= ALPHA, result


def without_tokens(head: Eagle3Head, dropped: set[int]) -> Eagle3Head:
    """The same head with ``dropped`` target tokens removed from its draft vocabulary."""
    keep = [d for d in range(head.draft_vocab_size) if int(head.draft_to_target(torch.tensor(d))) not in dropped]
    smaller = Eagle3Head(dict(head.config, draft_vocab_size=len(keep)))
    state = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    state["lm_head.weight"] = state["lm_head.weight"][keep]
    smaller.load_state_dict(state, strict=False)
    smaller.set_draft_vocab(head.draft_to_target(torch.tensor(keep)))
    return smaller.eval()


def eagle3_pvalues(target: Target, acceptor=None) -> tuple[dict[str, float], int, float]:
    """p-values, accepted drafts, and the target's probability that the first new token is outside the draft
    vocabulary (the head's vocabulary is reduced further by the target's two likeliest first tokens, so the
    out-of-vocabulary case carries real mass)."""
    head = Eagle3Head.from_pretrained(EAGLE3_HEAD, num_target_layers=target.config.num_hidden_layers)
    prompt = encode(target, PROMPT)
    exact = exact_sequence_distribution(target, prompt, E2E_PARAMS, E2E_NEW_TOKENS)
    first = marginal(exact, 0)
    head = without_tokens(head, set(sorted(first, key=first.get, reverse=True)[:2]))
    in_vocab = set(head.target_vocab_ids().tolist())
    outside = sum(p for token, p in first.items() if token not in in_vocab)
    drafter = EagleDrafter(target, head, dynamic=True, name="eagle3", total_tokens=6, depth=3, top_k=2)
    counts, accepted = run_generation(target, drafter, prompt, acceptor)
    return fit_pvalues(counts, exact, E2E_NEW_TOKENS), accepted, outside


def test_eagle3_with_reduced_draft_vocabulary_matches_target_distribution(target):
    result, accepted, outside = eagle3_pvalues(target)
    assert outside > 0.2, outside  # the target often picks tokens the draft can never propose
    assert accepted > 300, accepted
    assert min(result.values()) >= ALPHA, result


def test_eagle3_with_broken_acceptor_is_rejected(target):
    result, _, _ = eagle3_pvalues(target, acceptor=accept_bonus_from_unmodified_p)
    assert min(result.values()) < ALPHA, result


def test_eagle2_with_broken_acceptor_is_rejected(target):
    result, _ = pvalues(target, True, acceptor=accept_bonus_from_unmodified_p)
    assert min(result.values()) < ALPHA, result


def test_one_level_of_sampled_children_matches_target_distribution_and_a_broken_acceptor_is_seen(target):
    result, accepted = pvalues(target, True, options=ONE_LEVEL)
    assert accepted > 300, accepted
    assert min(result.values()) >= ALPHA, result
    broken, _ = pvalues(target, True, acceptor=accept_bonus_from_unmodified_p, options=ONE_LEVEL)
    assert min(broken.values()) < ALPHA, broken


def test_one_level_of_sampled_children_is_the_first_level_a_grown_tree_keeps(target):
    """The same draws, tokens, distributions and confidences as growing a tree whose budget keeps only the root's
    children (its deeper level is drawn after them, then dropped)."""
    import specula

    head = EagleHead.from_pretrained(HEAD)
    prompt = encode(target, PROMPT)
    params = specula.SamplingParams(temperature=1.0)
    trees = []
    for depth in (1, 2):
        drafter = EagleDrafter(target, head, dynamic=True, total_tokens=3, depth=depth, top_k=3)
        target.reset()
        out = target.prefill(prompt, drafter.features)
        drafter.start(prompt, out)
        context = torch.cat([prompt, torch.tensor([int(out.logits[-1].argmax())])])
        trees.append(drafter.propose(context, max_depth=10, params=params,
                                     generator=torch.Generator().manual_seed(7)))
    one_level, grown = trees
    assert one_level.parents == grown.parents == [-1, 0, 0, 0]
    assert torch.equal(one_level.tokens, grown.tokens) and torch.equal(one_level.draft_probs, grown.draft_probs)
    torch.testing.assert_close(one_level.confidences, grown.confidences)
