"""Targets converted to a quantized weight format, kept in the cache so that a later load skips the conversion.

Converting SmolLM2-135M to q4_1 (reading the GGUF's blocks, checking them against the loaded weights, packing them
into the kernel's layout) costs far more than the step it speeds up: 15-30 s on a 2-core CPU, against a few
hundred milliseconds to map the converted model back in. So the first load in a format saves the converted model
and its tokenizer (`Converted`, `torch.save`) to ``converted/<target>-<format>-<threads>t-<key>.pt`` in Specula's
cache, and later loads map it (`torch.load(mmap=True)`: its tensors are read as the steps touch them).

The key covers everything the saved objects depend on: the target's files (weights, configs and tokenizer files:
size and time of each, and the GGUF file they came from), the format and dtype, this machine
(`float32_layout.machine_key`: the int4 packing differs between CPUs), the torch and transformers versions, and the
source of the modules that convert the weights and define the saved modules (`SOURCES`). A new key replaces the
target's older entry in that format and thread count. The file holds pickled objects, so it is only read from
Specula's own cache, which holds the kernels it loads as code already. ``SPECULA_CONVERTED_CACHE=0`` turns it off.
A file that cannot be read is converted again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from specula.files.outputs import atomic_write
from specula.runtime.float32_layout import machine_key
from specula.runtime.model_source import cache_dir
from specula.runtime.weights import WeightsReport

ENVIRONMENT_VARIABLE = "SPECULA_CONVERTED_CACHE"
PACKAGE = Path(__file__).resolve().parent.parent
# What converts the weights and defines the modules saved (a change to other modules, e.g. the packed forward, keeps
# the kept conversions).
SOURCES = ("runtime/weights.py", "runtime/quantized_linear.py", "runtime/streamed_load.py", "runtime/loading.py",
           "runtime/plain_model.py", "runtime/tokenizer.py",
           "gguf/blocks.py", "gguf/block_embedding.py", "kernels/__init__.py", "kernels/q4_1.py", "kernels/q4_1.cpp")
# Every file the saved entry was made from: weights, configs (the plain model holds the config and the generation
# config's values) and the tokenizer's files (the entry holds the loaded tokenizer too).
SOURCE_FILES = ("*.safetensors", "*.bin", "config.json", "generation_config.json", "tokenizer*.json",
                "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt",
                "*.model")


class Converted(NamedTuple):
    """What a warm load needs: the converted model (a plain model for the Llama family,
    `specula.runtime.plain_model`), its weights report, and the tokenizer (a `specula.runtime.tokenizer.PlainTokenizer`
    where it answers as the transformers one: loading that through `AutoTokenizer` costs ~1 s of imports)."""

    model: torch.nn.Module
    report: WeightsReport
    tokenizer: object


def enabled(weights: str, device: torch.device | str) -> bool:
    """Whether a load in ``weights`` on ``device`` goes through the cache: quantized formats on a CPU (float32 is the
    stored model, mapped as it is)."""
    return weights != "float32" and torch.device(device).type == "cpu" and os.environ.get(ENVIRONMENT_VARIABLE) != "0"


@functools.cache
def source_digest() -> str:
    """A hash of the modules that convert and run the weights: any change to them converts again."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (PACKAGE / name).read_bytes())
    return digest.hexdigest()


def entry_path(model_dir: Path, name: str, weights: str, dtype: torch.dtype, gguf_file: Path | None) -> Path:
    """Where the model in ``model_dir`` converted to ``weights`` is kept (see the module docstring for the key)."""
    files = {f for pattern in SOURCE_FILES for f in model_dir.glob(pattern)}
    if gguf_file is not None:
        files.add(Path(gguf_file))
    described = {"model": str(model_dir.resolve()), "weights": weights, "dtype": str(dtype), "machine": machine_key(),
                 "transformers": importlib.metadata.version("transformers"), "source": source_digest(),
                 "files": {str(f.resolve()): [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(files)}}
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]
    # The thread count is part of the machine key (a float32 layout is chosen per count) and also of the name, so
    # that a newer entry replaces only the one of its own thread count: `generate` (one thread on a 2-CPU machine)
    # and `serve` (torch's setting) would otherwise throw each other's conversion away on every start.
    return cache_dir() / "converted" / f"{name}-{weights}-{torch.get_num_threads()}t-{key}.pt"


def load(path: Path) -> Converted | None:
    """The converted model, its report and its tokenizer saved at ``path``, or None (none yet, or unreadable:
    converted again)."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, weights_only=False, mmap=True)  # our own file in our own cache (module docstring)
        kept = Converted(saved["model"], saved["report"], saved["tokenizer"])
    except Exception:  # a truncated or stale file fails in many ways; converting again is always correct
        return None
    return kept if isinstance(kept.model, torch.nn.Module) and isinstance(kept.report, WeightsReport) else None


def save(path: Path, kept: Converted) -> None:
    """Save the converted model (replacing this target's older entry in the format); a failure costs only time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = path.name.rsplit("-", 1)[0] + "-"
        for older in path.parent.glob(f"{prefix}*.pt"):
            if older != path:
                older.unlink(missing_ok=True)
        atomic_write(path, lambda tmp: torch.save(kept._asdict(), tmp))
    except Exception as err:  # a full disk, a module that cannot be pickled: the next load converts again
        print(f"specula: could not keep the converted model in {path.parent}: {' '.join(str(err).split())}",
              file=sys.stderr, flush=True)
