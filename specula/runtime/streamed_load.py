"""Loading a Llama-family checkpoint with its linear layers converted as they are read, never whole in float.

`from_pretrained` followed by `specula.runtime.weights.quantize_linear_weights` holds the whole float model
first (SmolLM2-135M: 540 MB of float32, memory-mapped, every page touched while quantizing) and
then the quantized copy: the int4 model's peak memory was higher than the float32 model's. Here the
model is built with empty (meta) parameters, each decoder-layer linear is read from the safetensors
file with plain reads (not a memory map, whose touched pages would count as this process's memory
until it is closed), converted at once and its float weight dropped; the other tensors (embedding,
norms) are read into memory of their own.

`load_converted` returns None when the checkpoint is not one it can do this for (not safetensors,
a tensor of a dtype it does not know, names or shapes that differ from the model's, a parameter it
could not fill): the caller then loads through `from_pretrained`, which also explains what is wrong.
The result equals that path's exactly (same tensors, same conversion; `tests/test_weights.py`).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from torch import nn

from specula.gguf.block_embedding import Q8_0Embedding
from specula.gguf.blocks import EMBEDDING
from specula.runtime.heap import large_frees_returned, trim_heap
from specula.runtime.weights import LAYER_LINEARS, LinearConverter, WeightsReport, linear_names, replace_submodule

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _SafetensorsIndex:
    """Where each tensor of a model directory's safetensors files is: name → (file, dtype, shape, begin, end)."""

    def __init__(self, files: list[Path]):
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        self.known = True  # False if some tensor has a dtype this reader does not know
        for file in files:
            with open(file, "rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = _DTYPES.get(entry["dtype"])
                if dtype is None:
                    self.known = False
                    continue
                begin, end = entry["data_offsets"]
                self.entries[name] = (file, dtype, tuple(entry["shape"]), 8 + size + begin, 8 + size + end)

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor ``name`` read from its file into memory of its own, floating types cast to ``dtype``."""
        _, _, shape, begin, end = self.entries[name]
        return self._read(name, begin, end, shape, dtype)

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``start:stop`` (dimension 0) of the tensor ``name``, read alone like `read`."""
        _, stored, shape, begin, _ = self.entries[name]
        row_bytes = stored.itemsize * math.prod(shape[1:])
        return self._read(name, begin + start * row_bytes, begin + stop * row_bytes, (stop - start, *shape[1:]),
                          dtype)

    def _read(self, name: str, begin: int, end: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        file, stored = self.entries[name][:2]
        buffer = bytearray(end - begin)
        with open(file, "rb") as handle:
            handle.seek(begin)
            handle.readinto(buffer)
        tensor = torch.frombuffer(buffer, dtype=stored) if buffer else torch.empty(0, dtype=stored)
        tensor = tensor.reshape(shape)
        return tensor.to(dtype) if tensor.is_floating_point() else tensor


@large_frees_returned()
def load_converted(model_dir: Path, config, torch_dtype: torch.dtype, fmt: str,
                   gguf_file: str | Path | None = None) -> tuple[nn.Module, WeightsReport] | None:
    """The CPU model of ``model_dir`` (a checked HF directory of a Llama-family ``config``) with its decoder layers'
    linears in ``fmt``, each converted as it is read; None if the checkpoint cannot be loaded this way."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    index = _SafetensorsIndex(files)
    with init_empty_weights(include_buffers=False):  # buffers (rotary frequencies) are computed, not stored
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    stored = {name: entry[2] for name, entry in index.entries.items()}
    if tied:
        expected.pop("lm_head.weight", None)
        stored.pop("lm_head.weight", None)
    if not index.known or stored != expected:
        return None
    converter = LinearConverter(fmt, config, "cpu", gguf_file)
    embedding = _block_embedding(converter, index, torch_dtype)
    if embedding is not None:
        replace_submodule(model, EMBEDDING, embedding)
        stored.pop(f"{EMBEDDING}.weight")
        trim_heap()
    for name in linear_names(len(model.model.layers), lm_head=True):
        meta = model.get_submodule(name)
        if tied and name == "lm_head":
            # A tied LM head is read from the embedding (it becomes a matrix of its own; the embedding is only
            # looked up): from its blocks where it has them, row chunks at a time.
            read_rows = embedding.rows if embedding is not None else (
                lambda start, stop: index.read_rows(f"{EMBEDDING}.weight", start, stop, torch_dtype))
            replace_submodule(model, name, converter.convert_rows(name, read_rows, (meta.out_features,
                                                                                   meta.in_features)))
            continue
        linear = nn.Linear(meta.in_features, meta.out_features, bias=meta.bias is not None, device="meta")
        linear.weight = nn.Parameter(index.read(f"{name}.weight", torch_dtype), requires_grad=False)
        if meta.bias is not None:
            linear.bias = nn.Parameter(index.read(f"{name}.bias", torch_dtype), requires_grad=False)
        replace_submodule(model, name, converter.convert(name, linear))
        stored.pop(f"{name}.weight")
        stored.pop(f"{name}.bias", None)
        if name.endswith(LAYER_LINEARS[-1]):
            # Each layer's float reads and conversion temporaries are freed, but glibc would keep them in holes
            # between the converted buffers: without this, the int4 SmolLM2 grew by 2.3 MB per linear (+480 MB).
            trim_heap()
    model.load_state_dict({name: index.read(name, torch_dtype) for name in stored}, strict=False, assign=True)
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return None
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    model.eval().requires_grad_(False)
    trim_heap()
    return model, converter.report


def _block_embedding(converter: LinearConverter, index: _SafetensorsIndex, dtype: torch.dtype
                     ) -> Q8_0Embedding | None:
    """The embedding as the GGUF file's own Q8_0 blocks, if the file has them and every row equals the stored one."""
    if EMBEDDING not in converter.blocks:
        return None
    blocks = converter.blocks[EMBEDDING]
    name = f"{EMBEDDING}.weight"
    if name not in index.entries or index.entries[name][2] != blocks.shape:
        return None
    embedding = Q8_0Embedding.from_blocks(blocks.raw(), blocks.shape, dtype)
    if not embedding.equals_rows(lambda start, stop: index.read_rows(name, start, stop, dtype)):
        return None
    converter.report.embedding = blocks.kind
    return embedding
