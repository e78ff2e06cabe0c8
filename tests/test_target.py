"""The target runtime: tree forward, cache compaction, and equality with transformers for each family."""

from __future__ import annotations

import pytest
import torch
from conftest import STORIES, random_tree, tiny_model

from specula.errors import SpeculaError
from specula.runtime.target import FeatureRequest, Target

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
# float32 logits of a tree node vs the same path run alone: only summation order differs.
TREE_ATOL = 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_matches_transformers_generate(family):
    model = tiny_model(family, seed=1)
    target = Target(model)
    prompt = torch.randint(0, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    expected = model.generate(prompt[None], max_new_tokens=40, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, 12:].tolist()
    out = target.prefill(prompt)
    produced = [int(out.logits[-1].argmax())]
    for _ in range(39):
        out = target.forward(torch.tensor(produced[-1:]))
        target.commit()
        produced.append(int(out.logits[-1].argmax()))
    assert produced == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_node_logits_equal_running_each_path_alone(family):
    model = tiny_model(family, seed=2)
    target = Target(model)
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(4))
    tree = random_tree(15, 97, seed=5)
    target.prefill(prompt)
    out = target.forward(tree.tokens, tree.ancestor_mask(), tree.depths)
    for node in range(len(tree)):
        path = torch.cat([prompt, tree.tokens[tree.path_to(node)]])
        reference = model(path[None]).logits[0, -1]
        torch.testing.assert_close(out.logits[node], reference, atol=TREE_ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_compacted_cache_equals_cache_of_recomputed_text(family):
    model = tiny_model(family, seed=3)
    target = Target(model)
    prompt = torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(6))
    tree = random_tree(12, 97, seed=7)
    leaf = max(range(len(tree)), key=lambda i: tree.depths[i])
    accepted = tree.path_to(leaf)
    target.prefill(prompt)
    target.forward(tree.tokens, tree.ancestor_mask(), tree.depths)
    target.commit(accepted)
    assert target.length == len(prompt) + len(accepted)

    fresh = Target(tiny_model(family, seed=3))
    fresh.prefill(torch.cat([prompt, tree.tokens[accepted]]))
    for layer in range(model.config.num_hidden_layers):
        for mine, theirs in ((target.runtime.cache.keys, fresh.runtime.cache.keys),
                              (target.runtime.cache.values, fresh.runtime.cache.values)):
            torch.testing.assert_close(mine[layer][:, :, : target.length], theirs[layer][:, :, : target.length],
                                       atol=TREE_ATOL, rtol=0)
    # And decoding continues exactly as from the recomputed text.
    nxt = torch.tensor([5])
    torch.testing.assert_close(target.forward(nxt).logits, fresh.forward(nxt).logits, atol=TREE_ATOL, rtol=0)


def test_generic_runtime_handles_non_llama_models():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=128)).eval()
    target = Target(model)
    assert type(target.runtime).__name__ == "GenericRuntime"
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(8))
    tree = random_tree(10, 97, seed=9)
    target.prefill(prompt)
    out = target.forward(tree.tokens, tree.ancestor_mask(), tree.depths)
    for node in range(len(tree)):
        path = torch.cat([prompt, tree.tokens[tree.path_to(node)]])
        torch.testing.assert_close(out.logits[node], model(path[None]).logits[0, -1], atol=TREE_ATOL, rtol=0)
    accepted = tree.path_to(len(tree) - 1)
    target.commit(accepted)
    nxt = torch.tensor([3])
    expected = model(torch.cat([prompt, tree.tokens[accepted], nxt])[None]).logits[0, -1]
    torch.testing.assert_close(target.forward(nxt).logits[-1], expected, atol=TREE_ATOL, rtol=0)


def test_features_are_final_hidden_and_layer_inputs():
    model = tiny_model("llama", seed=4)
    target = Target(model)
    prompt = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(10))
    out = target.prefill(prompt, FeatureRequest(final_hidden=True, layer_inputs=(0, 2)))
    reference = model(prompt[None], output_hidden_states=True)
    # hidden_states[i] is the input of decoder layer i; the final features are after the last norm.
    torch.testing.assert_close(out.layer_inputs[0], reference.hidden_states[0][0])
    torch.testing.assert_close(out.layer_inputs[2], reference.hidden_states[2][0], atol=TREE_ATOL, rtol=0)
    torch.testing.assert_close(out.logits, model.lm_head(out.hidden), atol=TREE_ATOL, rtol=0)
    torch.testing.assert_close(out.logits, reference.logits[0], atol=TREE_ATOL, rtol=0)


def test_kv_cache_is_allocated_as_needed_and_keeps_its_entries_when_it_grows():
    from specula.runtime.static_cache import SLOT_STEP, StaticKVCache

    cache = StaticKVCache(2, 1, 4, capacity=5 * SLOT_STEP, dtype=torch.float32, device="cpu")
    assert cache.allocated == SLOT_STEP  # not the whole capacity up front
    block = torch.arange(1 * 1 * (SLOT_STEP + 3) * 4, dtype=torch.float32).reshape(1, 1, SLOT_STEP + 3, 4)
    for layer in range(2):
        keys, values = cache.write(layer, block, -block)
        assert torch.equal(keys, block) and torch.equal(values, -block)
    cache.commit()
    assert cache.allocated == 2 * SLOT_STEP
    cache.reserve(3 * SLOT_STEP + 1)  # at least doubled, in whole steps
    assert cache.allocated == 4 * SLOT_STEP
    cache.reserve(4 * SLOT_STEP + 1)  # capped at the capacity
    assert cache.allocated == 5 * SLOT_STEP
    assert torch.equal(cache.keys[1][:, :, :SLOT_STEP + 3], block)
    cache.reserve(10)  # never shrinks
    assert cache.allocated == 5 * SLOT_STEP


def test_decoding_past_the_first_kv_allocation_gives_the_logits_of_a_cache_allocated_up_front():
    from specula.runtime.static_cache import SLOT_STEP

    model = tiny_model("llama", seed=4, max_position_embeddings=4 * SLOT_STEP)
    prompt = torch.randint(0, 97, (SLOT_STEP - 10,), generator=torch.Generator().manual_seed(8))
    runs = []
    for reserved in (0, 4 * SLOT_STEP):
        target = Target(model)
        target.reserve(reserved)
        logits = [target.prefill(prompt).logits[-1]]
        tokens = [int(logits[-1].argmax())]
        for _ in range(29):
            logits.append(target.forward(torch.tensor(tokens[-1:])).logits[-1])
            target.commit()
            tokens.append(int(logits[-1].argmax()))
        runs.append((torch.stack(logits), tokens, target.runtime.cache.allocated))
    (grown, tokens, allocated), (up_front, _, _) = runs
    assert allocated == 2 * SLOT_STEP
    assert torch.equal(grown, up_front)
    reference = model(torch.cat([prompt, torch.tensor(tokens[:-1])])[None]).logits[0, -1]
    torch.testing.assert_close(grown[-1], reference, atol=TREE_ATOL, rtol=0)


def test_a_released_target_gives_back_its_grown_kv_memory_and_decodes_as_new():
    from specula.runtime.static_cache import SLOT_STEP

    model = tiny_model("llama", seed=4, max_position_embeddings=4 * SLOT_STEP)
    long_prompt = torch.randint(0, 97, (2 * SLOT_STEP,), generator=torch.Generator().manual_seed(8))
    prompt = long_prompt[:20]
    target = Target(model)
    fresh = Target(model).prefill(prompt).logits
    target.prefill(long_prompt)
    target.release()
    assert target.length == 0 and target.runtime.cache.allocated == SLOT_STEP
    assert torch.equal(target.prefill(prompt).logits, fresh)


def test_compiled_steps_compute_what_eager_steps_compute():
    """Decode, chain and tree blocks (padded to the compiled sizes) give the eager step's logits, features and
    cache: float32 here, where only Inductor's summation order differs."""
    model = tiny_model("llama", seed=2)
    eager, compiled = Target(model), Target(model)
    compiled.compile()
    features = FeatureRequest(final_hidden=True, layer_inputs=(1,))
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(4))
    for target in (eager, compiled):
        target.prefill(prompt)
    tree = random_tree(7, 97, seed=5)
    blocks = [(torch.tensor([3]), None, None, [0]), (torch.tensor([5, 8, 13]), None, None, [0, 1, 2]),
              (tree.tokens, tree.ancestor_mask(), tree.depths, [0, 2, 5])]
    for tokens, mask, depths, keep in blocks:
        outs = [target.forward(tokens, mask, depths, features) for target in (eager, compiled)]
        assert torch.allclose(outs[0].logits, outs[1].logits, atol=1e-5)
        assert torch.allclose(outs[0].hidden, outs[1].hidden, atol=1e-5)
        assert torch.allclose(outs[0].layer_inputs[1], outs[1].layer_inputs[1], atol=1e-5)
        for target in (eager, compiled):
            target.commit(keep)
    assert eager.length == compiled.length == 20 + 1 + 3 + 3
    end = eager.length
    for layer in range(3):
        assert torch.allclose(eager.runtime.cache.keys[layer][:, :, :end],
                              compiled.runtime.cache.keys[layer][:, :, :end], atol=1e-5)


def test_compiled_layers_of_different_structure_each_run_their_own_graph():
    """Every decoder layer runs one compiled graph; a layer unlike the others (here its linears in int8, the rest
    float32) must get a graph of its own, not one traced for another layer's modules."""
    from specula.runtime.weights import quantize_every_linear

    model = tiny_model("llama", seed=2)
    quantize_every_linear(model.model.layers[1], "int8")
    eager, compiled = Target(model), Target(model)
    compiled.compile()
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(4))
    for target in (eager, compiled):
        target.prefill(prompt)
    for tokens in (torch.tensor([3]), torch.tensor([5, 8, 13])):
        outs = [target.forward(tokens).logits for target in (eager, compiled)]
        assert torch.allclose(outs[0], outs[1], atol=1e-5)
        for target in (eager, compiled):
            target.commit()


def test_a_warmed_up_compiled_target_compiles_nothing_while_it_decodes():
    """Bench and serve warm a compiled target up, so that no timed request pays for a compilation."""
    from torch._dynamo.utils import counters

    from specula.decoding import generate_tokens
    from specula.drafters.prompt_lookup import PromptLookupDrafter
    from specula.drafters.vanilla import VanillaDrafter
    from specula.sampling import SamplingParams

    target = Target(tiny_model("llama", seed=3))
    target.compile()
    counters.clear()
    target.warm_up(2)  # blocks of 1 and 2 tokens (a size an earlier test compiled for this shape is reused)
    warmed = counters["stats"]["unique_graphs"]
    assert target.length == 0
    prompt = torch.tensor([5, 9, 2, 7, 5, 9, 2, 7, 5, 9])
    sizes = []
    for drafter in (VanillaDrafter(), PromptLookupDrafter(num_tokens=1)):
        _, stats = generate_tokens(target, drafter, prompt, 12, SamplingParams(0.0), 0)
        sizes += stats.tree_sizes
    assert 0 in sizes and 1 in sizes  # both block sizes were verified ...
    assert counters["stats"]["unique_graphs"] == warmed  # ... by the graphs the warm-up left


def test_a_compiled_target_keeps_one_cache_shape_however_long_the_sequence_grows():
    """A compiled cache is allocated whole: a prompt past the first eager allocation meets no new graph (a cache
    that grew met a new shape, and every bucket compiled again in the middle of a long request)."""
    from torch._dynamo.utils import counters

    from specula.runtime.static_cache import SLOT_STEP

    target = Target(tiny_model("llama", seed=3, max_position_embeddings=8 * SLOT_STEP))
    target.compile()
    cache = target.runtime.cache
    assert cache.allocated == target.max_length + cache.padding == 8 * SLOT_STEP + 63  # 63: a block's padding
    counters.clear()
    target.warm_up(2)
    warmed = counters["stats"]["unique_graphs"]
    for prompt_length in (10, 5 * SLOT_STEP):
        target.reset()
        target.prefill(torch.randint(0, 97, (prompt_length,), generator=torch.Generator().manual_seed(1)))
        for block in (torch.tensor([3]), torch.tensor([5, 8])):
            target.forward(block)
            target.commit()
    assert target.length == 5 * SLOT_STEP + 3
    assert counters["stats"]["unique_graphs"] == warmed


def test_a_compiled_block_at_the_context_limit_stays_compiled_with_the_bits_of_one_token_steps():
    """13 tokens pad to 16 and a one-token step's token to 1: up to the last slot of the context every block runs
    compiled (its padding in slots past the capacity), so each row gets a compiled one-token step's bits (a block
    whose padding found no slot ran eager, and rounded otherwise)."""
    from specula.runtime.compiled_step import bucket
    from specula.runtime.invariance import mismatched_rows

    assert bucket(13, torch.device("cpu")) == 16
    target = Target.load(STORIES, dtype="float32", max_length=40)
    target.compile()
    target.prefill(torch.randint(3, 500, (27,), generator=torch.Generator().manual_seed(1)))
    block = torch.randint(3, 500, (13,), generator=torch.Generator().manual_seed(2))
    assert mismatched_rows(target, block) == []  # 27 + 13 = 40: the block ends at the last slot
    target.forward(block)
    target.commit()
    assert target.length == target.max_length == 40


def test_off_a_cpu_a_compiled_step_runs_every_block_at_one_shape():
    """On a GPU the kernels are chosen per shape, so a one-token step and a k-token verify pass share bits only at
    one shape (measured on an H200: `GPU_BLOCK_BUCKETS`); a CPU's row-invariant kernels take dense buckets."""
    from specula.runtime.compiled_step import bucket, warm_up_blocks

    assert {bucket(n, torch.device("cuda")) for n in range(1, 65)} == {64}
    assert warm_up_blocks(torch.device("cuda"), 16) == [16]  # a bench's warm-up compiles that one shape
    assert bucket(65, torch.device("cuda")) is None
    assert [bucket(n, torch.device("cpu")) for n in (1, 5, 13)] == [1, 5, 16]


def test_compiling_a_target_outside_the_llama_family_is_one_clear_error():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    target = Target(AutoModelForCausalLM.from_config(config).eval())
    with pytest.raises(SpeculaError, match="compiled step needs a Llama-family target"):
        target.compile()


def test_compiling_on_a_cpu_without_a_cpp_compiler_is_one_clear_error(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(SpeculaError, match="needs a C\\+\\+ compiler on PATH"):
        Target(tiny_model("llama")).compile()
