"""The row-invariant float32 linear kernel: built once per machine from ``float32.cpp``, loaded as a torch op.

``torch.ops.specula.float32_linear(x float32 [M, K], w float32 [N, K]) → float32 [M, N]`` = x @ w.T, each output a
fixed sequence of operations on its row of x and its row of w (``float32.cpp`` says which), so a row's result
does not depend on how many rows the call holds. It needs an x86 CPU with AVX2 and FMA and a C++ compiler
(``scripts/install.sh`` builds it); `kernel` is None where it cannot run, and float32 linears then go through
the BLAS (whose one-row and many-row products round differently).

Why: a speculative method's k-token verify pass must give each row the bits a one-token step gives, or its
greedy output may leave vanilla's at a near-tie (issue 39). MKL's products of 1-3, 4-11 and 12+ rows each round
differently, so no layout of BLAS calls gives that without padding every step to one of those shapes.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.kernels import avx2_build_problem, build, kernel_report

SOURCE = Path(__file__).with_name("float32.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
DISABLE_VARIABLE = "SPECULA_FLOAT32_KERNEL"  # "0": float32 linears through the BLAS (to compare)


@functools.cache
def load() -> torch._ops.OpOverloadPacket:
    """The ``torch.ops.specula.float32_linear`` op, building it first if this machine has no build yet."""
    build("float32", SOURCE, FLAGS)

    @torch.library.register_fake("specula::float32_linear")
    def _shape(x, w):  # lets torch.compile trace through the op
        return x.new_empty(x.shape[0], w.shape[0])

    return torch.ops.specula.float32_linear


_UNDECIDED = object()
_kernel = _UNDECIDED


def kernel() -> torch._ops.OpOverloadPacket | None:
    """The op where it runs on this machine's CPU (built if need be), else None; decided once per process, so that
    every step of a target multiplies the same way."""
    global _kernel
    if _kernel is _UNDECIDED:
        _kernel = None
        if os.environ.get(DISABLE_VARIABLE) != "0" and avx2_build_problem("float32") is None:
            try:
                _kernel = load()
            except SpeculaError as err:  # e.g. the compiler failed: the BLAS computes the same product
                print(f"specula: {err}; float32 linears go through the BLAS instead", file=sys.stderr, flush=True)
    return _kernel


def build_report() -> str:
    """Build the kernel now if this machine has no build, and say what happened (`scripts/install.sh` prints it)."""
    return kernel_report("float32", load, "float32 linears through the BLAS")
