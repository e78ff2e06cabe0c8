"""A k-token verify pass gives every row the bits of k one-token steps over the same tokens (issue 39).

Row by row with `torch.equal`, never `allclose`: a chain and a tree (ancestor mask) after a prompt, per weight
format, on stories260k (k = 1..16 and up to 64) and SmolLM2 (the default model), and the ops that make it so:
the attention kernel over compacted visible keys, the float32 linear kernel, the row-wise activation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import STORIES, STORY_PROMPTS, tiny_model

from specula.kernels import attention, q4_1
from specula.kernels import float32 as float32_kernel
from specula.runtime.forward import FeatureRequest
from specula.runtime.invariance import block_paths, mismatched_blocks, mismatched_rows, tree_block
from specula.runtime.packed import Block, forward_packed
from specula.runtime.quantized_linear import Float32Linear
from specula.runtime.static_cache import rowwise
from specula.runtime.target import Target
from specula.runtime.weights import quantize_linear_weights

FORMATS = ["float32", "bfloat16", "int8", "int4", "q4_1"]
needs_attention = pytest.mark.skipif(attention.unavailable_reason() is not None,
                                     reason=f"attention kernel unavailable: {attention.unavailable_reason()}")


def format_param(fmt: str):
    reason = q4_1.unavailable_reason() if fmt == "q4_1" else None
    return pytest.param(fmt, marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


# A 9-node tree: the root, three children, grandchildren under two of them, one great-grandchild.
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 3]


def check_target(target: Target, ks: list[int], seed: int = 0) -> dict[str, list[int]]:
    """{block: mismatched rows} for chains of each k and the tree, after a 37-token prompt."""
    return mismatched_blocks(target, ks, TREE_PARENTS, seed)


def test_block_paths_are_each_rows_ancestors_then_itself():
    mask, _ = tree_block(TREE_PARENTS)
    assert block_paths(3, None) == [[0], [0, 1], [0, 1, 2]]
    assert block_paths(9, mask)[7] == [0, 1, 4, 7] and block_paths(9, mask)[8] == [0, 3, 8]


@needs_attention
@pytest.mark.parametrize("fmt", [format_param(f) for f in FORMATS])
def test_stories_verify_rows_equal_one_token_steps(fmt):
    target = Target.load(STORIES, dtype="float32", weights=fmt)
    assert check_target(target, list(range(1, 17)) + [24, 33, 48, 64]) == {}


@needs_attention
@pytest.mark.parametrize("fmt", [format_param(f) for f in ("float32", "q4_1")])
def test_compiled_verify_rows_equal_compiled_one_token_steps(fmt):
    """--compile: every block size (bucket) gives each row the bits of the compiled one-token step."""
    target = Target.load(STORIES, dtype="float32", weights=fmt)
    target.compile()
    assert check_target(target, [1, 2, 3, 4, 5, 8, 11, 16, 24, 33, 48, 64]) == {}


@needs_attention
@pytest.mark.parametrize("fmt", [format_param(f) for f in ("float32", "int4")])
def test_eager_blocks_padded_as_off_a_cpu_keep_every_row_and_every_answer(fmt, monkeypatch):
    """Off a CPU an eager block runs padded to the compiled step's shape (`pads_eager_blocks`); here that path runs
    on the CPU: each row still gets the bits of its one-token steps, and speculative greedy output is vanilla's."""
    import specula
    import specula.runtime.forward as forward

    monkeypatch.setattr(forward, "pads_eager_blocks", lambda device: True)
    target = Target.load(STORIES, dtype="float32", weights=fmt)
    assert target.runtime.padded is not None and not target.compiled
    assert check_target(target, [1, 2, 3, 5, 11, 16, 64]) == {}
    head = Path(__file__).parent / "data" / "eagle3-stories260k"
    answers = {method: specula.load(STORIES, method=method, draft=draft, dtype="float32", weights=fmt)
               .generate(STORY_PROMPTS[0], max_new_tokens=40).token_ids
               for method, draft in (("vanilla", None), ("pld", None), ("eagle3", head))}
    assert answers["pld"] == answers["vanilla"] and answers["eagle3"] == answers["vanilla"]


@needs_attention
@pytest.mark.parametrize("fmt", [format_param(f) for f in ("float32", "q4_1")])
def test_a_packed_sequences_rows_equal_its_block_alone_and_its_one_token_steps(fmt):
    """The server's packed step: a sequence's rows must not depend on which other sequences share the step."""
    base = Target.load(STORIES, dtype="float32", weights=fmt)
    generator = torch.Generator().manual_seed(1)
    counts = [1, 64, 4, 16, 5]
    targets = [base.fork() for _ in counts]
    for i, target in enumerate(targets):
        target.prefill(torch.randint(3, base.vocab_size, (20 + 13 * i,), generator=generator))
    blocks = [Block(torch.randint(3, base.vocab_size, (n,), generator=generator), None, None, FeatureRequest())
              for n in counts]
    packed = forward_packed(targets, blocks)
    for target, block, out in zip(targets, blocks, packed, strict=True):
        target.commit([])
        alone = block.run(target).logits
        target.commit([])
        assert torch.equal(alone, out.logits)
        assert mismatched_rows(target, block.tokens) == []


@needs_attention
def test_a_packed_step_of_chains_a_tree_and_a_new_prompt_gives_each_its_rows_alone():
    """Chains go through one packed attention call, the tree and the prompt one call each: every sequence's rows
    and the keys it leaves in its cache must be those of its block run alone."""
    base = Target.load(STORIES, dtype="float32", weights="q4_1")
    generator = torch.Generator().manual_seed(2)
    mask, depths = tree_block(TREE_PARENTS)
    plans = [(17, 1, None, None), (0, 6, None, None), (30, len(TREE_PARENTS), mask, depths), (9, 3, None, None)]
    targets = [base.fork() for _ in plans]
    blocks = []
    for target, (prefix, n, block_mask, block_depths) in zip(targets, plans, strict=True):
        if prefix:
            target.prefill(torch.randint(3, base.vocab_size, (prefix,), generator=generator))
        blocks.append(Block(torch.randint(3, base.vocab_size, (n,), generator=generator), block_mask, block_depths,
                            FeatureRequest(final_hidden=True)))
    packed = forward_packed(targets, blocks)
    for target, block, out in zip(targets, blocks, packed, strict=True):
        target.commit()
        cache = target.runtime.cache
        keys = [k[:, :, :cache.length].clone() for k in cache.keys]
        target.runtime.cache.truncate(cache.length - len(block.tokens))
        alone = block.run(target)
        target.commit()
        assert torch.equal(alone.logits, out.logits) and torch.equal(alone.hidden, out.hidden)
        assert all(torch.equal(a, k[:, :, :cache.length]) for a, k in zip(keys, cache.keys, strict=True))


@pytest.fixture(scope="module")
def smollm2_path(smollm2):
    """The default model's converted directory (the smollm2 fixture converted it into this session's cache)."""
    from specula.methods import DEFAULT_TARGET

    return DEFAULT_TARGET


@needs_attention
@pytest.mark.parametrize("fmt", [format_param(f) for f in FORMATS])
def test_smollm2_verify_rows_equal_one_token_steps(smollm2_path, fmt):
    target = Target.load(smollm2_path, dtype="float32", weights=fmt)
    assert check_target(target, [1, 2, 3, 4, 5, 8, 11, 16, 64]) == {}


@needs_attention
@pytest.mark.parametrize("fmt", [format_param("q4_1")])
def test_smollm2_compiled_verify_rows_equal_compiled_one_token_steps(smollm2_path, fmt):
    """The default model in the fast path (q4_1, --compile): the block sizes the default methods verify."""
    target = Target.load(smollm2_path, dtype="float32", weights=fmt)
    target.compile()
    assert check_target(target, [1, 4, 11]) == {}


@needs_attention
def test_attention_of_a_row_depends_only_on_the_keys_it_sees_not_where_they_sit():
    """A tree row's ancestors sit anywhere in the block: its attention must equal the one-token step's, where the
    same keys sit side by side after the prefix, and must not depend on the rows or slots of the call."""
    torch.manual_seed(0)
    heads, kv_heads, d, prefix = 9, 3, 64, 45
    keys, values = torch.randn(1, kv_heads, 128, d), torch.randn(1, kv_heads, 128, d)
    q = torch.randn(1, heads, 6, d)
    visible = torch.zeros(1, 1, 6, 128, dtype=torch.bool)
    visible[..., :prefix] = True
    ancestors = [prefix + 1, prefix + 4, prefix + 5]  # a row seeing three scattered block slots
    visible[0, 0, 5, ancestors] = True
    visible[0, 0, :5, prefix:prefix + 3] = True  # other rows see other things
    block = attention.load()(q, keys, values, visible, torch.tensor(prefix + 6), 0.125)
    # the one-token step: the same keys packed after the prefix, no mask
    packed_keys, packed_values = keys.clone(), values.clone()
    packed_keys[:, :, prefix:prefix + 3], packed_values[:, :, prefix:prefix + 3] = keys[:, :, ancestors], \
        values[:, :, ancestors]
    step = attention.load()(q[:, :, 5:6].contiguous(), packed_keys, packed_values, None, torch.tensor(prefix + 3),
                            0.125)
    assert torch.equal(block[:, :, 5], step[:, :, 0])


@pytest.mark.skipif(float32_kernel.kernel() is None, reason="float32 kernel unavailable here")
@pytest.mark.parametrize("n, k", [(960, 576), (49, 172), (16, 8)])
def test_float32_kernel_rows_do_not_depend_on_the_call(n, k):
    torch.manual_seed(n)
    weight, x = torch.randn(n, k), torch.randn(64, k)
    op = float32_kernel.kernel()
    alone = torch.cat([op(x[i:i + 1], weight) for i in range(64)])
    for m in (2, 3, 4, 5, 7, 12, 33, 64):
        assert torch.equal(op(x[:m], weight), alone[:m])
    torch.testing.assert_close(alone.double(), x.double() @ weight.double().t(), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(float32_kernel.kernel() is None, reason="float32 kernel unavailable here")
def test_with_the_float32_kernel_every_float32_linear_goes_through_it():
    """Small layers too (no size threshold: a BLAS call for them would round rows by the call's row count), and a
    tied LM head stays the embedding."""
    model = tiny_model("llama", tie_word_embeddings=True)
    quantize_linear_weights(model, "float32", lm_head=True)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Float32Linear)  # 64 x 64
    assert isinstance(model.lm_head, Float32Linear) and model.lm_head.weight is model.model.embed_tokens.weight


def test_rowwise_activation_gives_each_row_the_bits_of_a_one_row_call():
    """torch's scalar tail of an elementwise loop rounds SiLU differently from its vector body."""
    torch.manual_seed(0)
    for width in (172, 1536):
        x = torch.randn(1, 64, width) * 4
        alone = torch.cat([rowwise(F.silu, x[:, i:i + 1]) for i in range(64)], dim=1)
        for rows in (2, 3, 7, 23, 64):
            assert torch.equal(rowwise(F.silu, x[:, :rows]), alone[:, :rows])
        assert torch.equal(rowwise(F.silu, x), F.silu(F.pad(x, (0, -width % 64)))[..., :width])
