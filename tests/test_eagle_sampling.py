"""Sampling through eagle/eagle2 trees at T > 0 is distributed exactly as the target samples (chi-square)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import STORIES
from test_lossless_sampling import (
    ALPHA,
    E2E_NEW_TOKENS,
    E2E_PARAMS,
    accept_bonus_from_unmodified_p,
    encode,
    exact_sequence_distribution,
    fit_pvalues,
    run_generation,
)

from specula.drafters.eagle import EagleDrafter
from specula.heads.eagle_head import EagleHead
from specula.target import Target

# A head trained on stories260k's own continuations (recipe in its README), small enough to keep here.
HEAD = Path(__file__).parent / "data" / "eagle-stories260k"
PROMPT = "Once upon a time, Lily went to the park with a red ball."


@pytest.fixture(scope="module")
def target() -> Target:
    return Target.load(STORIES, dtype="float32")


def pvalues(target: Target, dynamic: bool, acceptor=None) -> tuple[dict[str, float], int]:
    head = EagleHead.from_pretrained(HEAD)
    options = {"total_tokens": 6, "depth": 3, "top_k": 2} if dynamic else {"choices": [[0], [1], [0, 0], [0, 1]]}
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


def test_eagle2_with_broken_acceptor_is_rejected(target):
    result, _ = pvalues(target, True, acceptor=accept_bonus_from_unmodified_p)
    assert min(result.values()) < ALPHA, result
