"""Weight-only quantized linear layers on torch's own kernels: int8 per output channel, int4 in groups of 32.

Each stores only the weight compressed and runs its kernel in a *compute dtype* (its scales are
stored in it, the input is cast to it and the output cast back to the input's dtype):

- `Int8Linear`: w[n, k] = q[n, k] * scale[n], q int8, through
  ``torch.ops.aten._weight_int8pack_mm(x [M, K], q [N, K], scale [N])``.
- `Int4Linear`: w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g] for the group
  g = k // 32, q in 0..15, through ``_convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)``
  and ``_weight_int4pack_mm_for_cpu(x [M, K], packed, 32, scale_and_zero [K/32, N, 2])``
  on a CPU, or the CUDA pair ``_convert_weight_to_int4pack(uint8 [N, K/2], 2)`` /
  ``_weight_int4pack_mm`` (bfloat16 only) on a GPU. The CPU kernel needs N to be a
  multiple of 16 and K of the group size: weights are padded (and inputs, when K is not) and
  the padding is sliced off the output.
- `Q4_1Linear`: the same groups as GGUF Q4_1 blocks, multiplied by our own CPU kernel with 8-bit
  activations (`specula.kernels.q4_1`, llama.cpp's arithmetic).
- `BFloat16Linear`: the weight cast to bfloat16, the input cast to it for the matmul.
- `Float32Linear`: float32 weights unchanged, multiplied row-invariantly by our own kernel on an AVX2 CPU
  (`specula.kernels.float32`), else with the BLAS matmul laid out for few-row inputs.

Both CPU kernels accept float32, float16 and bfloat16, but on a CPU without AVX-512 (this
project's reference machine: AVX2) only bfloat16 is vectorized: measured on one thread for a
576 x 1536 weight and one token, int4 took 151 us in bfloat16 and 1949 us in float32 (a dense
float32 matmul 174 us); int8 96 us and 905 us. So `specula.runtime.weights` runs them in bfloat16 by
default, and float32 is there for exactness checks.

`Int4Groups` is the format-neutral description of an int4 weight (codes, scales, zeros);
`int4_groups` makes one from float weights (asymmetric min/max per group) and
`specula.gguf.blocks` makes one from a GGUF file's Q4_0/Q4_1 blocks without requantizing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specula.kernels import q4_1
from specula.kernels.float32 import kernel as float32_kernel
from specula.runtime.linear_gradient import KEPT_WEIGHT, KernelInputGradient

GROUP_SIZE = 32
INT4_N_MULTIPLE = 16  # the CPU packing refuses other N; CUDA needs 8
Q4_1_N_MULTIPLE = 8  # the q4_1 kernel's outputs come in groups of 8 (specula.kernels.q4_1.pack)
# torch 2.13's bfloat16 int8 CPU kernel reads past the row when K is not a multiple of 8 (garbage outputs,
# sometimes a segfault; float32 is fine), and on an AVX-512 CPU (an Intel Xeon here) it segfaults for two or
# more rows whenever K is not a multiple of 16 (K = 24, 168, 1544 crash; 16, 160, 176, 1536 do not): inputs
# and weights are padded with zeros to a multiple of 16.
INT8_K_MULTIPLE = 16
# Rows quantized or packed at a time (a multiple of 64, the CPU int4 packing's row block, so packing in chunks
# gives the very same bytes): bounds a conversion's temporaries to a chunk's, not a whole LM head's.
ROW_CHUNK = 4096


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass
class Int4Groups:
    """An int4 weight in the kernels' convention: w = (q - 8) * scale + zero per group of ``group_size`` inputs.

    q:     uint8 [N, Kp], codes 0..15; Kp = K rounded up to the group size (padding columns are ignored).
    scale: float32 [N, Kp / group_size].
    zero:  float32 [N, Kp / group_size].
    in_features: K, the real input width.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    in_features: int
    group_size: int = GROUP_SIZE

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the weight these groups stand for."""
        scale = self.scale.float().repeat_interleave(self.group_size, dim=1)
        zero = self.zero.float().repeat_interleave(self.group_size, dim=1)
        return ((self.q.float() - 8) * scale + zero)[:, :self.in_features]

    def permute_rows(self, order: torch.Tensor) -> Int4Groups:
        """The same groups with output rows taken in ``order`` [N]."""
        return Int4Groups(self.q[order], self.scale[order], self.zero[order], self.in_features, self.group_size)


def int4_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Groups:
    """Asymmetric int4 per group of ``weight`` [N, K]: scale = (max - min) / 15, q = round((w - min) / scale).

    A partial last group is padded by repeating the row's last value, so padding never widens its range.
    """
    return int4_groups_of_rows(lambda start, stop: weight[start:stop], tuple(weight.shape), group_size)


def int4_groups_of_rows(read_rows: Callable[[int, int], torch.Tensor], shape: tuple[int, int],
                        group_size: int = GROUP_SIZE) -> Int4Groups:
    """`int4_groups` of a weight of ``shape`` (N, K) read ``read_rows(start, stop)`` → [stop - start, K] at a time,
    `ROW_CHUNK` rows each: groups never span rows, so the result is the same, and the float temporaries stay
    a chunk's (the 49,152-row LM head of SmolLM2 held ~200 MiB of them at once)."""
    n, k = shape
    kp = _round_up(k, group_size)
    q = torch.empty(n, kp, dtype=torch.uint8)
    scale, zero = torch.empty(n, kp // group_size), torch.empty(n, kp // group_size)
    for start in range(0, n, ROW_CHUNK):
        stop = min(start + ROW_CHUNK, n)
        w = read_rows(start, stop).detach().float()
        if kp != k:
            w = F.pad(w[None], (0, kp - k), mode="replicate")[0]
        grouped = w.reshape(stop - start, kp // group_size, group_size)
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        step = (high - low) / 15
        # A constant group has no range: any positive scale reproduces it (its codes are all 0).
        step = torch.where(step > 0, step, torch.full_like(step, 1e-12))
        codes = torch.round((grouped - low[..., None]) / step[..., None]).clamp_(0, 15)
        q[start:stop] = codes.reshape(stop - start, kp)
        scale[start:stop], zero[start:stop] = step, low + 8 * step
    return Int4Groups(q, scale, zero, k, group_size)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [N, K], scale float32 [N]) with w ≈ q * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale, codes 0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class _KernelLinear(nn.Module):
    """What every kernel-backed linear does around its kernel: x [..., K] is flattened to rows, cast to the
    kernel's ``input_dtype`` and zero-padded to ``padded_in`` columns; `kernel` maps those rows [M, padded_in] to
    [M, N'] (N' >= N, padding outputs dropped); the result returns in x's dtype, plus the bias."""

    in_features: int
    out_features: int
    padded_in: int

    @property
    def input_dtype(self) -> torch.dtype:
        return self.compute_dtype

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] → [..., N] in x's dtype."""
        flat = x.reshape(-1, self.in_features).to(self.input_dtype)
        if self.padded_in != self.in_features:
            flat = F.pad(flat, (0, self.padded_in - self.in_features))
        if torch.is_grad_enabled() and flat.requires_grad:
            y = KernelInputGradient.apply(flat.contiguous(), self)
        else:
            y = self.kernel(flat.contiguous())
        if y.shape[1] != self.out_features:
            y = y[:, :self.out_features]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


    def __getstate__(self) -> dict:
        # The kept gradient matrix is derived data: never pickled with the layer (the converted-model cache).
        state = super().__getstate__()
        state.pop(KEPT_WEIGHT, None)
        return state


class Int8Linear(_KernelLinear):
    """y = x @ (q * scale[:, None]).T + bias, q int8 [N, K]; the kernel runs in ``compute_dtype``."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.padded_in = _round_up(self.in_features, INT8_K_MULTIPLE)
        self.compute_dtype = compute_dtype
        self.register_buffer("qweight", F.pad(q, (0, self.padded_in - self.in_features)).contiguous())
        self.register_buffer("scales", scale.to(compute_dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16) -> Int8Linear:
        q, scale = int8_rows(linear.weight)
        return cls(q, scale, linear.bias, compute_dtype)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per output channel, "
                f"computed in {self.compute_dtype}")


class Int4Linear(_KernelLinear):
    """y = x @ W.T + bias with W held as packed int4 groups (see `Int4Groups`) for the device's kernel."""

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None, compute_dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        n, kp = groups.q.shape
        self.out_features, self.in_features = n, groups.in_features
        self.group_size = groups.group_size
        self.padded_in = kp
        self.cuda = device.type == "cuda"
        self.compute_dtype = torch.bfloat16 if self.cuda else compute_dtype  # the CUDA kernel has no other
        np_ = _round_up(n, INT4_N_MULTIPLE)
        q = groups.q
        scale, zero = groups.scale.float(), groups.zero.float()
        if np_ != n:  # padding rows: code 8 and zero 0 make them exact zeros
            q = F.pad(q, (0, 0, 0, np_ - n), value=8)
            scale = F.pad(scale, (0, 0, 0, np_ - n), value=1.0)
            zero = F.pad(zero, (0, 0, 0, np_ - n), value=0.0)
        q = q.to(device)
        if self.cuda:
            q = q.to(torch.int32)
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 2)
        else:  # the CPU packing takes int32 codes: four bytes per code, so a chunk of rows at a time
            packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q[start:start + ROW_CHUNK].to(torch.int32).contiguous(), 1) for start in range(0, np_, ROW_CHUNK)])
        self.register_buffer("packed", packed)
        scale_and_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(device=device, dtype=self.compute_dtype)
        self.register_buffer("scale_and_zero", scale_and_zero.contiguous())  # [Kp / G, Np, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().to(device).clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype = torch.bfloat16,
                    group_size: int = GROUP_SIZE) -> Int4Linear:
        return cls(int4_groups(linear.weight, group_size), linear.bias, compute_dtype, linear.weight.device)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            return torch.ops.aten._weight_int4pack_mm(rows, self.packed, self.group_size, self.scale_and_zero)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scale_and_zero)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 in groups of "
                f"{self.group_size}, computed in {self.compute_dtype}")


class Q4_1Linear(_KernelLinear):
    """y = x @ W.T + bias with W in GGUF Q4_1 blocks and x rounded to 8-bit codes per 32 (`specula.kernels.q4_1`).

    The weight is the `Int4Groups` it is made from, stored as Q4_1 blocks: w = q * d + m per 32 inputs,
    d = scale and m = zero - 8 * scale (computed in float64 and rounded once, so a GGUF Q4_1 block's own
    minimum comes back to within one float32 rounding, and a Q4_0 block's exactly). Each call rounds every
    32 inputs of each row to int8 codes (scale max|x| / 127), as llama.cpp does on a CPU: the result is
    not x @ W.T in float32 but a row-independent integer computation whose rounding is of the order of
    bfloat16's, so it reports ``compute_dtype`` bfloat16 for the near-tie tolerance (`specula.divergence`).
    The kernel is CPU (AVX2) only; the result is float32, cast to x's dtype.
    """

    compute_dtype = torch.bfloat16

    def __init__(self, groups: Int4Groups, bias: torch.Tensor | None):
        super().__init__()
        self._op = q4_1.load()
        if groups.group_size != GROUP_SIZE:
            raise ValueError(f"q4_1 blocks span {GROUP_SIZE} inputs, not {groups.group_size}")
        n, kp = groups.q.shape
        self.out_features, self.in_features, self.padded_in = n, groups.in_features, kp
        minimum = (groups.zero.double() - 8 * groups.scale.double()).float()
        packed, scales = q4_1.pack(groups.q, groups.scale.float(), minimum)
        self.register_buffer("packed", packed)  # uint8 [ceil(N / 8), K / 32, 4, 32]: the kernel's layout
        self.register_buffer("scales", scales)  # float32 or float16 [ceil(N / 8), K / 32, 2, 8]: d and m per block
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Q4_1Linear:
        return cls(int4_groups(linear.weight), linear.bias)

    def __getstate__(self) -> dict:
        # The op is a handle into the loaded extension, not data: a saved converted model
        # (`specula.runtime.converted_cache`) looks it up again when it is read.
        return {name: value for name, value in super().__getstate__().items() if name != "_op"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._op = q4_1.load()

    input_dtype = torch.float32  # the kernel rounds the inputs itself

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return self._op(rows, self.packed, self.scales, self.out_features)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored Q4_1 blocks, w = codes * d + m: (codes uint8 [N, K'], d, m float32 [N, K' / 32]),
        K' = K rounded up to 32."""
        return q4_1.unpack(self.packed, self.scales, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, Q4_1 blocks of {GROUP_SIZE}, "
                f"8-bit activations")


# A bfloat16 matmul on a CPU takes another kernel for a call of 1-2 rows than for more, and for inputs wider
# than ~576 the two round differently (measured on the reference AMD EPYC, one thread: SmolLM2's down projection,
# 576 x 1536, gave rows of a 3- to 64-row call other bits than the same rows alone; q/k/v, gate/up and the LM head,
# 576 wide, did not). Padding every call to at least this many rows puts every row, a one-token step's too, through
# the many-row kernel: rows of a 1- to 1,024-row call then equal the rows alone, for every SmolLM2 shape. It costs
# SmolLM2's eager one-token step 52-54 -> 63-65 ms and a 4-token one 58-60 -> 64 ms (two alternating pairs of
# processes, 300 cached tokens, one thread): bfloat16 on a CPU is never the fast format (q4_1's step is ~16 ms),
# and the 576-wide shapes, the LM head's included, would need no padding on this CPU, but other CPUs pick kernels
# by other rules: every call is padded.
BF16_MIN_ROWS = 4


class BFloat16Linear(nn.Module):
    """y = x @ W.T + bias with W stored in bfloat16; the matmul runs in bfloat16, the result in x's dtype. On a CPU
    each row's bits do not depend on how many rows the call holds (`BF16_MIN_ROWS`)."""

    compute_dtype = torch.bfloat16

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features, self.in_features = linear.weight.shape
        self.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] → [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        m = rows.shape[0]
        if x.device.type == "cpu" and m < BF16_MIN_ROWS:
            rows = F.pad(rows, (0, 0, 0, BF16_MIN_ROWS - m))
        y = F.linear(rows, self.weight, self.bias)[:m]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Float32Linear(nn.Linear):
    """`nn.Linear` (same float32 weight and bias, shared, not copied) with a CPU matmul for decoding.

    On a CPU with AVX2: `specula.kernels.float32`, every output one fixed sequence of operations on its row, so a
    k-token verify pass gives each row a one-token step's bits (MKL's 1-3, 4-11 and 12+ row products round
    differently). One thread, 17 SmolLM2-sized weights with the LM head, min of 7 interleaved, AMD EPYC (shared):
    1 / 2 / 4 / 16 / 64 rows 7.9 / 7.9 / 10.1 / 18.5 / 51.3 ms; MKL's columns layout 7.2 / 6.9 / 7.7 / 28.6 / 66.5.
    Without it: ``W @ x.T`` (a one-row input as two equal columns) instead of ``F.linear``'s ``x @ W.T``, which
    reads a large W at another rate by CPU (2 threads, the 49,152 x 576 LM head, 1 row: AMD EPYC 9.1 ms with
    ``F.linear``, 5.1 ms here; Intel Xeon with AVX-512 2.65 vs 7.13 ms), so `specula.runtime.weights` swaps it in
    there only where `specula.runtime.float32_layout` measured it faster, and only for weights too large to stay
    in cache. Elsewhere (CUDA) it is plain ``F.linear``.
    """

    @classmethod
    def sharing(cls, linear: nn.Linear) -> Float32Linear:
        """A Float32Linear holding ``linear``'s own parameters (a tied LM head stays tied)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] → [..., N]."""
        if x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        kernel = float32_kernel()
        # The kernel has no backward: a trainer that differentiates through the target (Medusa's shared LM head)
        # takes the BLAS path.
        differentiated = torch.is_grad_enabled() and (rows.requires_grad or self.weight.requires_grad)
        if kernel is not None and self.weight.is_contiguous() and not differentiated:
            out = kernel(rows.contiguous(), self.weight)
        else:
            if rows.shape[0] == 1:
                # MKL's matrix-vector path reads W at about half the rate of its two-column product.
                out = (self.weight @ rows.repeat(2, 1).t())[:, :1]
            else:
                out = self.weight @ rows.t()
            out = out.t().contiguous()
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


# What each fusible kind holds per output row: tensors whose dim 0 runs over outputs (stacked, and the parts
# then see views of the stack) and tensors whose dim 1 does (concatenated as copies: the kernels want them
# contiguous, and they are the small ones, the int4 scales).
