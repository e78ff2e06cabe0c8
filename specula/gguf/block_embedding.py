"""An embedding table held as a GGUF file's own Q8_0 blocks: int8 codes and a float16 scale per 32 columns.

A Q8_0 block stores 32 weights as int8 codes q with one float16 scale d, w = q * d. A code has at most 8
significant bits and a float16 number 11, so q * d is exact in float32: a row looked up from the blocks is the
very float32 row that dequantizing the file gives, bit for bit, from a quarter of the memory (SmolLM2-135M's
49,152 × 576 table: 108 MiB in float32, 29 MiB as blocks). An embedding is only looked up, a few rows per step,
so the multiply costs nothing measurable. Which tables qualify is not assumed: `specula.runtime.streamed_load` keeps the
blocks only where every row equals the loaded model's float row (`equals_rows`), else the float table.

The target keeps it where a quantized format has given the LM head a matrix of its own (a float32 target's
tied LM head multiplies by the table itself, which must then stay a float matrix).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

BLOCK = 32  # weights per Q8_0 block
ROW_CHUNK = 4096  # rows dequantized at a time where a whole table is walked (bounded temporaries)


class Q8_0Embedding(nn.Module):
    """ids [...] → rows [..., K] in ``dtype``, from codes int8 [V, K] and scales float16 [V, K / 32]."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        if self.embedding_dim % BLOCK or tuple(scales.shape) != (self.num_embeddings, self.embedding_dim // BLOCK):
            raise ValueError(f"Q8_0 blocks need K a multiple of {BLOCK} and one scale per block: codes "
                             f"{tuple(codes.shape)}, scales {tuple(scales.shape)}")
        self.dtype = dtype
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        # The float16 scales are kept as their bit patterns: a `module.to(dtype)` casts floating buffers, and a
        # scale rounded to another type would no longer reproduce the file's rows.
        self.register_buffer("scale_bits", scales.to(torch.float16).contiguous().view(torch.int16))

    @classmethod
    def from_blocks(cls, raw: np.ndarray, shape: tuple[int, int], dtype: torch.dtype = torch.float32
                    ) -> Q8_0Embedding:
        """The table stored as Q8_0 blocks ``raw`` uint8 [V, K / 32 * 34] (per block: d float16, 32 int8 codes)."""
        rows, width = shape
        if width % BLOCK:
            raise ValueError(f"cannot read Q8_0 blocks of a [{rows}, {width}] tensor")
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, width // BLOCK, 2 + BLOCK)
        scales = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows, width))
        return cls(codes, scales, dtype)

    def _dequantize(self, codes: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
        """codes [..., K], scale_bits [..., K / 32] → [..., K] in ``dtype`` (exact in float32)."""
        scales = scale_bits.view(torch.float16).float()
        grouped = codes.float().unflatten(-1, (-1, BLOCK)) * scales[..., None]
        return grouped.flatten(-2).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._dequantize(self.codes[ids], self.scale_bits[ids])

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the table, [stop - start, K] in ``dtype``."""
        return self._dequantize(self.codes[start:stop], self.scale_bits[start:stop])

    @property
    def weight(self) -> torch.Tensor:
        """The whole table [V, K] in ``dtype``: a new tensor each time (for exporters; lookups use `forward`)."""
        return self.rows(0, self.num_embeddings)

    def equals_rows(self, read_rows: Callable[[int, int], torch.Tensor]) -> bool:
        """Whether every row equals ``read_rows(start, stop)`` bit for bit, compared `ROW_CHUNK` rows at a time."""
        for start in range(0, self.num_embeddings, ROW_CHUNK):
            stop = min(start + ROW_CHUNK, self.num_embeddings)
            expected = read_rows(start, stop)
            if expected.dtype != self.dtype or not torch.equal(self.rows(start, stop), expected):
                return False
        return True

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, Q8_0 blocks of {BLOCK}, looked up in {self.dtype}"
