"""A quantized target keeps a GGUF file's Q8_0 embedding as its blocks — rows bit for bit those of the dequantized
file — and converts large weights a chunk of rows at a time into the very tensors converting them whole gives."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import write_tiny_gguf
from gguf import GGMLQuantizationType as Q

from specula.gguf.block_embedding import Q8_0Embedding
from specula.kernels import q4_1
from specula.runtime import quantized_linear
from specula.runtime.quantized_linear import Int4Linear, int4_groups
from specula.runtime.target import Target

Q4_1_READY = pytest.mark.skipif(q4_1.unavailable_reason() is not None, reason=f"q4_1: {q4_1.unavailable_reason()}")


def q8_0_table(rows: int = 300, width: int = 96, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    values = (np.random.default_rng(seed).standard_normal((rows, width)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(values, Q.Q8_0)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, Q.Q8_0))


def test_rows_looked_up_from_q8_0_blocks_are_ggufs_dequantized_rows_bit_for_bit():
    raw, expected = q8_0_table()
    embedding = Q8_0Embedding.from_blocks(raw, tuple(expected.shape))
    ids = torch.tensor([[0, 5, 299], [17, 17, 3]])
    assert torch.equal(embedding(ids), expected[ids])
    assert torch.equal(embedding.weight, expected) and torch.equal(embedding.rows(10, 20), expected[10:20])
    assert embedding.equals_rows(lambda start, stop: expected[start:stop])
    changed = expected.clone()
    changed[250, 7] = torch.nextafter(changed[250, 7], torch.tensor(1.0))  # one ulp in one row is noticed
    assert not embedding.equals_rows(lambda start, stop: changed[start:stop])


def test_casting_the_model_does_not_round_the_block_scales():
    raw, expected = q8_0_table()
    embedding = Q8_0Embedding.from_blocks(raw, tuple(expected.shape)).to(torch.bfloat16)
    assert torch.equal(embedding(torch.arange(300)), expected)  # float16 scales kept as they are in the file


@pytest.fixture(scope="module")
def q8_embedding_gguf(tmp_path_factory):
    """A tiny tied Llama GGUF (no output tensor) whose embedding is Q8_0 and linears Q4_1."""
    kinds = {name: Q.Q4_1 for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    kinds["token_embd"] = Q.Q8_0
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q8-embedding.gguf", quantize=kinds, tied=True)


@pytest.mark.parametrize("fmt", ["int4", "int8", "bfloat16", pytest.param("q4_1", marks=Q4_1_READY)])
def test_a_quantized_target_keeps_the_q8_0_embedding_as_blocks_and_decodes_as_before(q8_embedding_gguf, fmt):
    blocks = Target.load(q8_embedding_gguf, weights=fmt)
    floats = Target.load(q8_embedding_gguf, weights=fmt, gguf_blocks=False)  # the embedding as a float table
    assert isinstance(blocks.model.get_input_embeddings(), Q8_0Embedding)
    assert blocks.weights_report.embedding == "Q8_0" and "Q8_0 blocks" in blocks.weights_report.summary()
    assert not isinstance(floats.model.get_input_embeddings(), Q8_0Embedding)
    # The hidden states and KV cache stay float32 though the first parameter may now be a bfloat16 linear's.
    assert blocks.dtype == floats.dtype == torch.float32 and blocks.runtime.cache.keys[0].dtype == torch.float32
    ids = torch.arange(floats.vocab_size)
    assert torch.equal(blocks.model.get_input_embeddings()(ids), floats.model.get_input_embeddings()(ids))
    prompt = torch.tensor([1, 7, 9, 4, 12])
    assert torch.equal(blocks.prefill(prompt).logits, floats.prefill(prompt).logits)  # tied head: same too


def test_the_float32_target_keeps_its_embedding_float_for_the_tied_head(q8_embedding_gguf):
    model = Target.load(q8_embedding_gguf, weights="float32").model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_int4_groups_and_packing_by_row_chunks_equal_converting_whole(monkeypatch):
    weight = torch.randn(200, 64) * 0.1
    whole = Int4Linear(int4_groups(weight), None, torch.bfloat16)
    monkeypatch.setattr(quantized_linear, "ROW_CHUNK", 64)  # four chunks, the last one partial
    chunked = Int4Linear(int4_groups(weight), None, torch.bfloat16)
    assert torch.equal(whole.packed, chunked.packed) and torch.equal(whole.scale_and_zero, chunked.scale_and_zero)


@Q4_1_READY
def test_q4_1_packing_by_groups_equals_packing_whole(monkeypatch):
    groups = int4_groups(torch.randn(203, 64) * 0.1)  # a partial last group of outputs
    minimum = groups.zero - 8 * groups.scale
    whole = q4_1.pack(groups.q, groups.scale, minimum)
    monkeypatch.setattr(q4_1, "PACK_GROUPS", 3)
    chunked = q4_1.pack(groups.q, groups.scale, minimum)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(whole, chunked, strict=True))


def test_a_compiled_lookup_gives_the_same_rows():
    """The compiled decode step traces the lookup (scale bits viewed as float16) into its graph."""
    raw, expected = q8_0_table(rows=64, width=64)
    embedding = Q8_0Embedding.from_blocks(raw, tuple(expected.shape))
    ids = torch.tensor([[3, 9, 63]])
    assert torch.equal(torch.compile(embedding, fullgraph=True)(ids), expected[ids])
