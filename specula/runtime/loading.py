"""Loading a local Hugging Face causal LM for Specula: checks, dtype, and the linears in a weight format.

Never touches the network: a directory, a GGUF file (converted once into the cache, `specula.gguf.cache`)
or a model id already in the local Hugging Face cache (`specula.runtime.model_source`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.files.readers import check_fields, check_safetensors, expect_object, open_safetensors
from specula.runtime import converted_cache
from specula.runtime.forward import LLAMA_FAMILY
from specula.runtime.model_source import model_name, resolve_model
from specula.runtime.plain_model import from_transformers
from specula.runtime.streamed_load import load_converted
from specula.runtime.tokenizer import load_tokenizer
from specula.runtime.transformers_logging import quiet_transformers
from specula.runtime.weights import quantize_linear_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | torch.dtype, model_dir: Path) -> torch.dtype:
    """``auto`` means the dtype the weights are stored in; else one of DTYPES."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return _stored_dtype(model_dir)
    if name not in DTYPES:
        raise SpeculaError(f"unknown dtype '{name}'; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _stored_dtype(model_dir: Path) -> torch.dtype:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return torch.float32
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    with open_safetensors(files[0], "weights file") as weights:
        for key in weights.keys():
            stored = names.get(weights.get_slice(key).get_dtype())
            if stored is not None:
                return stored
    return torch.float32


def check_model_dir(path: str | Path, role: str = "model") -> Path:
    """A local directory holding a Hugging Face causal-LM config, or a SpeculaError.

    ``path`` may also be a GGUF file or a model id in the local Hugging Face cache
    (`specula.runtime.model_source.resolve_model`); the directory it stands for is returned.
    """
    model_dir = resolve_model(path, role)
    if not model_dir.is_dir():
        raise SpeculaError(f"{role} directory not found: {path}")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise SpeculaError(f"{role} directory {path} has no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeculaError(f"{role} config {config_file} is not valid JSON: {err}") from err
    check_fields(expect_object(config, f"{role} config {config_file}"), f"{role} config {config_file}")
    return model_dir


def load_causal_lm(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                   role: str = "model"):
    """Load (model, tokenizer) from a local directory; never touches the network."""
    model, tokenizer, _ = load_converted_lm(path, dtype, device, role)
    return model, tokenizer


def load_converted_lm(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                      role: str = "model", weights: str = "float32", gguf_file: str | Path | None = None):
    """Load (model, tokenizer, WeightsReport) with the linears (layers, LM head) in ``weights`` (`runtime.weights`).

    On a CPU, a Llama-family safetensors checkpoint is converted layer by layer as it is read
    (`specula.runtime.streamed_load`: peak memory near the converted model's, not the float model's); otherwise
    the float model is loaded whole and converted after. Never touches the network.
    """
    model_dir = check_model_dir(path, role)
    for file in sorted(model_dir.glob("*.safetensors")):  # a truncated file is named, not a library traceback
        check_safetensors(file, f"{role} weights file")
    torch_dtype = resolve_dtype(dtype, model_dir)
    # A quantized model converted by an earlier load is mapped back in (`specula.runtime.converted_cache`): a plain
    # model (`specula.runtime.plain_model`), so that a warm start imports no `transformers` modelling code.
    kept = converted_cache.entry_path(model_dir, model_name(path), weights, torch_dtype, gguf_file) if (
        converted_cache.enabled(weights, device)) else None
    cached = converted_cache.load(kept) if kept is not None else None
    try:
        if cached is not None:
            model, report, tokenizer = cached
        else:
            with quiet_transformers():
                model, report = _load_and_convert(model_dir, path, role, torch_dtype, weights, device, gguf_file)
                tokenizer = load_tokenizer(model_dir)
    except SpeculaError:
        raise
    except Exception as err:  # torch pickles, tokenizer files and loaders fail in many ways on damaged files
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpeculaError(f"cannot load {role} from {path}: {reason}") from err
    to_device(model, device).eval().requires_grad_(False)
    if kept is not None and cached is None:
        converted_cache.save(kept, converted_cache.Converted(model, report, tokenizer))
    return model, tokenizer, report


def _load_and_convert(model_dir: Path, path: str | Path, role: str, torch_dtype: torch.dtype, weights: str,
                      device: str | torch.device, gguf_file: str | Path | None):
    """(model, WeightsReport): the checkpoint checked, loaded and converted to ``weights``; a Llama-family model
    as a plain model (`specula.runtime.plain_model`) sharing the converted weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise SpeculaError(f"{role} config in {path} cannot be read: {str(err).splitlines()[0]}") from err
    # BERT-like encoders register an "LM head" causal class too, but attend both ways unless built as decoders.
    encoder = type(config) in MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or encoder:
        raise SpeculaError(
            f"{role} in {path} is not a causal language model (model_type '{config.model_type}')"
        )
    converted = None
    if weights != "float32" and config.model_type in LLAMA_FAMILY and torch.device(device).type == "cpu":
        converted = load_converted(model_dir, config, torch_dtype, weights, gguf_file)
    if converted is None:
        # Mismatched shapes are loaded as reinitialised and reported, so that they are refused below by name.
        model, loading = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype, local_files_only=True, attn_implementation="sdpa",
            output_loading_info=True, ignore_mismatched_sizes=True,
        )
        check_loading(loading, role, path)
        to_device(model, device)
        report = quantize_linear_weights(model, weights, lm_head=True, gguf_file=gguf_file)
    else:
        model, report = converted
    return from_transformers(model) or model, report


def to_device(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """``model`` moved to ``device``, or one SpeculaError line where the device cannot take it."""
    try:
        return model.to(device)
    except (RuntimeError, AssertionError) as err:
        raise SpeculaError(f"device '{device}' is not usable: {str(err).splitlines()[0]}") from err


def check_loading(loading: dict, role: str, path: str | Path) -> None:
    """Refuse weights that lack a tensor the architecture expects, hold one of another shape, or unknown ones.

    ``loading`` is the loading info of `from_pretrained(output_loading_info=True)`; transformers already
    leaves out tensors that are legitimately absent (tied weights, ignorable buffers).
    """
    problems = []
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        problems.append(f"{len(missing)} missing tensor{'s' * (len(missing) > 1)} ({', '.join(missing[:3])})")
    mismatched = sorted(loading.get("mismatched_keys") or (), key=lambda entry: str(entry[0]))
    if mismatched:
        name, stored, expected = mismatched[0]
        problems.append(f"{len(mismatched)} tensor{'s' * (len(mismatched) > 1)} of the wrong shape ({name} is "
                        f"{tuple(stored)}, the config implies {tuple(expected)})")
    unexpected = sorted(loading.get("unexpected_keys") or ())
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor{'s' * (len(unexpected) > 1)} "
                        f"({', '.join(unexpected[:3])})")
    if problems:
        raise SpeculaError(f"the weights of {role} {path} do not match its config.json: {'; '.join(problems)}")
