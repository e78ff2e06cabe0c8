"""Specula: lossless speculative decoding for Hugging Face causal language models."""

# ruff: noqa: E402 (the imports below wait for the OpenMP policy)
from specula.openmp import wait_briefly_unless_chosen

# Before torch loads: on 2 cores OpenMP's long default spin let threads take the cores from each other and other
# processes; passive waiting made two threads slower than one (docs/defaults.md). A policy the user set is kept.
wait_briefly_unless_chosen()

from specula.api import Generation, Speculator, StreamChunk
from specula.errors import SpeculaError
from specula.methods import build_speculator, load
from specula.runtime.precompiled import inductor_cache
from specula.sampling import SamplingParams

# Before anything asks Inductor where its cache is (loading a target does): what --compile builds is kept in
# Specula's cache directory, not in a temporary one (a directory the user set is kept).
inductor_cache()

__all__ = ["Generation", "SamplingParams", "SpeculaError", "Speculator", "StreamChunk", "build_speculator", "check",
           "load"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `specula.check` loads the certifier when first asked for, not with every `specula generate`.
    if name == "check":
        from specula.certify.check import check

        return check
    raise AttributeError(f"module 'specula' has no attribute {name!r}")
