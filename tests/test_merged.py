"""Merged drafting: the suffix drafter's candidates grafted onto a head's tree, verified in one pass, lossless.

The sampled side (sampled head nodes beside and above point-mass nodes, with the broken-graft control) is in
`test_lossless_sampling` (case ``tree2x1-sampled-grafted``); greedy equality of every head method, merged by
default, in `test_greedy_equality` and `test_smollm2`.
"""

from __future__ import annotations

import pytest
import torch
from conftest import STORIES

from specula.api import Speculator
from specula.drafters.merged import MergedDrafter, graft
from specula.drafters.suffix import SuffixDrafter
from specula.errors import SpeculaError
from specula.methods import build_speculator, check_options
from specula.tree import DraftTree

REPEATING_STORY = 'Lily said, "Hi!" Tom said, "Hi!" Lily said, "Hi!" Tom said'
REPEATING = "Repeat after me three times: the quick brown fox jumps over the lazy dog."


def tree(tokens: list[int], parents: list[int], confidences: list[float] | None = None) -> DraftTree:
    return DraftTree(torch.tensor(tokens), parents, confidences=None if confidences is None
                     else torch.tensor(confidences))


def paths(t: DraftTree) -> set[tuple[int, ...]]:
    tokens = t.tokens.tolist()
    return {tuple(tokens[n] for n in t.path_to(node)) for node in range(len(t))}


def test_a_graft_is_the_union_of_both_trees_paths_with_the_head_nodes_first():
    head = tree([7, 1, 2, 3], [-1, 0, 0, 1], [1.0, 0.6, 0.3, 0.5])
    suffix = tree([7, 1, 4, 5, 2], [-1, 0, 1, 2, 0], [1.0, 0.9, 0.8, 0.7, 0.1])  # 7-1-4-5 and 7-2
    merged = graft(head, suffix)
    assert merged.tokens[:4].tolist() == [7, 1, 2, 3] and merged.parents[:4] == [-1, 0, 0, 1]
    assert paths(merged) == paths(head) | paths(suffix)
    assert len(merged) == 6  # 1 and 2 are shared; 4 and 5 are new, 4 below the head's node 1
    assert merged.parents[4:] == [1, 4]
    assert merged.confidences.tolist() == pytest.approx([1.0, 0.6, 0.3, 0.5, 0.8, 0.7])  # each node's own drafter


def test_a_root_only_side_leaves_the_other_tree_as_it_was():
    head, root = tree([7, 1], [-1, 0]), tree([7], [-1])
    assert graft(head, root) is head
    assert graft(root, head) is head


def test_grafted_nodes_of_a_sampled_cycle_are_one_hot_point_masses_and_shared_nodes_keep_their_q():
    q = torch.softmax(torch.randn(3, 10, generator=torch.Generator().manual_seed(0)), dim=-1)
    head = DraftTree(torch.tensor([7, 1, 2]), [-1, 0, 1], q)
    suffix = tree([7, 1, 5], [-1, 0, 1])
    merged = graft(head, suffix)
    assert merged.tokens.tolist() == [7, 1, 2, 5] and merged.parents == [-1, 0, 1, 1]
    assert torch.equal(merged.draft_probs[:3], q)  # node 1 was drawn from q: the suffix's copy of it keeps q
    assert merged.draft_probs[3].tolist() == [1.0 if v == 5 else 0.0 for v in range(10)]


def test_merged_eagle3_on_smollm2_decodes_what_transformers_decodes_and_accepts_suffix_drafts(smollm2):
    ids = smollm2.speculator.encode(REPEATING)[None]
    with torch.no_grad():
        out = smollm2.reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=48)
    expected = out[0, ids.shape[1]:].tolist()
    merged = build_speculator(smollm2.speculator.target, "eagle3", profile=False)
    head_only = build_speculator(smollm2.speculator.target, "eagle3", profile=False, head_only=True)
    assert isinstance(merged.drafter, MergedDrafter) and not isinstance(head_only.drafter, MergedDrafter)
    results = {}
    for name, speculator in (("merged", merged), ("head only", head_only)):
        result = speculator.generate(REPEATING, max_new_tokens=48)
        assert result.token_ids == expected, name
        results[name] = result.stats
    # On a CPU the head drafts one node per cycle: a longer tree or accepted path came from the suffix drafter.
    assert max(results["head only"].tree_sizes) == 1
    assert max(results["merged"].accepted_lengths) > 1
    assert results["merged"].cycles < results["head only"].cycles


def test_head_only_is_an_option_of_the_head_methods_alone():
    assert check_options("eagle2", {"head_only": "true"}) == {"head_only": True}
    with pytest.raises(SpeculaError, match="applies only to method eagle, eagle2, eagle3"):
        check_options("pld", {"head_only": True})


def test_forks_draft_from_their_own_generation(smollm2):
    speculator = build_speculator(smollm2.speculator.target, "eagle3", profile=False)
    fork = speculator.drafter.fork()
    drafter = speculator.drafter
    assert fork.head_drafter is not drafter.head_drafter and fork.suffix_drafter is not drafter.suffix_drafter
    assert fork.head_drafter.head is drafter.head_drafter.head  # the weights are shared
    assert fork.suffix_drafter.index is not drafter.suffix_drafter.index
    assert fork.name == "eagle3" and fork.features == speculator.drafter.features


def test_after_warm_up_a_compiled_merged_generation_compiles_nothing(eagle3_head_dir):
    """`specula.decoding.warm_up` compiles the head's steps too: in a compiled bench the head's first steps had
    compiled inside timed questions (merged drafting meets catch-up blocks of up to 9 pairs)."""
    from torch._dynamo.utils import counters

    from specula.decoding import warm_up

    # Drafts of at most 2 suffix nodes beside the head's one: blocks and catch-ups of up to 4, so warm-up compiles
    # 3 target and 6 head sizes instead of the 6 and 12 a default run needs (~40 s on 2 cores).
    head = build_speculator(STORIES, "eagle3", draft=eagle3_head_dir, dtype="float32", compile=True, profile=False,
                            head_only=True)
    speculator = Speculator(head.target, "eagle3", MergedDrafter(head.drafter, SuffixDrafter(num_tokens=2)))
    warm_up(speculator.target, speculator.drafter, max_block=4)
    compiled_before = counters["stats"]["unique_graphs"]
    result = speculator.generate(REPEATING_STORY, max_new_tokens=48, stop_on_eos=False)
    assert max(result.stats.accepted_lengths) > 1  # suffix drafts were accepted: catch-up blocks of several pairs
    assert counters["stats"]["unique_graphs"] == compiled_before
