"""A GGUF file's own 4-bit blocks, carried into the int4 kernel's groups instead of requantizing floats.

Q4_0 and Q4_1 store 32 weights per block with a float16 scale d (and for Q4_1 a
float16 minimum m): Q4_0 means w = (q - 8) * d, Q4_1 w = q * d + m, q in 0..15,
which is the int4 kernel's w = (q - 8) * scale + zero with scale = d and zero = 0
(Q4_0) or m + 8 d (Q4_1). Both blocks and the kernel's groups span 32 consecutive
inputs of one output row, so the codes carry over unchanged; only the Q4_1 zero
is rounded once (to float32). Q8_0 (int8, one scale per 32) has no exact
counterpart in the int8 kernel, which has one scale per row: such tensors are
requantized from their dequantized values, which are exact in float32.

Block layouts (ggml): Q4_0 = d f16, 16 bytes of codes; Q4_1 = d f16, m f16, 16
bytes; in the 16 bytes, the low nibble of byte j is weight j, the high nibble
weight j + 16.

GGUF rows of Llama's attn_q and attn_k are stored in llama.cpp's rotary order;
`transformers` undoes that permutation on load. Which row order a file uses is
not guessed: `carried_groups` tries the plain order and the Llama one and keeps
the one whose dequantized weight equals the loaded model's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specula.runtime.quantized_linear import GROUP_SIZE, Int4Groups

# GGUF tensor base name → submodule of a Llama-family `transformers` decoder layer.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
CARRIED_TYPES = ("Q4_0", "Q4_1")
EMBEDDING = "model.embed_tokens"
EMBEDDING_TYPES = ("Q8_0",)  # an embedding kept as the file's blocks (`specula.gguf.block_embedding`)


def module_name(gguf_name: str, tied_head: bool) -> str | None:
    """The `transformers` module a GGUF weight tensor becomes (``model.layers.3.mlp.up_proj``), or None."""
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    if gguf_name == "output.weight" or (tied_head and gguf_name == "token_embd.weight"):
        return "lm_head"
    return None


def blocks_to_groups(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Int4Groups:
    """Int4 groups of a Q4_0 or Q4_1 tensor: ``raw`` uint8 [N, bytes per row], ``shape`` (N, K) of the weight."""
    n, k = shape
    if type_name not in CARRIED_TYPES or k % GROUP_SIZE:
        raise ValueError(f"cannot carry {type_name} blocks of a [{n}, {k}] tensor into int4 groups")
    header = 2 if type_name == "Q4_0" else 4
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // GROUP_SIZE, header + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., header:]
    q = np.concatenate([codes & 0x0F, codes >> 4], axis=-1).reshape(n, k)
    if type_name == "Q4_0":
        zero = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + np.float32(8) * d
    return Int4Groups(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zero), k)


def llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """[rows]: for each `transformers` row of attn_q/attn_k, the GGUF row it was stored as (llama.cpp's permute)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


@dataclass(frozen=True)
class FileBlocks:
    """Where one tensor's blocks are in a GGUF file: ``kind`` (``Q4_1``, ...), ``shape`` (N, K) of the weight.

    `raw` reads them with plain file reads when they are needed: pages of a memory-mapped file count as the
    process's memory for as long as the mapping lives (reading all of SmolLM2's blocks through one held ~90 MiB
    until loading ended).
    """

    kind: str
    path: Path
    offset: int
    n_bytes: int
    shape: tuple[int, int]

    def raw(self) -> np.ndarray:
        """uint8 [N, bytes per row]."""
        data = np.empty(self.n_bytes, dtype=np.uint8)
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            if handle.readinto(memoryview(data)) != self.n_bytes:
                raise ValueError(f"{self.path} ends inside a tensor's blocks")
        return data.reshape(self.shape[0], -1)


def read_linear_blocks(gguf_file: str | Path, tied_head: bool) -> dict[str, FileBlocks]:
    """{module name: FileBlocks} of the file's Q4_0/Q4_1 linear weights, and of its embedding (`EMBEDDING`) when
    that is stored as Q8_0 blocks."""
    from gguf import GGUFReader

    found = {}
    for tensor in GGUFReader(str(gguf_file)).tensors:
        kind = tensor.tensor_type.name
        if tensor.name == "token_embd.weight" and kind in EMBEDDING_TYPES:
            name = EMBEDDING
        elif kind in CARRIED_TYPES:
            name = module_name(tensor.name, tied_head)
        else:
            continue
        if name is None or len(tensor.shape) != 2:
            continue
        k, n = (int(d) for d in tensor.shape)  # GGUF lists the innermost dimension first
        found[name] = FileBlocks(kind, Path(gguf_file), int(tensor.data_offset), int(tensor.n_bytes), (n, k))
    return found


def carried_groups(blocks: FileBlocks, loaded: torch.Tensor, heads: int | None) -> Int4Groups | None:
    """The file's blocks as int4 groups in the loaded weight's row order, or None if they do not reproduce it.

    ``loaded`` [N, K] is the model's weight (the file dequantized by `transformers`); ``heads`` the number of
    heads whose rows llama.cpp may have permuted (attn_q, attn_k), else None.
    """
    shape = blocks.shape
    if tuple(loaded.shape) != shape:
        return None
    groups = blocks_to_groups(blocks.raw(), blocks.kind, shape)
    reference = loaded.detach().float().cpu()
    tolerance = 1e-6 * float(reference.abs().max()) + 1e-30  # one rounding of the Q4_1 zero, a few ulp
    orders = [None] + ([llama_row_order(shape[0], heads)] if heads and shape[0] % (2 * heads) == 0 else [])
    for order in orders:
        candidate = groups if order is None else groups.permute_rows(order)
        if float((candidate.dequantize() - reference).abs().max()) <= tolerance:
            return candidate
    return None
