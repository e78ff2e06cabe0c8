"""The q4_1 kernel: built once per machine from ``q4_1.cpp`` with the C++ compiler, then loaded as a torch op.

``torch.ops.specula.q4_1_linear(x float32 [M, K], packed uint8 [G, K/32, 4, 32], scales float32 or float16
[G, K/32, 2, 8], N) → float32 [M, N]`` with G = ceil(N / 8) groups of outputs (the arithmetic and the layout
are described in ``q4_1.cpp``; `pack` and `unpack` convert from and to codes and per-block scales and
minimums). It needs an x86 CPU with AVX2, FMA and F16C and a C++ compiler; the build (about 30 s) goes to
``kernels/`` in Specula's cache (``~/.cache/specula``, `specula.runtime.model_source.cache_dir`) and is reused until
the source or the torch version changes. `scripts/install.sh` builds it, so the first `--weights q4_1` run
does not wait for the compiler.

Why a kernel of our own: torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``) multiplies in
bfloat16 and costs 132 us for a 576 x 3072 weight and one token on a 2-core AVX2 EPYC, 546 us for 11
tokens; this one takes 38 us and 162 us (a first version, summing each row's blocks horizontally, took 61
and 356 us), which is most of what separates a Specula step from llama.cpp's on such a machine.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from specula.kernels import avx2_build_problem, build, kernel_report
from specula.kernels import build_directory as kernel_directory

SOURCE = Path(__file__).with_name("q4_1.cpp")
AVX512_VARIABLE = "SPECULA_Q4_1_AVX512"
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]


def build_directory() -> Path:
    """Where the compiled kernel lives, per torch version (an extension is tied to the torch it was built for)."""
    return kernel_directory("q4_1")


def unavailable_reason(device: torch.device | str = "cpu") -> str | None:
    """Why the kernel cannot run on ``device`` here (before trying to build it), or None."""
    return avx2_build_problem("q4_1", device)


@functools.cache
def load() -> torch._ops.OpOverloadPacket:
    """The ``torch.ops.specula.q4_1_linear`` op, building it first if this machine has no build yet."""
    build("q4_1", SOURCE, FLAGS)
    op = torch.ops.specula.q4_1_linear
    if os.environ.get(AVX512_VARIABLE) == "0":
        torch.ops.specula.q4_1_use_avx512(False)

    @torch.library.register_fake("specula::q4_1_linear")
    def _shape(x, packed, scales, n):  # lets torch.compile trace through the op
        return x.new_empty(x.shape[0], n)

    return op


def use_avx512(enabled: bool) -> bool:
    """Let the kernel use its AVX-512 VNNI path (where the CPU has it) or not; returns whether it now does.

    Both paths give the same bits (``q4_1.cpp`` says why); the AVX-512 one is faster where it exists. It is on
    by default on such a CPU; ``SPECULA_Q4_1_AVX512=0`` turns it off in a process (to compare the two).
    """
    load()
    return bool(torch.ops.specula.q4_1_use_avx512(enabled))


LANES = 8  # outputs per group: one per 32-bit lane of an AVX2 vector
PACK_GROUPS = 512  # groups of outputs packed at a time (4,096 rows)


def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of Q4_1 blocks w = codes * d + m.

    codes uint8 [N, K] (0..15, K a multiple of 32), d and m float32 [N, K/32] → (packed uint8 [G, K/32, 4, 32],
    scales [G, K/32, 2, 8]), G = ceil(N / 8); padding outputs have codes, d and m 0. The scales are float16
    when every d and m is exactly a float16 (as in a GGUF file's Q4_1 or Q4_0 blocks), else float32.
    """
    n, k = codes.shape
    groups, blocks = -(-n // LANES), k // 32
    packed = torch.empty(groups, blocks, 4, 32, dtype=torch.uint8)
    scales = torch.empty(groups, blocks, 2, LANES)
    # PACK_GROUPS groups of outputs at a time: a 49,152-row LM head packed whole held ~70 MB of temporaries.
    for first in range(0, groups, PACK_GROUPS):
        last = min(first + PACK_GROUPS, groups)
        rows = slice(first * LANES, min(last * LANES, n))
        packed[first:last], scales[first:last] = _pack_groups(codes[rows], d[rows], m[rows])
    # One token's step reads every weight once: float16 scales make that a quarter fewer bytes, and they are
    # exact for a GGUF file's own blocks (stored in float16); other scales keep float32.
    exact_in_half = torch.equal(scales.half().float(), scales)
    return packed, scales.half() if exact_in_half else scales


def _pack_groups(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack` of rows [n, K] (n <= groups * 8; the last group padded) → (packed, float32 scales) of their groups."""
    n, k = codes.shape
    groups, blocks = -(-n // LANES), k // 32
    pad = groups * LANES - n
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    # [g, o, b, p, half, t] with input 8p + 4 half + t of block b → [g, b, p, half, o, t]
    steps = codes.reshape(groups, LANES, blocks, 4, 2, 4).permute(0, 2, 3, 4, 1, 5).reshape(groups, blocks, 4, 2, 32)
    packed = steps[:, :, :, 0] | steps[:, :, :, 1] << 4
    per_group = [torch.nn.functional.pad(t.float(), (0, 0, 0, pad)).reshape(groups, LANES, blocks).transpose(1, 2)
                 for t in (d, m)]
    return packed, torch.stack(per_group, dim=2)


def unpack(packed: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack`: (codes uint8 [N, K], d float32 [N, K/32], m float32 [N, K/32])."""
    groups, blocks = packed.shape[:2]
    steps = torch.stack([packed & 15, packed >> 4], dim=3).reshape(groups, blocks, 4, 2, LANES, 4)
    codes = steps.permute(0, 4, 1, 2, 3, 5).reshape(groups * LANES, blocks * 32)[:n]
    d, m = (scales[:, :, i].float().transpose(1, 2).reshape(groups * LANES, blocks)[:n] for i in (0, 1))
    return codes, d, m


def build_report() -> str:
    """Build the kernel now if this machine has no build, and say what happened (`scripts/install.sh` prints it)."""
    return kernel_report("q4_1", load, "no q4_1 weights format")
