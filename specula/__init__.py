"""Specula: lossless speculative decoding for Hugging Face causal language models."""

from specula.api import Generation, Speculator, StreamChunk
from specula.errors import SpeculaError
from specula.methods import build_speculator, load
from specula.sampling import SamplingParams

__all__ = ["Generation", "SamplingParams", "SpeculaError", "Speculator", "StreamChunk", "build_speculator", "check",
           "load"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # `specula.check` loads the certifier when first asked for, not with every `specula generate`.
    if name == "check":
        from specula.certify.check import check

        return check
    raise AttributeError(f"module 'specula' has no attribute {name!r}")
