"""The q4_1 kernel: llama.cpp's Q4_1 x Q8_1 arithmetic, row by row, whatever the number of rows."""

from __future__ import annotations

import pytest
import torch

from specula.errors import SpeculaError
from specula.kernels import q4_1
from specula.runtime.fused_linear import fuse_outputs
from specula.runtime.quantized_linear import Q4_1Linear, int4_groups
from specula.runtime.weights import check_available

needs_kernel = pytest.mark.skipif(q4_1.unavailable_reason() is not None,
                                  reason=f"q4_1 kernel unavailable here: {q4_1.unavailable_reason()}")


def reference(x: torch.Tensor, module: Q4_1Linear) -> torch.Tensor:
    """The documented arithmetic in float64: 8-bit codes per 32 inputs (round half to even), exact dot products."""
    k = module.padded_in
    x = torch.nn.functional.pad(x.float(), (0, k - x.shape[1])).reshape(x.shape[0], k // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # in float32, as the kernel
    codes = torch.round(x * inverse).double()
    dx = (amax / 127.0).double()[..., 0]
    sx = (amax / 127.0 * codes.float().sum(-1, keepdim=True))[..., 0].double()  # float32 product, as the kernel
    weight_codes, d, m = module.blocks()
    weight_codes = weight_codes.reshape(module.out_features, k // 32, 32).double()  # [N, B, 32]
    dots = torch.einsum("mbj,nbj->mnb", codes, weight_codes)
    return ((d.double()[None] * dx[:, None]) * dots + m.double()[None] * sx[:, None]).sum(-1)


@needs_kernel
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (50, 96), (16, 40), (96, 576)])
def test_kernel_computes_the_documented_arithmetic(out_features, in_features):
    torch.manual_seed(0)
    module = Q4_1Linear.from_linear(torch.nn.Linear(in_features, out_features, bias=False))
    x = torch.randn(7, in_features)
    expected = reference(x, module)
    # float32 accumulation of the per-block terms: a few ulp of the sum of their magnitudes.
    assert (module(x).double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@needs_kernel
@pytest.mark.parametrize("out_features", [64, 50])
def test_every_row_is_computed_alone_bit_for_bit(out_features):
    """A k-token verify pass and one-token steps see the same numbers from this layer, whichever tile of rows
    a row falls in (tiles of 4, then 3, 2 or 1) and in the last, partial group of 8 outputs too."""
    torch.manual_seed(1)
    module = Q4_1Linear.from_linear(torch.nn.Linear(576, out_features, bias=True))  # K = 576: SmolLM2's width
    x = torch.randn(13, 576) * torch.logspace(-3, 2, 13)[:, None]
    together = module(x)
    for rows in (1, 2, 3, 4, 5, 13):
        for start in range(0, 13 - rows + 1, 3):
            assert torch.equal(module(x[start:start + rows]), together[start:start + rows])


@needs_kernel
def test_the_avx512_path_gives_the_avx2_paths_bits():
    """On a CPU with AVX-512 VNNI the kernel multiplies two groups of 8 outputs per vector; the block sums are
    the same integers and the float operations per lane the same, so the outputs are the same bits, for every
    row count and for N that leave a single or partial group at the end."""
    if not q4_1.use_avx512(True):
        pytest.skip("this CPU has no AVX-512 VNNI: only the AVX2 path runs here")
    torch.manual_seed(3)
    try:
        for out_features, in_features in [(3072, 576), (576, 1536), (24, 64), (20, 64), (13, 96), (8, 32)]:
            module = Q4_1Linear.from_linear(torch.nn.Linear(in_features, out_features, bias=False))
            for rows in (1, 2, 3, 4, 5, 16, 33):
                x = torch.randn(rows, in_features) * torch.logspace(-2, 2, rows)[:, None]
                assert q4_1.use_avx512(True)
                fast = module(x)
                q4_1.use_avx512(False)
                assert torch.equal(fast, module(x)), (out_features, in_features, rows)
    finally:
        q4_1.use_avx512(True)


@needs_kernel
def test_weights_are_the_int4_groups_they_were_made_from():
    torch.manual_seed(2)
    linear = torch.nn.Linear(64, 32, bias=False)
    groups = int4_groups(linear.weight)
    module = Q4_1Linear(groups, None)
    codes, d, m = module.blocks()
    assert torch.equal(codes, groups.q)
    weight = codes.double() * d.double().repeat_interleave(32, 1) + m.double().repeat_interleave(32, 1)
    assert (weight - groups.dequantize().double()).abs().max() <= 1e-6 * groups.dequantize().abs().max()


@needs_kernel
def test_scales_exact_in_float16_are_stored_so_and_give_the_same_outputs():
    """A GGUF file's blocks carry float16 scales: stored as such they are a quarter fewer bytes to read per
    weight, with outputs bit for bit those of the same scales in float32. Other scales stay float32."""
    torch.manual_seed(4)
    groups = int4_groups(torch.randn(40, 96))
    assert Q4_1Linear(groups, None).scales.dtype == torch.float32
    groups.scale = groups.scale.half().float()
    groups.zero = (groups.zero - 8 * groups.scale).half().float() + 8 * groups.scale  # a float16 minimum
    half = Q4_1Linear(groups, None)
    assert half.scales.dtype == torch.float16
    single = Q4_1Linear(groups, None)
    single.scales = half.scales.float()
    x = torch.randn(9, 96)
    assert torch.equal(half(x), single(x))


@needs_kernel
def test_outputs_in_a_partial_group_are_not_stacked_with_others():
    """Fusing q/k/v-like layers stacks groups of 8 outputs: a layer of 20 outputs would put padding mid-stack."""
    torch.manual_seed(3)
    parts = [Q4_1Linear.from_linear(torch.nn.Linear(64, n, bias=False)) for n in (64, 20)]
    assert fuse_outputs(parts) is None
    assert fuse_outputs([parts[0], Q4_1Linear.from_linear(torch.nn.Linear(64, 24, bias=False))]) is not None


@needs_kernel
def test_zero_and_empty_inputs():
    module = Q4_1Linear.from_linear(torch.nn.Linear(64, 16, bias=False))
    assert torch.equal(module(torch.zeros(2, 64)), torch.zeros(2, 16))
    assert module(torch.zeros(0, 64)).shape == (0, 16)


@needs_kernel
def test_a_nan_input_gives_nan_outputs_wherever_it_sits():
    """As a float matmul would: a NaN must not turn into large finite numbers (hiding a broken hidden state)."""
    module = Q4_1Linear.from_linear(torch.nn.Linear(576, 16, bias=False))
    for position in (0, 7, 31, 300, 575):
        x = torch.randn(2, 576)
        x[1, position] = float("nan")
        y = module(x)
        assert y[1].isnan().all() and not y[0].isnan().any(), position


def test_a_cpu_without_avx2_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(SpeculaError, match="q4_1 weights are not available: .*AVX2"):
        check_available("q4_1", "cpu")


def test_a_gpu_is_refused_with_the_reason():
    with pytest.raises(SpeculaError, match="runs on CPUs only"):
        check_available("q4_1", "meta")


@pytest.mark.skipif(q4_1.unavailable_reason() is not None, reason=str(q4_1.unavailable_reason()))
def test_kernels_built_before_load_without_the_extension_builder():
    """A start loads the machine's built kernels directly: no import of torch's extension builder and no ninja run
    (which relinked the float32 kernel on some starts: 0.4 s each)."""
    import subprocess
    import sys

    q4_1.load()  # built (or found) in this session's cache, with its recipe
    from specula.kernels import attention, float32

    attention.kernel(), float32.kernel()
    code = ("import sys; sys.modules['torch.utils.cpp_extension'] = None\n"  # importing it now fails
            "import torch\nfrom specula.kernels import attention, float32, q4_1\n"
            "q4_1.load(); assert attention.kernel() is not None and float32.kernel() is not None\n"
            "print(torch.ops.specula.q4_1_linear)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "q4_1_linear" in done.stdout
