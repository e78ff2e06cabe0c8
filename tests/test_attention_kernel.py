"""The cached-attention kernel: softmax(scale q k^T) v over the visible cache slots, row by row."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specula.kernels import attention

needs_kernel = pytest.mark.skipif(attention.unavailable_reason() is not None,
                                  reason=f"attention kernel unavailable here: {attention.unavailable_reason()}")


def reference(q, keys, values, mask, end, scale):
    """SDPA in float64 over slots [0, end) (GQA: each kv head serves heads / kv_heads query heads)."""
    visible = None if mask is None else mask[..., :end]
    return F.scaled_dot_product_attention(q.double(), keys[:, :, :end].double(), values[:, :, :end].double(),
                                          attn_mask=visible, scale=scale, enable_gqa=True)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 32), (8, 8, 16), (6, 2, 72), (2, 1, 128)])
@pytest.mark.parametrize("end, rows", [(1, 1), (7, 1), (300, 1), (301, 2), (45, 3), (13, 4)])
def test_kernel_computes_attention_over_the_visible_slots(heads, kv_heads, head_dim, end, rows):
    torch.manual_seed(end * rows + head_dim)
    # q as the step makes it (heads transposed out of a [1, n, H, d] projection), a cache longer than end
    q = torch.randn(1, rows, heads, head_dim).transpose(1, 2)
    keys, values = torch.randn(1, kv_heads, 320, head_dim) * 2, torch.randn(1, kv_heads, 320, head_dim)
    mask = torch.rand(1, 1, rows, 320) < 0.7
    mask[..., 0] = True
    op = attention.load()
    for m in ([None] if rows == 1 else []) + [mask]:
        out = op(q, keys, values, m, torch.tensor(end), 0.3)
        assert out.shape == (1, heads, rows, head_dim) and out.is_contiguous()
        torch.testing.assert_close(out.double(), reference(q, keys, values, m, end, 0.3), atol=2e-6, rtol=2e-5)


@needs_kernel
def test_a_row_that_sees_one_slot_gets_that_slots_value_exactly():
    keys, values = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    mask = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    mask[..., 17] = True
    out = attention.load()(torch.randn(1, 4, 1, 64), keys, values, mask, torch.tensor(30), 0.125)
    assert torch.equal(out[0, :2, 0], values[0, 0, 17].expand(2, -1))
    assert torch.equal(out[0, 2:, 0], values[0, 1, 17].expand(2, -1))


@needs_kernel
def test_each_row_gets_the_same_bits_whatever_block_it_is_attended_in():
    """A compiled step pads a block and a batched step packs several: a row's attention must not depend on them."""
    torch.manual_seed(0)
    q = torch.randn(1, 9, 4, 64)
    keys, values = torch.randn(1, 3, 512, 64), torch.randn(1, 3, 512, 64)
    mask = torch.ones(1, 1, 4, 512, dtype=torch.bool).tril(diagonal=300)
    op = attention.load()
    block = op(q, keys, values, mask, torch.tensor(304), 0.125)
    for row in range(4):
        alone = op(q[:, :, row:row + 1].contiguous(), keys, values, mask[..., row:row + 1, :], torch.tensor(304),
                   0.125)
        assert torch.equal(alone[:, :, 0], block[:, :, row])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_tree_rows_bits_do_not_depend_on_its_block_nor_on_the_threads(threads):
    """The kernel attends the slots every row of a block sees (its common prefix) tile by tile for all of a kv
    head's queries at once, and the rest row by row; where that split falls must not change a row's bits."""
    torch.manual_seed(1)
    prefix, parents = 700, [-1, 0, 0, 1, 1, 2, 5, 3]
    rows = len(parents)
    q = torch.randn(1, 9, rows, 64)
    keys, values = torch.randn(1, 3, 800, 64) * 2, torch.randn(1, 3, 800, 64)
    mask = torch.zeros(1, 1, rows, 800, dtype=torch.bool)
    mask[..., :prefix] = True
    for row in range(rows):
        node = row
        while node >= 0:
            mask[0, 0, row, prefix + node] = True
            node = parents[node]
    op, before = attention.load(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [op(q[:, :, r:r + 1].contiguous(), keys, values, mask[..., r:r + 1, :], torch.tensor(prefix + rows),
                    0.125) for r in range(rows)]
        torch.set_num_threads(threads)
        block = op(q, keys, values, mask, torch.tensor(prefix + rows), 0.125)
    finally:
        torch.set_num_threads(before)
    for row in range(rows):
        assert torch.equal(alone[row][:, :, 0], block[:, :, row])


def test_the_variable_sends_attention_through_sdpa():
    """``SPECULA_ATTENTION_KERNEL=0`` (to compare the two): the process attends through SDPA."""
    code = "from specula.kernels import attention; print(attention.kernel())"
    env = dict(os.environ, **{attention.DISABLE_VARIABLE: "0"})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "None"
