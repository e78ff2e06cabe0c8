"""A target's decoder layers through the native stack (`specula.kernels.decoder`) where it computes their bits.

An eager step of SmolLM2 in q4_1 spends about half its time in Python around ~60 small torch calls a layer
(one thread, AMD EPYC: 16.8 ms a one-token step, 7.8 ms of it in the q4_1 matmuls). The native stack computes the
same arithmetic from C++ in one call per block: the same q4_1 (or float32), attention, mean and SiLU ops, the rest
as plain loops (`decoder.cpp` says which). It takes a block only where the Python path
(`specula.runtime.static_cache.decoder_layer_step`) would compute exactly that: float32 states on a CPU, every
linear a bias-free `Q4_1Linear`, or a bias-free `Float32Linear` multiplied by the row-invariant float32 kernel
(`specula.kernels.float32`), stacked as q/k/v and gate/up, RMS norms and SiLU as in `transformers`' Llama, the
Llama rotary function, no sliding window or per-head norm, and a block the cached-attention kernel attends (at
most `KERNEL_ROWS` rows, not a prompt from an empty cache). Anything else runs from Python as before.

The stack holds the tensors it was built from: `LlamaFamilyRuntime.refresh_fused` rebuilds it when any of a layer's
seven linears is replaced (a requantization); norm weights are read once (nothing here swaps them). It runs without
Python between its layers, so a busy Python thread in the same process (the server's event loop) costs a step little:
with a pure-Python loop spinning beside it, 50 one-token SmolLM2 steps took 13.4 s through the stack, while the
Python layers had not finished them after 10 minutes (each of their ~1,800 calls a step waits for the GIL).
"""

from __future__ import annotations

import sys

import torch

from specula.errors import SpeculaError
from specula.kernels import attention, decoder
from specula.kernels.float32 import kernel as float32_kernel
from specula.runtime.quantized_linear import Float32Linear, Q4_1Linear
from specula.runtime.static_cache import (
    ELEMENTWISE_GRAIN,
    KERNEL_ROWS,
    VECTOR_STEP,
    FusedProjections,
    Segment,
    StaticKVCache,
)

# Modules whose norm computes weight * (x * rsqrt(mean(x^2) + eps)) in float32 (`plain_model.RMSNorm` mirrors them).
NORMS = {"RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
ACTIVATIONS = {"SiLU", "SiLUActivation"}  # torch's, and transformers' (F.silu)
# Modelling files whose apply_rotary_pos_emb is q * cos + rotate_half(q) * sin with cos, sin unsqueezed at 1.
ROTARY_MODULES = {"specula.runtime.plain_model", "transformers.models.llama.modeling_llama",
                  "transformers.models.mistral.modeling_mistral", "transformers.models.qwen2.modeling_qwen2"}


class NativeDecoder:
    """The native stack built from a runtime's layers; `takes` says which blocks it runs."""

    def __init__(self, stack, layer_count: int):
        self.stack = stack
        self.layer_count = layer_count

    @classmethod
    def build(cls, layers: list, fused: list[FusedProjections], windows: list, apply_rope,
              cache: StaticKVCache) -> NativeDecoder | None:
        """The stack for these layers (their stacked projections ``fused``), or None where any of them is not one
        it computes bit for bit, or the native stack or the attention kernel cannot run here."""
        keys = cache.keys[0]
        if (decoder.disabled() or keys.device.type != "cpu" or keys.dtype != torch.float32
                or any(w is not None for w in windows) or getattr(apply_rope, "__module__", None) not in ROTARY_MODULES
                or attention.kernel() is None):
            return None
        weights, sizes, floats = [], [], []
        shapes = set()
        for layer, projections in zip(layers, fused, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            linears = [projections.qkv, attn.o_proj, projections.gate_up, getattr(mlp, "down_proj", None)]
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if (hasattr(attn, "q_norm") or type(getattr(mlp, "act_fn", None)).__name__ not in ACTIVATIONS
                    or not all(_native_linear(linear) for linear in linears)
                    or not all(type(norm).__name__ in NORMS and norm.weight.dtype == torch.float32 for norm in norms)
                    or attn.head_dim % 8 or projections.qkv_sizes[1] != projections.qkv_sizes[2]):
                return None
            shapes.add((*projections.qkv_sizes[:2], attn.head_dim, attn.scaling))
            weights += [norms[0].weight.detach().contiguous(), norms[1].weight.detach().contiguous()]
            for linear in linears:
                weights += _stack_tensors(linear)
            sizes += [linear.out_features for linear in linears]
            floats += [float(norms[0].variance_epsilon), float(norms[1].variance_epsilon)]
        if len(shapes) != 1:
            return None
        q_size, kv_size, head_dim, scale = shapes.pop()
        try:
            stack_class = decoder.load()
        except SpeculaError as err:  # a failed build: the layers run from Python, as before
            print(f"specula: the native decoder is unavailable ({err}); layers run from Python", file=sys.stderr)
            return None
        stack = stack_class(weights, [q_size, kv_size, head_dim, VECTOR_STEP, ELEMENTWISE_GRAIN, *sizes],
                            [float(scale), *floats])
        return cls(stack, len(layers))

    @staticmethod
    def takes(rows: int, mask: torch.Tensor | None, causal: bool) -> bool:
        """Whether a block of ``rows`` goes through the cached-attention kernel in the Python path (so here)."""
        return rows <= KERNEL_ROWS and not (causal and mask is None)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StaticKVCache,
            mask: torch.Tensor | None, capture: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every layer over x [1, n, H] (cos, sin [1, n, d]; ``mask`` as `block_attention_mask` gives it), the block
        written after ``cache``'s prefix → (x after the last layer [1, n, H], {layer in ``capture``: its input
        [n, H]})."""
        cache.open_block(x.shape[1])
        wanted = self._wanted(capture)
        return self._split(self.stack.run(x, cos, sin, cache.keys, cache.values, cache.length, mask, wanted), wanted)

    @classmethod
    def takes_packed(cls, segments: list[Segment]) -> bool:
        """Whether every sequence's block of a packed forward goes through the attention kernel in the Python path."""
        return all(cls.takes(s.end - s.start, s.mask, s.causal) for s in segments)

    def run_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[Segment],
                   capture: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`run` for several sequences' blocks packed in x [1, N, H] (`specula.runtime.packed`), each written after
        its own cache's prefix and attending over that cache as `static_cache._segments_attention` does."""
        for s in segments:
            s.cache.open_block(s.end - s.start)
        wanted = self._wanted(capture)
        keys = [s.cache.keys[i] for i in range(self.layer_count) for s in segments]
        values = [s.cache.values[i] for i in range(self.layer_count) for s in segments]
        outputs = self.stack.run_packed(x, cos, sin, keys, values, [s.start for s in segments],
                                        [s.end for s in segments], [s.cache.length for s in segments],
                                        [int(s.chain) for s in segments],
                                        [s.mask for s in segments if not s.chain], wanted)
        return self._split(outputs, wanted)

    def _wanted(self, capture: tuple[int, ...]) -> list[int]:
        """The layers whose inputs the stack keeps, in order (a request may name layers the target lacks)."""
        return sorted(i for i in capture if 0 <= i < self.layer_count)

    @staticmethod
    def _split(outputs: list[torch.Tensor], wanted: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The stack's [x, inputs of ``wanted``...] → (x, {layer: its input})."""
        return outputs[0], dict(zip(wanted, outputs[1:], strict=True))


_NO_SCALES = torch.empty(0)


def _stack_tensors(linear) -> list[torch.Tensor]:
    """What the stack holds of a linear it takes: a q4_1 one's packed blocks and scales, a float32 one's weight and no
    scales (the stack tells the two apart by dtype)."""
    if type(linear) is Q4_1Linear:
        return [linear.packed, linear.scales]
    return [linear.weight.detach(), _NO_SCALES]


def _native_linear(linear) -> bool:
    """Whether the stack multiplies by ``linear`` as its forward does: a bias-free `Q4_1Linear` without padded
    inputs, or a bias-free `Float32Linear` whose forward calls the row-invariant float32 kernel."""
    if type(linear) is Q4_1Linear:
        return (linear.bias is None and linear.padded_in == linear.in_features
                and linear.scales.dtype in (torch.float16, torch.float32))
    return (type(linear) is Float32Linear and linear.bias is None and linear.weight.dtype == torch.float32
            and linear.weight.is_contiguous() and float32_kernel() is not None)
