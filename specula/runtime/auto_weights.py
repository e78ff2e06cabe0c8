"""What ``--weights auto`` means for a target on this machine: decided once, in seconds, then cached.

The candidates are the formats every method decodes losslessly (`specula.runtime.weights`): ``q4_1``, ``int4``,
``int8`` and ``float32``; one whose kernel this device lacks is left out (`check_available`), so a machine with
none of the quantized kernels gets float32. ``q4_1`` wins wherever its kernel builds and runs: it had the fastest
step of every format on both CPUs measured with the real target (docs/defaults.md), and timing it here again on
a shared machine would only add noise to a settled question. Without it, the others are timed on the target's own
linear shapes with random weights (a linear's speed does not depend on its values): a decoder layer's fused
q/k/v, o, fused gate/up and down projections, repeated until they outgrow the CPU's caches as a decoding step's
weights do, and part of the LM head; one-token steps and 8-token passes, interleaved across formats, the fastest
round of each (other processes only ever add time). The fastest one-token step wins (what `specula calibrate`
ranks by too). Attention, norms and the embedding cost the same in every format and are left out.

The choice is kept in ``auto-weights-<target>.json`` in Specula's cache (beside the hardware profile and the
converted GGUF models), keyed by machine (`specula.runtime.float32_layout.machine_key`: CPU, vector ISA, torch
version, threads) and device type, with a fingerprint of the target's files: when a file changes (a new GGUF is
another converted directory; a model directory's weights get another size or time) it is decided again.

What decides, in order: an explicit format; the format `specula calibrate` chose in the target's hardware profile
(the full sweep, with agreement and divergence checks); ``$SPECULA_AUTO_WEIGHTS`` (a format, taken instead of
deciding here); this cached decision.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_json
from specula.runtime.float32_layout import machine_key
from specula.runtime.model_source import cache_dir, gguf_source, model_name, resolve_model
from specula.runtime.weights import (
    WEIGHT_FORMATS,
    calibrated_weights,
    check_available,
    quantize_every_linear,
    resolve_weights,
)

ENVIRONMENT_VARIABLE = "SPECULA_AUTO_WEIGHTS"
CANDIDATES = ("q4_1", "int4", "int8", "float32")  # fastest first where timings tie
# Measured with the real target (docs/defaults.md): q4_1's step was the fastest of every format on both CPUs timed.
RULE = "q4_1 where its kernel runs"
RECORD_VERSION = 1
PASS_TOKENS = 8  # the wider pass measured beside one token (a verify pass, a short prefill)
REPEATS = 5  # timed rounds per format, after one warm-up round
# The layers timed hold at least this many bytes in each format (at most all of the target's): beyond a core's
# L2 and most of an L3 slice, so that they stream from memory as a decoding step's weights do.
LAYER_BYTES = 64 << 20
HEAD_ROWS = 8192  # LM-head rows timed (SmolLM2's has 49,152): enough to stream from memory, quick to convert
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf", "config.json")


@dataclass(frozen=True)
class LinearShapes:
    """The linear shapes of a Llama-style target, from its config.json."""

    hidden: int
    attention: int  # query heads x head dim: the o projection's input
    qkv: int  # outputs of q, k and v together
    intermediate: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config: dict) -> LinearShapes | None:
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            head_dim = int(config.get("head_dim") or hidden // heads)
            kv_heads = int(config.get("num_key_value_heads") or heads)
            return cls(hidden, heads * head_dim, (heads + 2 * kv_heads) * head_dim, int(config["intermediate_size"]),
                       int(config["num_hidden_layers"]), int(config["vocab_size"]))
        except (KeyError, TypeError, ValueError):
            return None


def resolve_auto_weights(fmt: str, target: str | Path, device: str | torch.device = "cpu",
                         profile: dict | None = None) -> str:
    """The concrete format ``fmt`` stands for when loading ``target`` on ``device`` (see the module docstring).

    Called once per load (`specula.methods.build_speculator`); measures only when nothing is cached for this
    machine and these target files.
    """
    if fmt != "auto":
        return resolve_weights(fmt)
    calibrated = calibrated_weights(profile, device)
    if calibrated:
        return calibrated
    forced = os.environ.get(ENVIRONMENT_VARIABLE, "")
    if forced:
        if forced not in WEIGHT_FORMATS[1:]:
            raise SpeculaError(f"{ENVIRONMENT_VARIABLE} must be one of {', '.join(WEIGHT_FORMATS[1:])}, not {forced!r}")
        return forced
    return measured_choice(target, device)["choice"]


def record_path(target: str | Path) -> Path:
    return cache_dir() / f"auto-weights-{model_name(target)}.json"


def fingerprint(target: str | Path, model_dir: Path) -> dict:
    """What the choice was measured on: the model directory and the size and time of each of its files (and of the
    GGUF file it was converted from)."""
    files = sorted({file for pattern in WEIGHT_FILES for file in model_dir.glob(pattern)})
    source = gguf_source(target)
    if source is not None:
        files.append(source)
    return {"model": str(model_dir.resolve()),
            "files": {str(file.resolve()): [file.stat().st_size, file.stat().st_mtime_ns] for file in files}}


def measured_choice(target: str | Path, device: str | torch.device = "cpu") -> dict:
    """The cached measurement for ``target`` on this machine and ``device`` type, measured and cached if there is
    none or its target files changed: ``{"choice", "formats": {fmt: {"step_ms", "pass_ms"}}, "unavailable"}``."""
    model_dir = resolve_model(target, "target")  # converts a GGUF once; the load that follows reuses it
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return {"choice": "float32", "formats": {}, "unavailable": {}}  # the load will say what is wrong
    path, key, files = record_path(target), f"{machine_key()} | {torch.device(device).type}", fingerprint(target,
                                                                                                        model_dir)
    records = _read(path)
    entry = records.get(key)
    if isinstance(entry, dict) and entry.get("target") == files and entry.get("choice") in CANDIDATES:
        return entry
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        config = {}
    shapes = LinearShapes.of(config) if isinstance(config, dict) else None
    entry = {"target": files, **choose(shapes, device)}
    _announce(target, entry, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"version": RECORD_VERSION, "machines": {**records, key: entry}}, indent=2)
    except OSError:
        pass  # a read-only cache: the choice holds for this process, measured again next time
    return entry


def choose(shapes: LinearShapes | None, device: str | torch.device) -> dict:
    """q4_1 where its kernel runs on ``device``; else the measured fastest of the others this device has."""
    if shapes is None:  # not a Llama-style config: the quantized formats do not apply (`quantize_linear_weights`)
        return {"choice": "float32", "formats": {}, "unavailable": {"*": "not a Llama-style config"}}
    try:
        check_available("q4_1", device)  # builds the kernel if this machine has no build yet, and runs it once
        return {"choice": "q4_1", "rule": RULE, "formats": {}, "unavailable": {}}
    except SpeculaError as err:
        unavailable = {"q4_1": " ".join(str(err).split()) or type(err).__name__}
    formats, others = measure_formats(shapes, device, CANDIDATES[1:])
    choice = min(formats, key=lambda fmt: (formats[fmt]["step_ms"], CANDIDATES.index(fmt)), default="float32")
    return {"choice": choice, "formats": formats, "unavailable": {**unavailable, **others}}


def _read(path: Path) -> dict:
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}  # none yet, or unreadable: measured again and rewritten whole
    machines = records.get("machines") if isinstance(records, dict) else None
    return machines if isinstance(machines, dict) and records.get("version") == RECORD_VERSION else {}


def _announce(target: str | Path, entry: dict, path: Path) -> None:
    if entry.get("rule"):
        how = f"{RULE}, as here"
    else:
        timings = ", ".join(f"{fmt} {t['step_ms']:.1f} ms" for fmt, t in entry["formats"].items())
        how = f"timed once on this machine, one-token step of its linears: {timings or 'nothing to time'}"
    print(f"specula: --weights auto means {entry['choice']} for {model_name(target)} on this machine ({how}); "
          f"recorded in {path} (`specula calibrate` runs the full sweep)", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the measurement


class _Linears(nn.Module):
    """One decoder layer's linears (q/k/v and gate/up fused, as the runtime fuses them) and `HEAD_ROWS` rows of the
    LM head (its time is scaled to the whole vocabulary: a head streams its rows one after another)."""

    def __init__(self, shapes: LinearShapes, device: torch.device):
        super().__init__()
        generator = torch.Generator().manual_seed(0)

        def linear(n: int, k: int) -> nn.Linear:
            layer = nn.Linear(k, n, bias=False, device="meta")
            layer.weight = nn.Parameter((torch.randn(n, k, generator=generator) * 0.02).to(device),
                                        requires_grad=False)
            return layer

        self.layer = nn.ModuleList([linear(shapes.qkv, shapes.hidden), linear(shapes.hidden, shapes.attention),
                                    linear(2 * shapes.intermediate, shapes.hidden),
                                    linear(shapes.hidden, shapes.intermediate)])
        self.lm_head = linear(min(shapes.vocab, HEAD_ROWS), shapes.hidden)


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _build(fmt: str, shapes: LinearShapes, weights: _Linears) -> tuple[list[nn.ModuleList], nn.Module]:
    """``fmt``'s modules: enough copies of one layer to outgrow the caches (at most the target's layer count)."""
    linears = copy.deepcopy(weights)
    quantize_every_linear(linears, fmt)  # the loader's own conversion: a kernel the device lacks raises here
    copies = max(1, min(shapes.layers, math.ceil(LAYER_BYTES / max(1, _bytes(linears.layer)))))
    return [linears.layer] + [copy.deepcopy(linears.layer) for _ in range(copies - 1)], linears.lm_head


def measure_formats(shapes: LinearShapes, device: str | torch.device = "cpu",
                    formats: tuple[str, ...] = CANDIDATES) -> tuple[dict, dict]:
    """Milliseconds of the target's linears in each of ``formats`` (the fastest round), scaled from the layers and
    head rows timed to all of the target's: ``({fmt: {"step_ms", "pass_ms"}}, {fmt: why it is unavailable})``,
    ``pass_ms`` for `PASS_TOKENS` tokens."""
    device = torch.device(device)
    built, unavailable = {}, {}
    weights = _Linears(shapes, device)
    for fmt in formats:
        try:
            built[fmt] = _build(fmt, shapes, weights)
        except (SpeculaError, RuntimeError, ValueError, NotImplementedError) as err:
            unavailable[fmt] = " ".join(str(err).split()) or type(err).__name__
    generator = torch.Generator().manual_seed(1)
    inputs = {rows: {width: torch.randn(rows, width, generator=generator).to(device)
                     for width in (shapes.hidden, shapes.attention, shapes.intermediate)} for rows in (1, PASS_TOKENS)}

    def one_pass(layers: list[nn.ModuleList], head: nn.Module, rows: int) -> tuple[float, float]:
        x = inputs[rows]
        start = time.perf_counter()
        for qkv, o, gate_up, down in layers:
            qkv(x[shapes.hidden]), o(x[shapes.attention]), gate_up(x[shapes.hidden]), down(x[shapes.intermediate])
        _synchronize(device)
        middle = time.perf_counter()
        head(x[shapes.hidden])
        _synchronize(device)
        return middle - start, time.perf_counter() - middle

    laps: dict[str, dict[int, list[tuple[float, float]]]] = {fmt: {1: [], PASS_TOKENS: []} for fmt in built}
    with torch.inference_mode():
        for _ in range(REPEATS + 1):  # interleaved, so that a busy moment of the machine hits every format
            for fmt, (layers, head) in built.items():
                for rows in (1, PASS_TOKENS):
                    laps[fmt][rows].append(one_pass(layers, head, rows))
    results = {}
    for fmt, (layers, _) in built.items():
        # The layers and head rows not timed cost what those timed cost each. The fastest round counts: other
        # processes on the machine only ever add time.
        layer_scale, head_scale = shapes.layers / len(layers), shapes.vocab / min(shapes.vocab, HEAD_ROWS)
        ms = {rows: round(1e3 * (min(lap[0] for lap in laps[fmt][rows][1:]) * layer_scale
                                 + min(lap[1] for lap in laps[fmt][rows][1:]) * head_scale), 3)
              for rows in (1, PASS_TOKENS)}
        results[fmt] = {"step_ms": ms[1], "pass_ms": ms[PASS_TOKENS], "layers_timed": len(layers)}
    return results, unavailable


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
