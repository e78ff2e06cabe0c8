"""The cached-attention kernel: a few query rows over a KV cache, built once per machine from ``attention.cpp``.

``torch.ops.specula.cached_attention(q float32 [1, H, n, d], keys, values float32 [1, Hkv, A, d], mask bool
[.., n, >= end] or None, end int64 0-d CPU tensor, scale) → float32 [1, H, n, d]``: each query row attends over
cache slots [0, end) that its mask row marks. It needs an x86 CPU with AVX2 and FMA and a C++ compiler
(``scripts/install.sh`` builds it, about 20 s); `kernel` is None where it cannot run, and attention then
goes through torch's SDPA (`specula.runtime.static_cache` chooses per block).

Why: in a decode or verify step of a small model each layer attends a few rows over a few hundred slots,
microseconds of arithmetic, and torch's SDPA (called from a custom op) took ~70 us per layer around it.
SmolLM2 q4_1, compiled, one token after 300 (Intel Xeon, AVX-512, 2 threads, torch profiler over 20 steps):
attention 2.17 → 0.82 ms per step, the whole step 8.0 → 4.8 ms (the linears also ran faster after it).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.kernels import avx2_build_problem, build, kernel_report

SOURCE = Path(__file__).with_name("attention.cpp")
# Where torch runs AVX-512 code, AVX-512VL too: its 32 vector registers let a group of queries share each loaded key
# (the kernel's instructions stay 8-lane AVX2 ones either way, so a machine's rows keep their bits).
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"] + (
    ["-mavx512f", "-mavx512vl"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])
DISABLE_VARIABLE = "SPECULA_ATTENTION_KERNEL"  # "0": attend through SDPA (to compare)


def unavailable_reason(device: torch.device | str = "cpu") -> str | None:
    """Why the kernel cannot run on ``device`` here (before trying to build it), or None."""
    return avx2_build_problem("attention", device)


@functools.cache
def load() -> torch._ops.OpOverloadPacket:
    """The ``torch.ops.specula.cached_attention`` op, building it first if this machine has no build yet."""
    build("attention", SOURCE, FLAGS)

    @torch.library.register_fake("specula::cached_attention")
    def _shape(q, keys, values, mask, end, scale):  # lets torch.compile trace through the op
        return q.new_empty(q.shape)  # contiguous, as the kernel returns it

    return torch.ops.specula.cached_attention


_UNDECIDED = object()
_kernel = _UNDECIDED


def kernel() -> torch._ops.OpOverloadPacket | None:
    """The op where it runs on this machine's CPU (built if need be), else None: decided once per process,
    so that every step of a target attends the same way. `specula.runtime.compiled_step` decides before tracing
    (the graph then reads the answer as a constant)."""
    global _kernel
    if _kernel is _UNDECIDED:
        _kernel = None
        if os.environ.get(DISABLE_VARIABLE) != "0" and unavailable_reason() is None:
            try:
                _kernel = load()
            except SpeculaError as err:  # e.g. the compiler failed: SDPA computes the same attention, more slowly
                print(f"specula: {err}; attention goes through torch's SDPA instead", file=sys.stderr, flush=True)
    return _kernel


def packed() -> torch._ops.OpOverloadPacket | None:
    """``torch.ops.specula.packed_attention`` where `kernel` runs, else None: many sequences' chain blocks of one
    packed forward written to their caches and attended in one call, each row exactly as `kernel` attends it.
    ``(q, k, v [1, H(kv), N, d], key_caches, value_caches: lists of [1, Hkv, A_s, d], starts, ends, prefixes:
    lists of ints, scale) → [1, H, N, d]``, rows outside every [start, end) zero."""
    return None if kernel() is None else torch.ops.specula.packed_attention


def build_report() -> str:
    """Build the kernel now if this machine has no build, and say what happened (`scripts/install.sh` prints it)."""
    return kernel_report("attention", load, "SDPA instead")


if __name__ == "__main__":
    print(build_report())
