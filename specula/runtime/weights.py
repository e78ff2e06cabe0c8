"""Weight formats of the target: its linear weights as float32, bfloat16, int8, int4 or q4_1.

`quantize_linear_weights(model, fmt)` replaces the q/k/v/o and gate/up/down
projections of every decoder layer (and, with ``lm_head=True``, the LM head) by
weight-only modules of `specula.runtime.quantized_linear`; embeddings, norms, attention
and the KV cache keep the model's dtype. `Target.load` converts the LM head too: on
SmolLM2-135M its 49,152 × 576 float32 matrix is 108 MiB read per token, a third of an
int4 step (one-token forward, 2 threads, AMD EPYC AVX2: int4 44 → 33 ms with the head in
int4). A tied head then stops sharing its weight with the embedding, which stays float. The formats:

- ``float32``: the weights as loaded (in the ``dtype`` the model was loaded in); float32 layers on a CPU
  become `Float32Linear`s on the same parameters where that matmul layout is the faster one on this CPU
  (`specula.runtime.float32_layout` measures it once per machine: on an AMD EPYC it halves a step, on an Intel
  Xeon it would nearly triple it);
- ``bfloat16``: weights cast to bfloat16, the matmul in bfloat16;
- ``int8``: symmetric int8 with one scale per output channel (``_weight_int8pack_mm``), computed in
  bfloat16 (activations cast in and out of each layer; see `KERNEL_DTYPE`);
- ``int4``: asymmetric int4 with a scale and a zero per 32 inputs (torch's int4 kernels), computed in
  bfloat16 like int8 (so the scales and zeros are bfloat16 numbers too). When the
  model was converted from a GGUF file whose tensors are Q4_0/Q4_1 blocks, ``gguf_file`` carries
  those blocks into the kernel's groups unchanged (`specula.gguf.blocks`), so the int4 model is the
  file's own model rather than a requantization of it.
- ``q4_1``: the same 4-bit groups as GGUF Q4_1 blocks, multiplied by Specula's own AVX2 kernel with the
  activations rounded to 8-bit codes per 32 inputs, as llama.cpp computes (`specula.kernels.q4_1`, built on
  the machine with its C++ compiler; CPU only; a 512-bit path with the same results where the CPU has
  AVX-512 VNNI). Measured on SmolLM2-135M (one token, 2 threads, AMD EPYC AVX2): its matmuls take half the
  time of ``int4``'s, and a k-token pass grows more slowly with k.
- ``auto``: the format `specula calibrate` chose for this target on this device type and recorded in
  its hardware profile (``auto_weights``): the fastest one-token step among the formats whose greedy
  output matched vanilla's with no real divergence (`specula.bench.calibrate.choose_weights`). Which
  format wins is a property of the machine (on an AVX2 CPU without AVX-512 int4 beats float32 by 2.4x,
  on a GPU bfloat16 may win), so there is no fixed answer: without a profile, ``auto`` is float32.

Losslessness is relative to the target *with these weights*: every method decodes exactly what
vanilla decoding of the same quantized target decodes (up to floating-point near-ties between a
one-token and a many-token forward). Quantization changes the model itself, not the method.

A format whose kernel the device lacks is refused with a SpeculaError naming the device, found by
running the kernel once on a tiny input before any layer is converted.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specula.errors import SpeculaError
from specula.gguf.blocks import EMBEDDING, carried_groups, read_linear_blocks
from specula.kernels.float32 import kernel as float32_kernel
from specula.kernels.q4_1 import unavailable_reason
from specula.runtime.float32_layout import columns_layout_pays
from specula.runtime.heap import trim_heap
from specula.runtime.profile import measured_on
from specula.runtime.quantized_linear import (
    GROUP_SIZE,
    BFloat16Linear,
    Float32Linear,
    Int4Groups,
    Int4Linear,
    Int8Linear,
    Q4_1Linear,
    int4_groups,
    int4_groups_of_rows,
)

WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4", "q4_1")
# Formats whose weights are 4-bit groups: a GGUF file's Q4_0/Q4_1 blocks carry into them unchanged.
GROUPED_FORMATS = ("int4", "q4_1")
# torch's int8/int4 CPU kernels are vectorized only for bfloat16 on AVX2 CPUs (10x slower in float32, see
# specula.runtime.quantized_linear); the CUDA int4 kernel takes nothing else.
KERNEL_DTYPE = torch.bfloat16
# 1 MiB of float32, twice a core's L2 here: SmolLM2-135M's smallest fused projection (q/k/v, 576 x 960) is over it.
FLOAT32_LAYOUT_MIN_ELEMENTS = 1 << 18
AUTO_FORMAT = "float32"  # what auto means until `specula calibrate` has chosen on this machine
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def resolve_weights(fmt: str, profile: dict | None = None, device: str | torch.device = "cpu") -> str:
    """The concrete format ``fmt`` stands for, or a SpeculaError for an unknown one.

    ``auto`` is the format `specula calibrate` recorded in ``profile`` (the target's hardware profile,
    `specula.runtime.profile.load_profile`) for ``device``'s type, else `AUTO_FORMAT`.
    """
    if fmt not in WEIGHT_FORMATS:
        raise SpeculaError(f"unknown weights format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if fmt != "auto":
        return fmt
    return calibrated_weights(profile, device) or AUTO_FORMAT


def calibrated_weights(profile: dict | None, device: str | torch.device = "cpu") -> str | None:
    """The format calibration chose in ``profile`` for this device type, or None if it has not chosen one."""
    if not measured_on(profile, str(device)):
        return None
    choice = (profile.get("auto_weights") or {}).get("choice")
    return choice if choice in WEIGHT_FORMATS[1:] else None


@dataclass
class WeightsReport:
    """What `quantize_linear_weights` did.

    converted:   modules replaced, by name.
    carried:     modules whose int4 groups are the GGUF file's own blocks, by name → block type.
    requantized: modules quantized from their float weights.
    bytes_before / bytes_after: storage of the replaced modules' weights (and scales).
    embedding:   the GGUF block type the embedding is kept in (`specula.gguf.block_embedding`), None if float.
    """

    format: str
    converted: list[str] = field(default_factory=list)
    carried: dict[str, str] = field(default_factory=dict)
    requantized: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    embedding: str | None = None

    def summary(self) -> str:
        text = f"{self.format}: {len(self.converted)} linear layers"
        if self.carried:
            text += f", {len(self.carried)} carried from GGUF blocks"
        if self.bytes_before:
            text += f", {self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB"
        if self.embedding:
            text += f"; embedding kept as the file's {self.embedding} blocks"
        return text


def _tensor_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def check_available(fmt: str, device: torch.device | str, compute_dtype: torch.dtype = KERNEL_DTYPE) -> None:
    """Run ``fmt``'s kernel once on a tiny input on ``device``; a SpeculaError if the device lacks it."""
    if fmt in ("float32", "auto"):
        return
    if fmt == "q4_1":
        if reason := unavailable_reason(device):
            raise SpeculaError(f"q4_1 weights are not available: {reason}; use --weights int4 or float32")
    probe = nn.Linear(GROUP_SIZE, 16, bias=False).to(device=device, dtype=torch.float32)
    try:
        module = _convert(probe, fmt, compute_dtype, None)
        module(torch.ones(2, GROUP_SIZE, device=device))
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpeculaError(f"{fmt} weights are not available on device '{torch.device(device)}' with this torch "
                           f"build ({torch.__version__}): {reason}; use --weights float32 or bfloat16") from err


def _convert(linear: nn.Module, fmt: str, compute_dtype: torch.dtype, groups) -> nn.Module:
    if fmt == "bfloat16":
        return BFloat16Linear(linear)
    if fmt == "int8":
        return Int8Linear.from_linear(linear, compute_dtype)
    if fmt in GROUPED_FORMATS:
        groups = groups if groups is not None else int4_groups(linear.weight)
        return _from_groups(fmt, groups, linear.bias, compute_dtype, linear.weight.device)
    raise SpeculaError(f"unknown weights format {fmt!r}")


def _from_groups(fmt: str, groups: Int4Groups, bias: torch.Tensor | None, compute_dtype: torch.dtype,
                 device: torch.device | str) -> nn.Module:
    if fmt == "int4":
        return Int4Linear(groups, bias, compute_dtype, device)
    return Q4_1Linear(groups, bias)


def linear_names(n_layers: int, lm_head: bool = False) -> list[str]:
    """The modules a format replaces in a Llama-family model of ``n_layers`` decoder layers."""
    names = [f"model.layers.{i}.{name}" for i in range(n_layers) for name in LAYER_LINEARS]
    return names + ["lm_head"] if lm_head else names


class LinearConverter:
    """Converts linear layers into one format one at a time, recording what it did in ``report``.

    Made once per model (it checks the kernel and reads a GGUF file's blocks once); `convert` then takes
    each layer, so a loader can quantize a layer as soon as it has read it (`specula.runtime.streamed_load`).
    """

    def __init__(self, fmt: str, config, device: torch.device | str = "cpu", gguf_file: str | Path | None = None,
                 compute_dtype: torch.dtype = KERNEL_DTYPE):
        self.fmt = resolve_weights(fmt)
        self.config = config
        self.compute_dtype = compute_dtype
        self.report = WeightsReport(self.fmt)
        if self.fmt != "float32":
            check_available(self.fmt, device, compute_dtype)
        self.blocks = {}
        if self.fmt != "float32" and gguf_file is not None:
            blocks = read_linear_blocks(gguf_file, bool(getattr(config, "tie_word_embeddings", False)))
            trim_heap()  # the reader parsed the whole vocabulary into Python objects (SmolLM2: ~160 MB, freed)
            # Linears' blocks carry into the 4-bit formats only; a Q8_0 embedding's suit every format that gives
            # the LM head a matrix of its own (`specula.runtime.streamed_load`).
            self.blocks = {name: found for name, found in blocks.items()
                           if self.fmt in GROUPED_FORMATS or name == EMBEDDING}

    def convert(self, name: str, linear: nn.Linear) -> nn.Module:
        """The module replacing ``linear`` (the module called ``name`` in the model) in this format."""
        groups = _carried(name, linear, self.blocks[name], self.config) if name in self.blocks else None
        if groups is not None:
            self.report.carried[name] = self.blocks[name].kind
        elif self.fmt in ("int8", *GROUPED_FORMATS):
            self.report.requantized.append(name)
        return self._converted(name, _tensor_bytes(linear), _convert(linear, self.fmt, self.compute_dtype, groups))

    def convert_rows(self, name: str, read_rows: Callable[[int, int], torch.Tensor], shape: tuple[int, int],
                     device: torch.device | str = "cpu") -> nn.Module:
        """The module replacing the bias-free linear ``name`` whose weight of ``shape`` [N, K] is read
        ``read_rows(start, stop)`` → [stop - start, K] at a time: the 4-bit formats quantize it chunk by chunk
        and never hold it whole in float (an LM head tied to a block embedding, `specula.gguf.block_embedding`);
        the other formats read it whole."""
        if self.fmt not in GROUPED_FORMATS or name in self.blocks:
            linear = nn.Linear(shape[1], shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(read_rows(0, shape[0]), requires_grad=False)
            return self.convert(name, linear)
        self.report.requantized.append(name)
        first = read_rows(0, 1)
        replacement = _from_groups(self.fmt, int4_groups_of_rows(read_rows, shape), None, self.compute_dtype, device)
        return self._converted(name, shape[0] * shape[1] * first.element_size(), replacement)

    def _converted(self, name: str, bytes_before: int, replacement: nn.Module) -> nn.Module:
        self.report.bytes_before += bytes_before
        self.report.bytes_after += _tensor_bytes(replacement)
        self.report.converted.append(name)
        return replacement


def quantize_linear_weights(model: nn.Module, fmt: str, lm_head: bool = False,
                            gguf_file: str | Path | None = None,
                            compute_dtype: torch.dtype = KERNEL_DTYPE) -> WeightsReport:
    """Replace the decoder layers' linear layers of a Llama-family ``model`` (in place) by ``fmt`` modules.

    lm_head:   also replace the LM head (a tied head stops sharing its weight with the embedding).
    gguf_file: the GGUF file the model was converted from; with ``int4``/``q4_1``, its Q4_0/Q4_1 tensors are
               carried block for block (checked against the loaded weights; a tensor that does not
               match is requantized instead and left out of ``carried``).
    compute_dtype: the dtype int8/int4 kernels run in (their scales are stored in it); bfloat16 is the fast
               one, float32 keeps activations exact (for checks: ~10x slower on an AVX2 CPU).
    """
    fmt = resolve_weights(fmt)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if fmt == "float32":
        if layers is not None:
            _use_float32_layout(model, linear_names(len(layers), lm_head))
        return WeightsReport(fmt)
    if layers is None:
        raise SpeculaError(f"--weights {fmt} needs a Llama-family model (decoder layers at model.layers); "
                           f"{type(model).__name__} has none")
    converter = LinearConverter(fmt, model.config, next(model.parameters()).device, gguf_file, compute_dtype)
    for name in linear_names(len(layers), lm_head):
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            continue  # already converted, or a layer kind this does not know
        replacement = converter.convert(name, linear)
        replace_submodule(model, name, replacement)
    if converter.report.converted:
        del linear, replacement  # the last replaced layer would keep the file mapping alive
        _release_loaded_memory(model)
    return converter.report


def quantize_every_linear(module: nn.Module, fmt: str, compute_dtype: torch.dtype = KERNEL_DTYPE) -> WeightsReport:
    """Replace every `nn.Linear` inside ``module`` (in place) by a ``fmt`` module; for draft heads.

    A draft head's numbers only decide what is proposed, never what is output (the target verifies every
    token), so its format is a matter of speed alone: drafting follows the target's format.
    """
    fmt = resolve_weights(fmt)
    if fmt == "float32":
        _use_float32_layout(module, [n for n, m in module.named_modules() if isinstance(m, nn.Linear)])
        return WeightsReport(fmt)
    device = next(itertools.chain(module.parameters(), module.buffers())).device
    converter = LinearConverter(fmt, None, device, compute_dtype=compute_dtype)
    for name, linear in [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Linear)]:
        replace_submodule(module, name, converter.convert(name, linear))
    return converter.report


def _use_float32_layout(model: nn.Module, names: list[str]) -> None:
    """Swap the float32 CPU `nn.Linear` layers called ``names`` for `Float32Linear`s on the same parameters
    (faster matmuls for the few rows of a decoding step; the weights and the model stay the same).

    Only on a CPU where that layout is the faster one (`specula.runtime.float32_layout`, measured once per machine), and
    only weights of at least `FLOAT32_LAYOUT_MIN_ELEMENTS`: the layout pays where a step streams the weight from
    memory; a small one stays in cache and its extra operations cost more than they save (one row through a
    64 x 64 weight: 8 us with ``F.linear``, 69 us as two columns).
    """
    cpu_float32 = [name for name in names if _streams_from_memory(model.get_submodule(name), 0)]
    if not cpu_float32:
        return  # no float32 CPU linear (a GPU target): no CPU kernel to build
    if float32_kernel() is not None:  # the row-invariant kernel: every float32 CPU linear, whatever its size
        large_cpu_float32 = cpu_float32
    else:
        large_cpu_float32 = [name for name in cpu_float32 if _streams_from_memory(model.get_submodule(name))]
    if not large_cpu_float32 or (float32_kernel() is None and not columns_layout_pays()):
        return
    for name in large_cpu_float32:
        replace_submodule(model, name, Float32Linear.sharing(model.get_submodule(name)))


def _streams_from_memory(linear: nn.Module, least: int = FLOAT32_LAYOUT_MIN_ELEMENTS) -> bool:
    """A plain float32 CPU `nn.Linear` of at least ``least`` weights (large enough that a decoding step streams its
    weight from memory)."""
    return (type(linear) is nn.Linear and linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"
            and linear.weight.numel() >= least)


def replace_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where ``model.get_submodule(name)`` is."""
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attribute, module)


def _release_loaded_memory(model: nn.Module) -> None:
    """Give the memory of the replaced float weights back to the operating system.

    `transformers` memory-maps safetensors files: the float weights read while quantizing stay resident as
    long as any tensor (the embedding, the norms) still lives in that mapping, so those are copied into
    memory of their own, which unmaps the file. Freed heap memory is then trimmed (glibc keeps it otherwise).
    Measured on SmolLM2-135M with int4 weights: resident memory after loading 873 -> 576 MiB.
    """
    copies: dict[tuple, torch.Tensor] = {}
    done: set[int] = set()
    quantized = (BFloat16Linear, Int8Linear, Int4Linear, Q4_1Linear)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, quantized):
                continue
            for param in module.parameters(recurse=False):
                if id(param) in done:  # a tied weight seen from its other module
                    continue
                done.add(id(param))
                key = (param.data_ptr(), tuple(param.shape), tuple(param.stride()))  # distinct tensors sharing
                if key not in copies:
                    copies[key] = param.detach().clone()
                param.data = copies[key]
    copies.clear()
    gc.collect()
    trim_heap()


def _carried(name: str, linear: nn.Linear, blocks, config):
    """The GGUF groups for ``name`` if they reproduce the loaded weight, else None."""
    heads = None
    if name.endswith("q_proj"):
        heads = config.num_attention_heads
    elif name.endswith("k_proj"):
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return carried_groups(blocks, linear.weight, heads)
