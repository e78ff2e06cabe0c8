"""Weight formats of the target: quantized linears compute what their dequantized weights say, GGUF blocks carry
over as gguf dequantizes them, and every method decodes exactly what vanilla decodes with the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import LLAMA2XS, STORIES, STORY_PROMPTS, tiny_model, write_tiny_gguf

import specula
from specula.bench.agreement import argmax_agreement, find_divergence
from specula.cli import main
from specula.errors import SpeculaError
from specula.gguf.blocks import blocks_to_groups, llama_row_order
from specula.kernels import float32 as float32_kernel
from specula.kernels import q4_1
from specula.runtime.fused_linear import fuse_outputs
from specula.runtime.linear_gradient import dequantized_weight
from specula.runtime.plain_model import transformers_model
from specula.runtime.quantized_linear import (
    BFloat16Linear,
    Float32Linear,
    Int4Linear,
    Int8Linear,
    Q4_1Linear,
    int4_groups,
    int8_rows,
)
from specula.runtime.target import Target
from specula.runtime.weights import FLOAT32_LAYOUT_MIN_ELEMENTS, check_available, quantize_linear_weights

# q4_1 needs its kernel built (AVX2 and a C++ compiler); elsewhere its cases are skipped, saying why.
Q4_1 = pytest.param("q4_1", marks=pytest.mark.skipif(q4_1.unavailable_reason() is not None,
                                                     reason=f"q4_1: {q4_1.unavailable_reason()}"))
EAGLE_HEAD = Path(__file__).resolve().parent / "data" / "eagle-stories260k"
EAGLE3_HEAD = Path(__file__).resolve().parent / "data" / "eagle3-stories260k"
NEW_TOKENS = 48
Q = gguf.GGMLQuantizationType
# Shapes the kernels take as they are, and ones they need padded (N not a multiple of 16, K not of 32).
SHAPES = [(64, 64), (172, 64), (64, 172), (48, 96)]


COMPUTE = [torch.float32, torch.bfloat16]


def kernel_bound(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's precision for x @ weight.T, per output, relative to sum |x| |w|: float32 accumulation (a few
    ulp); in bfloat16 also one rounding of each dequantized weight and of the output (unit roundoff 2^-8 each)."""
    relative = 1e-5 if dtype == torch.float32 else 2.0**-7
    return relative * (x.abs().double() @ weight.abs().double().t()) + 1e-6


def kernel_input(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the kernel sees it (cast to its compute dtype), in float64."""
    return x.to(dtype).double()


# ---------------------------------------------------------------- the quantized linears


@pytest.mark.parametrize("dtype", COMPUTE)
@pytest.mark.parametrize("shape", SHAPES + [(17, 33)])
def test_int8_linear_equals_dequantize_then_matmul(shape, dtype):
    torch.manual_seed(0)
    n, k = shape
    linear = torch.nn.Linear(k, n)
    module = Int8Linear.from_linear(linear, dtype)
    q, scale = int8_rows(linear.weight)
    assert (q.double() * scale.double()[:, None] - linear.weight.double()).abs().max() <= scale.max() / 2 + 1e-7
    weight = q.double() * scale.to(dtype).double()[:, None]  # the scales are stored in the compute dtype
    x = torch.randn(3, 5, k)
    reference = kernel_input(x, dtype) @ weight.t() + linear.bias.double()
    assert module(x).shape == (3, 5, n) and module(x).dtype == torch.float32
    assert ((module(x).double() - reference).abs() <= kernel_bound(x, weight, dtype)).all()


@pytest.mark.parametrize("dtype", COMPUTE)
@pytest.mark.parametrize("shape", SHAPES + [(17, 33)])
def test_int4_linear_equals_dequantize_then_matmul(shape, dtype):
    torch.manual_seed(1)
    n, k = shape
    linear = torch.nn.Linear(k, n)
    groups = int4_groups(linear.weight)
    module = Int4Linear(groups, linear.bias, dtype, "cpu")
    q = groups.q.double()[:, :k]
    scale = groups.scale.to(dtype).double().repeat_interleave(32, dim=1)[:, :k]
    zero = groups.zero.to(dtype).double().repeat_interleave(32, dim=1)[:, :k]
    weight = (q - 8) * scale + zero
    x = torch.randn(3, 5, k)
    reference = kernel_input(x, dtype) @ weight.t() + linear.bias.double()
    assert module(x).shape == (3, 5, n) and module(x).dtype == torch.float32
    assert ((module(x).double() - reference).abs() <= kernel_bound(x, weight, dtype)).all()
    exact = groups.dequantize().double()
    assert (exact - linear.weight.double()).abs().le(groups.scale.double().repeat_interleave(32, 1)[:, :k] / 2
                                                     + 1e-6).all()  # half a step per group


def test_int4_groups_reproduce_a_weight_already_on_their_grid():
    """Requantizing int4-representable weights (a Q4_1 file dequantized) gives the same weights back."""
    torch.manual_seed(2)
    q = torch.randint(0, 16, (32, 64))
    q[:, ::32], q[:, 1::32] = 0, 15  # every group spans the full code range, as min/max quantization makes it
    d, m = torch.rand(32, 2) * 0.01 + 0.001, torch.randn(32, 2) * 0.05
    weight = q * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    assert torch.allclose(int4_groups(weight).dequantize(), weight, rtol=0, atol=1e-6)


def test_bfloat16_linear_is_a_bfloat16_matmul():
    torch.manual_seed(3)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(4, 64)
    expected = torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()).float()
    assert torch.equal(BFloat16Linear(linear)(x), expected)


@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_float32_linear_is_the_float32_matmul_on_the_same_parameters(rows):
    """float32 weights on a CPU get Float32Linear's faster matmul layout: the same weights (shared, not copied)
    and the same product up to float32 summation order, for one row (a decoding step) or several."""
    torch.manual_seed(6)
    linear = torch.nn.Linear(96, 48)
    module = Float32Linear.sharing(linear)
    assert module.weight is linear.weight and module.bias is linear.bias
    x = torch.randn(2, rows, 96)
    reference = x.double() @ linear.weight.double().t() + linear.bias.double()
    out = module(x)
    assert out.shape == (2, rows, 48) and out.dtype == torch.float32 and out.is_contiguous()
    assert ((out.double() - reference).abs() <= kernel_bound(x, linear.weight, torch.float32)).all()



@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4", Q4_1])
def test_every_format_passes_its_input_the_gradient_of_the_weight_it_applies(fmt):
    """A trainer differentiating through a frozen target's layer (Medusa heads sharing a q4_1 LM head) gets
    d(loss)/dx = grad @ W, W what the layer applies; a kernel without a backward once gave no gradient at all,
    and the heads trained nothing. The weight stays frozen. A shape every kernel pads (N 44, K 72), and a bias."""
    (layer,) = _linears(fmt, [44], width=72, bias=True)
    x = torch.randn(2, 3, 72, requires_grad=True)
    upstream = torch.randn(2, 3, 44)
    (layer(x) * upstream).sum().backward()
    applied = dequantized_weight(layer).double()
    expected = upstream.double() @ applied
    assert x.grad is not None and x.grad.shape == x.shape
    tolerance = 1e-5 if fmt == "float32" else 2.0**-7
    assert ((x.grad.double() - expected).abs() <= tolerance * (upstream.double().abs() @ applied.abs()) + 1e-6).all()
    assert not any(t.requires_grad or t.grad is not None for t in (*layer.parameters(), *layer.buffers()))

def test_float32_target_keeps_its_tied_lm_head_tied_and_small_layers_plain(monkeypatch):
    """Swapping in Float32Linear keeps every parameter: a tied LM head still is the embedding. Layers small
    enough to stay in cache keep `F.linear`, which is faster for them (without the row-invariant kernel, which
    takes every float32 linear: tests/test_row_invariance.py)."""
    monkeypatch.setattr(float32_kernel, "_kernel", None)
    monkeypatch.setenv("SPECULA_FLOAT32_LAYOUT", "columns")  # where the machine's measurement chose it
    model = tiny_model("llama", tie_word_embeddings=True, vocab_size=FLOAT32_LAYOUT_MIN_ELEMENTS // 64)
    quantize_linear_weights(model, "float32", lm_head=True)
    assert isinstance(model.lm_head, Float32Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # 64 x 64


# ---------------------------------------------------------------- GGUF blocks


def _linears(fmt: str, rows: list[int], width: int = 64, bias: bool = False) -> list[torch.nn.Module]:
    torch.manual_seed(1)
    plain = [torch.nn.Linear(width, n, bias=bias).requires_grad_(False) for n in rows]
    convert = {"float32": Float32Linear.sharing, "bfloat16": BFloat16Linear, "int8": Int8Linear.from_linear,
               "int4": Int4Linear.from_linear, "q4_1": Q4_1Linear.from_linear}[fmt]
    return [convert(m) for m in plain]


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4", Q4_1])
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_fused_projections_equal_the_separate_ones_bit_for_bit(fmt, tokens):
    """Stacked q/k/v-like linears give exactly the parts' outputs, and the parts still give them after, from
    views of the stacked weight (no second copy). Parts of 64 rows: every kernel's layout stacks those."""
    parts = _linears(fmt, [128, 64, 64], bias=fmt == "int8")
    x = torch.randn(tokens, 64)
    before = [part(x) for part in parts]
    fused = fuse_outputs(parts)
    assert torch.equal(fused(x), torch.cat(before, dim=-1))
    assert all(torch.equal(part(x), out) for part, out in zip(parts, before, strict=True))
    # the weight (the largest tensor, whatever its layout) of the first part starts the stack
    stacked = max((*fused.parameters(), *fused.buffers()), key=torch.Tensor.numel)
    first = max((*parts[0].parameters(), *parts[0].buffers()), key=torch.Tensor.numel)
    assert first.data_ptr() == stacked.data_ptr() and stacked.numel() == 2 * first.numel()


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4", Q4_1])
def test_parts_are_fused_only_where_the_kernel_gives_their_bits(fmt):
    """Parts of 32 rows: torch's int4 CPU packing interleaves 64 rows on an AVX-512 CPU, so there they must
    stay apart, untouched; wherever they are fused, the fused layer gives the parts' outputs bit for bit."""
    parts = _linears(fmt, [64, 32, 32], bias=fmt == "int8")
    x = torch.randn(5, 64)
    before = [part(x) for part in parts]
    tensors = [[t.data_ptr() for t in (*part.parameters(), *part.buffers())] for part in parts]
    fused = fuse_outputs(parts)
    if fused is None:
        assert [[t.data_ptr() for t in (*part.parameters(), *part.buffers())] for part in parts] == tensors
    else:
        assert torch.equal(fused(x), torch.cat(before, dim=-1))
    assert all(torch.equal(part(x), out) for part, out in zip(parts, before, strict=True))


def test_linears_that_cannot_be_stacked_are_left_alone():
    assert fuse_outputs(_linears("int4", [64, 24])) is None  # the int4 kernel pads 24 rows to 32
    assert fuse_outputs([*_linears("int8", [32]), *_linears("int4", [32])]) is None
    assert fuse_outputs([*_linears("float32", [32], bias=True), *_linears("float32", [32])]) is None


def test_a_target_requantized_after_loading_decodes_with_its_new_weights():
    """The stacked projections follow the layers' linears: replaced linears are stacked again, never stale."""
    model = tiny_model("llama")
    target = Target(model)
    tokens = torch.tensor([5, 9, 2, 7])
    float_logits = target.prefill(tokens).logits
    quantize_linear_weights(model, "int4")
    int4_logits = target.prefill(tokens).logits
    assert not torch.equal(int4_logits, float_logits)
    assert torch.equal(int4_logits, Target(model).prefill(tokens).logits)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_tensor_carried_dequantizes_like_gguf(kind):
    values = (np.random.default_rng(4).standard_normal((48, 96)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(values, Q[kind])
    expected = torch.from_numpy(gguf.quants.dequantize(raw, Q[kind])).double()
    groups = blocks_to_groups(raw, kind, values.shape)
    tolerance = 1e-6 * float(expected.abs().max())  # the Q4_1 zero m + 8d is rounded once to float32
    assert (groups.dequantize().double() - expected).abs().max() <= tolerance
    # ... and the kernel, fed those groups, applies that same weight: in float32 to float32 precision,
    applied = dequantized_weight(Int4Linear(groups, None, torch.float32, "cpu")).double()
    assert (applied - expected).abs().max() <= tolerance
    if kind == "Q4_0":
        assert torch.equal(applied, expected)  # no rounding at all: zero is 0, scale is d
    # in bfloat16 within the roundings of scale, zero and the weight itself: (8 |d| + |zero| + |w|) 2^-8.
    applied = dequantized_weight(Int4Linear(groups, None, torch.bfloat16, "cpu")).double()
    scale = groups.scale.double().repeat_interleave(32, 1)
    zero = groups.zero.double().repeat_interleave(32, 1)
    bound = 2.0**-8 * (8 * scale.abs() + zero.abs() + expected.abs()) + 1e-7  # Q4_0 scales can be negative
    assert ((applied - expected).abs() <= bound).all()


@pytest.mark.parametrize("dtype", COMPUTE)
def test_gguf_q8_0_tensor_in_int8_is_within_half_a_row_step(dtype):
    """The int8 kernel has one scale per row, Q8_0 one per 32 weights: within half a step of the row's scale
    (in bfloat16 plus the roundings of that scale and of the weight, 2^-8 of |w| each)."""
    values = (np.random.default_rng(5).standard_normal((48, 96)) * 0.1).astype(np.float32)
    expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(values, Q.Q8_0), Q.Q8_0)).double()
    linear = torch.nn.Linear(96, 48, bias=False)
    linear.weight.data.copy_(expected)
    module = Int8Linear.from_linear(linear, dtype)
    step = module.scales.double()[:, None]
    rounding = 0 if dtype == torch.float32 else 2.0**-7 * expected.abs()
    assert ((dequantized_weight(module).double() - expected).abs() <= step / 2 + rounding + 1e-7).all()


def test_llama_row_order_undoes_llama_cpp_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(48, dtype=np.float32)[:, None]
    expected = LlamaTensorProcessor()._reverse_permute_weights(rows, 3, 3)[:, 0]
    assert llama_row_order(48, 3).tolist() == expected.astype(int).tolist()


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory) -> Path:
    """A tiny Llama GGUF whose linears are Q4_1 blocks (attn_v Q4_0, output Q4_1, embedding Q8_0)."""
    kinds = {name: Q.Q4_1 for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    kinds.update(attn_v=Q.Q4_0, output=Q.Q4_1, token_embd=Q.Q8_0)
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4.gguf", quantize=kinds)


def test_int4_target_from_a_gguf_carries_its_blocks(quantized_gguf):
    """Every Q4 linear of the file becomes int4 groups that apply the file's own weights (q/k rows reordered)."""
    reader = gguf.GGUFReader(str(quantized_gguf))
    file_weights = {t.name: torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    report = Target.load(quantized_gguf, weights="int4").weights_report
    assert len(report.carried) == 15 and not report.requantized  # 14 decoder linears and the (tied) LM head
    assert report.carried["lm_head"] == "Q4_1"
    assert report.carried["model.layers.0.self_attn.v_proj"] == "Q4_0"
    # Computed in float32, the kernel applies the file's weights to float32 precision.
    target = Target.load(quantized_gguf, weights="float32")
    quantize_linear_weights(target.model, "int4", gguf_file=quantized_gguf, compute_dtype=torch.float32)
    config = target.config
    for i in range(2):
        for name, module, heads in [("attn_q", "self_attn.q_proj", config.num_attention_heads),
                                    ("attn_k", "self_attn.k_proj", config.num_key_value_heads),
                                    ("attn_v", "self_attn.v_proj", None), ("ffn_down", "mlp.down_proj", None)]:
            expected = file_weights[f"blk.{i}.{name}.weight"]
            if heads:
                expected = expected[llama_row_order(expected.shape[0], heads)]
            applied = dequantized_weight(target.model.get_submodule(f"model.layers.{i}.{module}"))
            assert (applied - expected).abs().max() <= 1e-6 * expected.abs().max(), name


@pytest.mark.skipif(q4_1.unavailable_reason() is not None, reason="q4_1 kernel unavailable here")
def test_q4_1_target_from_a_gguf_carries_its_blocks(quantized_gguf):
    """q4_1 takes the file's blocks like int4 does, and its kernel applies the file's weights."""
    reader = gguf.GGUFReader(str(quantized_gguf))
    file_weights = {t.name: torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    target = Target.load(quantized_gguf, weights="q4_1")
    assert len(target.weights_report.carried) == 15 and not target.weights_report.requantized
    for name, module in [("attn_v", "self_attn.v_proj"), ("ffn_down", "mlp.down_proj")]:
        expected = file_weights[f"blk.1.{name}.weight"]
        applied = dequantized_weight(target.model.get_submodule(f"model.layers.1.{module}"))
        # An input row of the identity is one code of 127 with scale 1/127: exact to a float32 rounding or two.
        assert (applied - expected).abs().max() <= 1e-6 * expected.abs().max(), name


def test_gguf_blocks_can_be_left_out_and_the_lm_head_carried(quantized_gguf):
    requantized = Target.load(quantized_gguf, weights="int4", gguf_blocks=False).weights_report
    assert not requantized.carried and len(requantized.requantized) == 15
    model = Target.load(quantized_gguf, weights="float32").model
    report = quantize_linear_weights(model, "int4", lm_head=True, gguf_file=quantized_gguf)
    assert report.carried["lm_head"] == "Q4_1" and len(report.carried) == 15
    assert Target(model).vocab_size == 128  # read from the quantized head


# ---------------------------------------------------------------- formats on a target


def test_unknown_format_is_refused_before_loading():
    with pytest.raises(SpeculaError, match="unknown weights format 'int3'"):
        specula.load("no/such/model", weights="int3")


def test_a_loaded_target_keeps_its_format(int4_stories):
    with pytest.raises(SpeculaError, match="loaded with int4 weights"):
        specula.load(int4_stories.target, weights="int8")
    assert specula.load(int4_stories.target, method="pld").target.weights == "int4"  # auto keeps it


def test_a_device_without_the_kernel_is_one_clear_error(monkeypatch):
    def missing(*args):
        raise NotImplementedError("Could not run '_weight_int8pack_mm' with arguments from the 'CPU' backend")

    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", missing)
    with pytest.raises(SpeculaError, match="int8 weights are not available on device 'cpu'"):
        check_available("int8", "cpu")


def test_formats_change_only_the_decoder_linears():
    model = tiny_model("llama")
    report = quantize_linear_weights(model, "int8")
    assert len(report.converted) == 3 * 7 and report.bytes_after < report.bytes_before / 3
    assert isinstance(model.model.layers[2].mlp.down_proj, Int8Linear)
    assert isinstance(model.lm_head, torch.nn.Linear) and model.model.embed_tokens.weight.dtype == torch.float32


# ---------------------------------------------------------------- greedy equality with the same weights


@pytest.fixture(scope="module", params=["int8", "int4", Q4_1])
def quantized_stories(request, single_thread):
    """(format, vanilla speculator on stories260k in that format, its outputs per story prompt)."""
    vanilla = specula.load(STORIES, weights=request.param, dtype="float32")
    outputs = [vanilla.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids for prompt in STORY_PROMPTS]
    return request.param, vanilla, outputs


@pytest.fixture(scope="module")
def int4_stories():
    return specula.load(STORIES, weights="int4", dtype="float32")


def assert_equal_or_near_ties(vanilla, outputs, decode) -> None:
    """Every prompt's output equals vanilla's, or first differs at a floating-point near-tie (each is printed)."""
    for prompt, expected in zip(STORY_PROMPTS, outputs, strict=True):
        got = decode(prompt)
        divergence = find_divergence(vanilla.target, vanilla.encode(prompt), expected, got)
        if divergence is not None:
            print(f"{prompt!r}: {divergence.describe()}")
        assert divergence is None or divergence.near_tie, f"{prompt!r}: {divergence.describe()}"


def test_vanilla_equals_transformers_generate_with_the_same_weights(quantized_stories):
    fmt, vanilla, outputs = quantized_stories
    model = transformers_model(vanilla.target.model)  # its linears are the quantized modules: generate() runs them

    def hf_generate(prompt):
        ids = vanilla.encode(prompt)[None]
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()

    assert isinstance(model.model.layers[0].self_attn.q_proj,
                      {"int8": Int8Linear, "int4": Int4Linear, "q4_1": Q4_1Linear}[fmt])
    assert_equal_or_near_ties(vanilla, outputs, hf_generate)


@pytest.mark.parametrize("method, options", [("pld", {"num_tokens": 8}), ("sps", {"draft": LLAMA2XS}),
                                             ("eagle2", {"draft": EAGLE_HEAD}), ("eagle3", {"draft": EAGLE3_HEAD})])
def test_every_method_decodes_what_vanilla_decodes_with_the_same_weights(quantized_stories, method, options):
    fmt, vanilla, outputs = quantized_stories
    speculator = specula.load(vanilla.target, method=method, **options)
    accepted = []

    def decode(prompt):
        result = speculator.generate(prompt, max_new_tokens=NEW_TOKENS)
        accepted.append(sum(result.stats.accepted_lengths))
        return result.token_ids

    assert_equal_or_near_ties(vanilla, outputs, decode)
    assert sum(accepted) > 0, f"{method} never accepted a draft token in {fmt}, so the test proved nothing"


@pytest.mark.parametrize("method, head", [("eagle2", EAGLE_HEAD), ("eagle3", EAGLE3_HEAD),
                                          ("medusa", Path(__file__).resolve().parents[1] / "specula" /
                                           "heads" / "bundled" / "medusa-stories260k")])
def test_a_draft_head_drafts_in_the_targets_weight_format(int4_stories, method, head):
    drafter = specula.load(int4_stories.target, method=method, draft=head).drafter
    module = drafter.heads if method == "medusa" else drafter.head_drafter.head
    linears = [m for m in module.modules() if isinstance(m, (torch.nn.Linear, Int4Linear))]
    assert linears and all(isinstance(m, Int4Linear) for m in linears)


def test_sps_drafts_with_the_target_itself_in_a_cheaper_format():
    """--draft-weights: the float32 target drafted for by its own int8 copy still decodes exactly what it does alone."""
    vanilla = specula.load(STORIES, weights="float32", dtype="float32")
    speculator = specula.load(vanilla.target, method="sps", draft=STORIES, draft_weights="int8", num_tokens=4,
                              draft_budget="off")  # the draft costs what the target does: a budget stops drafting
    assert isinstance(speculator.drafter.draft.model.model.layers[0].self_attn.q_proj, Int8Linear)
    for prompt in STORY_PROMPTS:
        result = speculator.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == vanilla.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids
        assert sum(result.stats.accepted_lengths) > 0


def test_a_bad_draft_weights_value_is_refused_before_loading():
    with pytest.raises(SpeculaError, match="--draft-weights"):
        specula.load(STORIES, method="sps", draft=STORIES, draft_weights="q5")


def test_divergence_helper_tells_near_ties_from_real_differences():
    model = tiny_model("llama", seed=4)
    target = Target(model)
    prompt = torch.tensor([5, 17, 3, 42])
    context = prompt.clone()
    expected = []
    for _ in range(6):
        token = int(target.prefill(context).logits[-1].argmax())
        expected.append(token)
        context = torch.cat([context, torch.tensor([token])])
    assert find_divergence(target, prompt, expected, list(expected)) is None
    # The least likely token at step 3 is far from a tie.
    logits = target.prefill(torch.cat([prompt, torch.tensor(expected[:3])])).logits[-1]
    wrong = expected[:3] + [int(logits.argmin())] + expected[4:]
    real = find_divergence(target, prompt, expected, wrong)
    assert real.position == 3 and real.margin > 0.1 and not real.near_tie
    assert "NOT a near-tie" in real.describe()
    # A token whose output row equals the chosen one's ties it exactly.
    twin = (expected[3] + 1) % model.config.vocab_size
    model.lm_head.weight.data[twin] = model.lm_head.weight.data[expected[3]]
    tie = find_divergence(target, prompt, expected, expected[:3] + [twin] + expected[4:])
    assert tie.near_tie and tie.margin == 0


def test_argmax_agreement_counts_positions_and_reference_margins():
    reference = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.9], [0.0, 0.0, 5.0]])
    other = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 1.5], [0.0, 6.0, 5.0]])
    agreement = argmax_agreement(reference, other)
    assert (agreement.positions, agreement.agreeing) == (3, 1)
    assert agreement.near_ties(0.5) == 1 and agreement.near_ties(10) == 2


# ---------------------------------------------------------------- command line


def generate(capfd, *args) -> tuple[int, str, str]:
    code = main(["generate", *(str(a) for a in args)])
    out, err = capfd.readouterr()
    return code, out, err


def test_generate_runs_with_int4_weights(capfd):
    code, out, err = generate(capfd, "--target", STORIES, "--prompt", "Once upon a time", "--max-new-tokens", 8,
                              "--weights", "int4", "--raw", "--json")
    assert code == 0, err
    expected = specula.load(STORIES, weights="int4").generate("Once upon a time", max_new_tokens=8, raw=True)
    assert json.loads(out)["token_ids"] == expected.token_ids


def test_a_bad_weights_value_is_one_error_line(capfd):
    code, out, err = generate(capfd, "--target", STORIES, "--prompt", "hi", "--weights", "int3")
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("specula: error: ") and "--weights" in err, err


@pytest.mark.parametrize("fmt, module", [("int8", Int8Linear), ("int4", Int4Linear),
                                         pytest.param("q4_1", Q4_1Linear, marks=Q4_1.marks)])
def test_a_loaded_target_has_its_lm_head_in_the_format_and_its_embedding_float(fmt, module):
    """The LM head is the largest matrix read per token (a third of an int4 step on SmolLM2)."""
    target = specula.load(STORIES, weights=fmt, dtype="float32").target
    assert isinstance(target.model.lm_head, module) and target.weights_report.converted[-1] == "lm_head"
    assert target.model.model.embed_tokens.weight.dtype == torch.float32
