"""Draft-head checkpoints on disk: atomic writes, reading tensors, and loading them only when they fit.

Every head kind (EAGLE, EAGLE-3, Medusa, LDLP) stores `config.json` beside its
tensors and refuses a checkpoint whose tensors disagree with its config with
one clear SpeculaError, instead of a shape error from deep inside torch; a
config of the wrong JSON type and a truncated weights file are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write
from specula.files.readers import check_fields, expect_object, load_safetensors, load_torch

Module = TypeVar("Module", bound=nn.Module)


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
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeculaError(f"{what} config {config_file} is not valid JSON: {err}") from err
    where = f"{what} config {config_file}"
    return check_fields(expect_object(config, where), where)


def build_module(cls: Callable[[dict], Module], config: dict, what: str) -> Module:
    """``cls(config)``, with a config that type-checks but still cannot build the module refused by name."""
    try:
        return cls(config)
    except (TypeError, ValueError, KeyError, RuntimeError, ZeroDivisionError, AttributeError) as err:
        raise SpeculaError(f"{what}: its config.json does not describe a valid head ({err})") from err


def save_module(module: nn.Module, directory: str | Path, config: dict, dtype: torch.dtype) -> None:
    """A head's tensors (less computed rotary buffers) and its config stamped with ``dtype``, atomically."""
    state = {k: v for k, v in module.state_dict().items() if "rotary_emb" not in k}
    save_checkpoint(directory, state, dict(config, torch_dtype=str(dtype).removeprefix("torch.")))


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Tensors from model.safetensors or pytorch_model.bin in ``directory``."""
    if (directory / "model.safetensors").is_file():
        return load_safetensors(directory / "model.safetensors", "head weights")
    if (directory / "pytorch_model.bin").is_file():
        state = load_torch(directory / "pytorch_model.bin", "head weights")
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise SpeculaError(f"{directory / 'pytorch_model.bin'} is not a state dict of tensors")
        return state
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
        # load_state_dict would silently cast integer tensors into float weights (and back).
        if expected[name].dtype.is_floating_point != tensor.dtype.is_floating_point:
            raise SpeculaError(f"{what}: tensor {name} is stored as {str(tensor.dtype).removeprefix('torch.')}, "
                               f"the head needs {str(expected[name].dtype).removeprefix('torch.')}")
    module.load_state_dict(state, strict=False)
