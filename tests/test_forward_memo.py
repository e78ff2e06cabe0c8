"""What makes `specula check`'s sampling cheap changes nothing it measures: runs through a `ForwardMemo` are the
runs of plain decoding, and the exact distribution computed as token trees is the target's one-prefix-at-a-time."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import LLAMA2XS, STORIES

import specula
from specula.certify.exact_distribution import MAX_BLOCK, ExactDistribution
from specula.certify.forward_memo import ForwardMemo
from specula.decoding import generate_tokens
from specula.sampling import SamplingParams, probabilities

HEAD = Path(__file__).parent / "data" / "eagle-stories260k"
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("method, draft", [("pld", None), ("sps", LLAMA2XS), ("eagle2", HEAD)])
def test_runs_through_the_memo_are_the_plain_runs_and_share_forwards(method, draft):
    speculator = specula.load(STORIES, method, draft=draft, dtype="float32", profile=False)
    prompt = speculator.encode("Lily and Tom went to the park. Lily and Tom went to the park. Lily and Tom")
    params = SamplingParams(temperature=1.0)
    memo = ForwardMemo(speculator.target)

    def runs(target):
        return [generate_tokens(target, speculator.drafter, prompt, 8, params, seed=seed, stop_on_eos=False)
                for seed in range(40)]

    remembered, plain = runs(memo), runs(speculator.target)
    for (tokens, stats), (expected, expected_stats) in zip(remembered, plain, strict=True):
        assert tokens == expected
        assert stats.accepted_lengths == expected_stats.accepted_lengths  # acceptance saw the same numbers
    assert sum(sum(stats.accepted_lengths) for _, stats in plain) > 0  # speculation happened
    cycles = sum(stats.cycles for _, stats in plain)
    assert memo.forwards + memo.hits == cycles and memo.hits >= 39  # every prefill after the first, at least


def test_a_draft_model_through_its_own_memo_drafts_what_it_drafts_plainly():
    """sps's draft model keeps and cuts its own cache (rejected drafts are truncated away); remembered through a
    memo of its own, as `specula check` runs it, every run is still the plain run."""
    speculator = specula.load(STORIES, "sps", draft=LLAMA2XS, dtype="float32", profile=False)
    prompt = speculator.encode("Lily and Tom went to the park. Lily and Tom went to the park. Lily and Tom")
    params = SamplingParams(temperature=1.0)
    drafter = copy.copy(speculator.drafter)
    drafter.draft = ForwardMemo(speculator.drafter.draft)

    def runs(target, drafter):
        return [generate_tokens(target, drafter, prompt, 8, params, seed=seed, stop_on_eos=False)
                for seed in range(40)]

    remembered, plain = runs(ForwardMemo(speculator.target), drafter), runs(speculator.target, speculator.drafter)
    for (tokens, stats), (expected, expected_stats) in zip(remembered, plain, strict=True):
        assert tokens == expected
        assert stats.accepted_lengths == expected_stats.accepted_lengths
    assert sum(sum(stats.accepted_lengths) for _, stats in plain) > 0
    # Every run after the first answers its draft prefill from memory, and runs keep sharing after a truncation.
    assert drafter.draft.hits >= 39 + 10 and drafter.draft.forwards > 0


def test_memo_stops_remembering_past_its_budget_and_still_decodes_plainly():
    speculator = specula.load(STORIES, "pld", dtype="float32", profile=False)
    prompt = speculator.encode("Once upon a time")
    params = SamplingParams(temperature=1.0)
    memo = ForwardMemo(speculator.target, max_bytes=0)
    got = [generate_tokens(memo, speculator.drafter, prompt, 5, params, seed=s, stop_on_eos=False)[0] for s in range(5)]
    want = [generate_tokens(speculator.target, speculator.drafter, prompt, 5, params, seed=s,
                            stop_on_eos=False)[0] for s in range(5)]
    assert got == want and memo.hits == 0 and memo.bytes == 0


def test_exact_distribution_as_token_trees_equals_one_prefix_at_a_time(monkeypatch):
    speculator = specula.load(STORIES, "vanilla", dtype="float32", profile=False)
    target = speculator.target
    prompt = speculator.encode("One day, a little girl")
    params = SamplingParams(temperature=0.8, top_p=0.95)
    torch.manual_seed(0)
    prefixes = {tuple(torch.randint(0, target.vocab_size, (length,)).tolist()) for length in (1, 2, 3) * 40}
    prefixes |= {(5, 6), (5, 6, 7), (5,)}  # nested prefixes in one request
    monkeypatch.setattr("specula.certify.exact_distribution.MAX_BLOCK", 16)  # many forwards, split between subtrees
    exact = ExactDistribution(target, prompt, params)
    exact.compute(prefixes)
    assert exact.forwards >= 1 + len(prefixes) // 16 and MAX_BLOCK > 16
    for prefix in sorted(prefixes) + [()]:
        ids = torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)])
        expected = probabilities(target.prefill(ids).logits[-1], params)
        torch.testing.assert_close(exact[prefix], expected, atol=1e-6, rtol=1e-4)
