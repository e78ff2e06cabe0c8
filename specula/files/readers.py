"""Reading files a user hands us: damage becomes one SpeculaError naming the file, never a library traceback.

safetensors. Opening a file's header checks that it is well formed and that its
tensors cover the file exactly, which is what a truncated download, a full disk
or a file of the wrong kind breaks; `check_safetensors` does only that (cheap:
no tensor is read), `open_safetensors` returns the lazy handle, `load_safetensors`
reads every tensor. `load_torch` does the same for a torch pickle (``weights_only``).

JSON. `read_json_object` insists on a JSON object; `check_fields` checks the
types of the fields a config may carry (a size must be a positive whole number,
an epsilon a number, ...), so a config of the wrong shape is refused by name
instead of failing later as a TypeError deep inside a model constructor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from specula.errors import SpeculaError


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def open_safetensors(path: str | Path, what: str = "weights file"):
    """A `safetensors.safe_open` handle on ``path`` (framework pt), or a SpeculaError if the file is damaged."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # SafetensorError, OSError: truncated, empty, not safetensors, unreadable
        raise SpeculaError(f"{what} {path} is damaged or not a safetensors file ({_first_line(err)}); "
                           "replace it with a complete copy") from err


def check_safetensors(path: str | Path, what: str = "weights file") -> None:
    """Refuse a truncated or malformed safetensors file without reading its tensors."""
    with open_safetensors(path, what):
        pass


def load_safetensors(path: str | Path, what: str = "weights file") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on the CPU."""
    handle = open_safetensors(path, what)
    try:
        with handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as err:
        raise SpeculaError(f"{what} {path} cannot be read ({_first_line(err)})") from err


def load_torch(path: str | Path, what: str = "file") -> Any:
    """A torch file loaded with ``weights_only=True`` (no code runs), or a SpeculaError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and torch errors alike for a truncated or foreign file
        raise SpeculaError(f"{what} {path} is damaged or not a torch file ({_first_line(err)})") from err


def read_json_object(path: str | Path, what: str = "JSON file") -> dict:
    """The JSON object in ``path``; a missing, unreadable, malformed or non-object file is a SpeculaError."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeculaError(f"{what} {path} is not valid JSON: {err}") from err
    return expect_object(value, f"{what} {path}")


def expect_object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise SpeculaError(f"{where} must be a JSON object, not {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# Field kinds: "size" a whole number >= 1, "count" a whole number >= 0, "number" a finite number,
# "positive" a finite number > 0, "bool", "str", "object", "list".
MODEL_FIELDS = {
    "hidden_size": "size", "vocab_size": "size", "num_hidden_layers": "size", "num_attention_heads": "size",
    "num_key_value_heads": "size", "intermediate_size": "size", "max_position_embeddings": "size",
    "head_dim": "size", "draft_vocab_size": "size", "target_hidden_size": "size", "embedding_size": "size",
    "max_draft_length": "size", "medusa_num_heads": "size", "medusa_num_layers": "count",
    "rms_norm_eps": "positive", "rope_theta": "positive", "penalty": "number",
    "bias": "bool", "tie_word_embeddings": "bool", "model_type": "str", "hidden_act": "str",
    "eagle_config": "object", "rope_scaling": "object", "architectures": "list",
}


def _fits(kind: str, value: Any) -> bool:
    whole = isinstance(value, int) and not isinstance(value, bool)
    number = (whole or isinstance(value, float)) and math.isfinite(value)
    return {
        "size": whole and value >= 1, "count": whole and value >= 0, "number": number,
        "positive": number and value > 0, "bool": isinstance(value, bool), "str": isinstance(value, str),
        "object": isinstance(value, dict), "list": isinstance(value, list),
    }[kind]


DESCRIPTIONS = {"size": "a whole number >= 1", "count": "a whole number >= 0", "number": "a finite number",
                "positive": "a finite number > 0", "bool": "true or false", "str": "a string",
                "object": "a JSON object", "list": "a JSON list"}


def check_fields(config: dict, where: str, fields: dict[str, str] = MODEL_FIELDS) -> dict:
    """Refuse a config whose known fields have the wrong type; null is accepted (the field's default)."""
    for name, kind in fields.items():
        value = config.get(name)
        if value is not None and not _fits(kind, value):
            raise SpeculaError(f"{where}: '{name}' must be {DESCRIPTIONS[kind]}, got {json.dumps(value)[:40]}")
    return config
