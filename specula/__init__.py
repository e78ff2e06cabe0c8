"""Specula: lossless speculative decoding for Hugging Face causal language models."""

from specula.api import Generation, Speculator, StreamChunk, load
from specula.check import check
from specula.errors import SpeculaError
from specula.sampling import SamplingParams

__all__ = ["Generation", "SamplingParams", "SpeculaError", "Speculator", "StreamChunk", "check", "load"]
__version__ = "0.1.0"
