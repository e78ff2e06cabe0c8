"""The native decoder stack: a Llama-style stack of q4_1 or float32 layers over a small block in one C++ call
(``decoder.cpp``).

``torch.classes.specula.DecoderStack`` runs each layer as the same ATen calls and the same q4_1 (or row-invariant
float32, `specula.kernels.float32`, looked up when a float32 stack first runs: the caller has loaded it) and
cached-attention ops that `specula.runtime.static_cache.decoder_layer_step` makes from Python, in the same order
on the same tensors, so its outputs are that path's bit for bit; what it removes is Python's cost around each of
them (`specula.runtime.native_decoder` says when a target can use it). Built once per machine like the other
kernels (about 30 s, `scripts/install.sh`).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from specula.kernels import attention, build, kernel_report, q4_1

SOURCE = Path(__file__).with_name("decoder.cpp")
FLAGS = ["-O3", "-ffp-contract=off"]
DISABLE_VARIABLE = "SPECULA_NATIVE_DECODER"  # "0": run every layer from Python (to compare)


def disabled() -> bool:
    return os.environ.get(DISABLE_VARIABLE) == "0"


@functools.cache
def load() -> type:
    """The ``torch.classes.specula.DecoderStack`` class, building it first if this machine has no build yet. The
    ops it calls (q4_1 linear, cached attention) are loaded first."""
    q4_1.load()
    attention.load()
    build("decoder", SOURCE, FLAGS)
    return torch.classes.specula.DecoderStack


def build_report() -> str:
    """Build the stack now if this machine has no build, and say what happened (`scripts/install.sh` prints it)."""
    return kernel_report("decoder", load, "the layers run from Python")


if __name__ == "__main__":
    print(build_report())
