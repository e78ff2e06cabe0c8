"""Draft-head checkpoints on disk: atomic writes, reading tensors, and loading them only when they fit.

Every head kind (EAGLE, EAGLE-3, Medusa, LDLP) stores `config.json` beside its
tensors and refuses a checkpoint whose tensors disagree with its config with
one clear SpeculaError, instead of a shape error from deep inside torch.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from specula.errors import SpeculaError


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``."""
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes files private; checkpoints are meant to be shared
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_checkpoint(directory: str | Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """Write ``state`` to model.safetensors and ``config`` to config.json in ``directory``, atomically."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}
    atomic_write(directory / "model.safetensors", lambda path: save_file(tensors, path))
    atomic_write(directory / "config.json", lambda path: Path(path).write_text(json.dumps(config, indent=2)))


def read_config(directory: Path, what: str, hint: str = "") -> dict:
    """config.json of a checkpoint directory; ``what`` names it in errors, ``hint`` says how to get one."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise SpeculaError(f"{what} directory {directory} has no config.json{hint}")
    try:
        return json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpeculaError(f"{what} config {config_file} is not valid JSON: {err}") from err


def save_module(module: nn.Module, directory: str | Path, config: dict, dtype: torch.dtype) -> None:
    """A head's tensors (less computed rotary buffers) and its config stamped with ``dtype``, atomically."""
    state = {k: v for k, v in module.state_dict().items() if "rotary_emb" not in k}
    save_checkpoint(directory, state, dict(config, torch_dtype=str(dtype).removeprefix("torch.")))


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Tensors from model.safetensors or pytorch_model.bin in ``directory``."""
    if (directory / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(directory / "model.safetensors"))
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise SpeculaError(f"{directory} holds neither model.safetensors nor pytorch_model.bin")


def load_checked(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Load ``state`` into ``module`` if its names and shapes are exactly those the config implies.

    Rotary-embedding buffers are computed, never stored. ``what`` names the checkpoint in errors.
    """
    expected = {k: v for k, v in module.state_dict().items() if "rotary_emb" not in k}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    if missing or unexpected:
        raise SpeculaError(f"{what} does not match its config: missing {sorted(missing)[:4]}, "
                           f"unexpected {sorted(unexpected)[:4]}")
    for name, tensor in state.items():
        if expected[name].shape != tensor.shape:
            raise SpeculaError(f"{what}: tensor {name} has shape {tuple(tensor.shape)}, its config implies "
                               f"{tuple(expected[name].shape)}")
    module.load_state_dict(state, strict=False)
