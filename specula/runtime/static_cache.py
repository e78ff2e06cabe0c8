"""Running Llama-style decoder layers against a preallocated KV cache, for the target and draft heads alike.

The cache holds a committed prefix in slots [0, length). A forward writes a
block of n new entries to [length, length + n); `commit` then keeps the chosen
block entries (moving them next to the prefix, cost proportional to the kept
count) and `truncate` forgets committed entries.

Memory is allocated as it is needed, not for the whole ``capacity`` up front: SmolLM2's
8,192-token context is 360 MiB of float32 keys and values, more than its int4 weights, while a
chat answer needs a few hundred slots. `StaticKVCache.reserve` (called with what a generation
will need) and `write` (when a block goes past the allocation) grow it in steps of `SLOT_STEP`,
at least doubling, by copying into a larger buffer: the shapes stay static between growths. A compiled step
allocates the whole capacity at once (one shape for good, `compiled_step`); slots are left unwritten until a
block writes them, so the memory behind them is only taken as they are used.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specula.kernels.attention import kernel as attention_kernel
from specula.kernels.attention import packed as packed_attention_kernel
from specula.runtime.fused_linear import fuse_outputs
from specula.runtime.heap import trim_heap

SLOT_STEP = 256  # allocations are whole multiples of this many slots (up to the capacity)


class StaticKVCache:
    """Keys and values of every layer: ``n_layers`` × [1, n_kv_heads, allocated, head_dim], allocated <= capacity
    + padding."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (1, n_kv_heads, 0, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.capacity = capacity  # the most entries it may ever hold
        # Slots past the capacity that a compiled step's padding rows may write (never committed; `compiled_step`):
        # without them a block near the context limit ran eager, with other bits than the compiled steps.
        self.padding = 0
        self.length = 0  # committed entries
        self.block = 0  # provisional entries written by the last forward
        self.reserve(SLOT_STEP)

    def empty_like(self) -> StaticKVCache:
        """A new cache of the same layers, heads, capacity, padding, dtype and device, holding nothing (first
        allocation)."""
        k = self.keys[0]
        other = StaticKVCache(len(self.keys), k.shape[1], k.shape[3], self.capacity, k.dtype, k.device)
        other.padding = self.padding
        return other

    @property
    def allocated(self) -> int:
        """Slots allocated now (grown on demand up to ``capacity``)."""
        return self.keys[0].shape[2] if self.keys else self.capacity

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` entries (clipped to the capacity and its ``padding``): grow to a multiple of
        `SLOT_STEP`, at least double the current allocation; keeps every entry written so far. Never shrinks.

        The new slots are left unwritten (``new_empty``): every reader stops at the block's end, before which
        each slot was written, and the operating system backs a large allocation's pages only once written
        (8,192 slots of SmolLM2: 362 MiB zeroed, 16 MiB resident after 300 tokens unwritten)."""
        limit = self.capacity + self.padding
        slots = min(slots, limit)
        if slots <= self.allocated:
            return
        size = min(limit, -(-max(slots, 2 * self.allocated) // SLOT_STEP) * SLOT_STEP)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_empty((*old.shape[:2], size, old.shape[3]))
                new[:, :, :old.shape[2]] = old
                buffers[i] = new
        # The smaller buffers just freed sit between other allocations, where glibc would keep them for good
        # (SmolLM2, 512 → 1,024 slots: +42 MiB resident instead of +24).
        trim_heap()

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a block's keys/values [1, n_kv, n, d] after the prefix; returns views of everything so far."""
        end = self.open_block(keys.shape[2])
        self.keys[layer][:, :, self.length:end] = keys
        self.values[layer][:, :, self.length:end] = values
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def open_block(self, n: int) -> int:
        """Make room for a block of ``n`` entries after the prefix and mark it provisional; returns its end slot."""
        end = self.length + n
        if end > self.allocated:
            self.reserve(end)
        self.block = n
        return end

    def truncate(self, length: int) -> None:
        self.length = min(length, self.length)
        self.block = 0

    def commit(self, keep: list[int] | None = None) -> None:
        """Keep block entries ``keep`` (in order) after the prefix; None keeps the whole block."""
        start = self.length
        if keep is None:
            keep = list(range(self.block))
        if keep != list(range(len(keep))):
            source = torch.tensor(keep, device=self.keys[0].device) + start
            for cache in (*self.keys, *self.values):
                cache[:, :, start:start + len(keep)] = cache[:, :, source]
        self.length = start + len(keep)
        self.block = 0



class Segment(NamedTuple):
    """One sequence's rows [start, end) of a packed block (many sequences in one forward, `specula.runtime.packed`):
    its own ``cache``, its ``mask`` (`block_attention_mask`, None = causal or one token), whether SDPA
    must apply the causal triangle itself (``causal``: a prompt from an empty cache) and whether the block is a
    plain chain after a non-empty prefix (``chain``: every row sees the prefix and the block rows before it; such
    segments go through the kernel together, `_segments_attention`)."""

    cache: StaticKVCache
    start: int
    end: int
    mask: torch.Tensor | None
    causal: bool
    chain: bool = False


class SlotBlock(NamedTuple):
    """Where a compiled step's block goes: cache ``indices`` [n] (increasing, on the cache's device) and ``end``,
    the last of them + 1 as a 0-d int64 CPU tensor (read without a device sync)."""

    indices: torch.Tensor
    end: torch.Tensor


# An op torch.compile cannot see into (defined through torch.library's lower-level API: a custom_op wrapper
# costs ~50 us more per call, 1.5 ms per SmolLM2 step).
_LIBRARY = torch.library.Library("specula", "FRAGMENT")
_LIBRARY.define("slot_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, Tensor end, float scale) "
                "-> Tensor")


def _slot_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    end: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of a block over the cache slots before ``end`` (a 0-d int64 CPU tensor: the block's last slot + 1).

    q [1, H, n, d]; keys, values [1, H_kv, allocated, d]; mask bool [1, 1, n, allocated]. A compiled step
    passes the whole allocation (its shape is static, the committed length is data); this op, which
    torch.compile does not trace into, reads that length and attends over it alone instead of over every
    allocated slot (SmolLM2 in q4_1, compiled, 4 tokens after a 300-token prefix, 1,024 slots: 23.2 -> 21.0 ms).
    """
    end = int(end)  # on the CPU: no device sync
    if q.device.type != "cpu":
        return _gpu_slot_attention(q, keys[:, :, :end], values[:, :, :end], mask[..., :end], scale)
    # One token sees every slot up to its own: no mask (SDPA is ~20 % faster without one).
    visible = None if q.shape[2] == 1 else mask[..., :end]
    out = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=visible,
                                         scale=scale, enable_gqa=True)
    return out.contiguous()  # the layout the fake below promises (SDPA's own depends on its backend)


def _gpu_slot_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """`_slot_attention` off a CPU: keys, values [1, H_kv, end, d] repeated to q's heads, the mask [1, 1, n, end] as a
    bias, so SDPA runs its memory-efficient kernel, not (``enable_gqa`` + a bool mask) its float32 math path: an
    H200's padded eager step 5.4 -> 3.9 ms, rows still invariant (docs/checks/gpu-h200-stories260k)."""
    groups = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale).contiguous()


def _slot_attention_shape(q, keys, values, mask, end, scale):
    return q.new_empty(*q.shape[:3], values.shape[-1])


_LIBRARY.impl("slot_attention", _slot_attention, "CompositeExplicitAutograd")
torch.library.register_fake("specula::slot_attention", _slot_attention_shape, lib=_LIBRARY)
slot_attention = torch.ops.specula.slot_attention

def block_attention_mask(prefix: int, positions: torch.Tensor, block_mask: torch.Tensor | None,
                         window: int | None = None) -> torch.Tensor | None:
    """bool [1, 1, n, prefix + n] for a block after ``prefix`` cached entries, or None for plain causal.

    block_mask [n, n] says which block entries each block entry sees (None: causal chain);
    ``window`` limits attention to keys whose position is within the last ``window`` positions.
    Cache slot i holds position i, so prefix keys have positions 0..prefix-1.
    """
    n = positions.shape[0]
    if block_mask is None and window is None and (n == 1 or prefix == 0):
        return None
    mask = torch.ones(n, prefix + n, dtype=torch.bool, device=positions.device)
    if block_mask is None:
        block_mask = torch.ones(n, n, dtype=torch.bool, device=positions.device).tril()
    mask[:, prefix:] = block_mask
    if window is not None:
        key_positions = torch.cat([torch.arange(prefix, device=positions.device), positions])
        mask &= key_positions[None, :] > positions[:, None] - window
    return mask[None, None]


# torch's CPU elementwise loops run vectors of 2 x 8 (AVX2) or 2 x 16 (AVX-512) float32 lanes and finish a call's
# last few elements with the scalar function, whose exp rounds differently (SiLU: 82 of 2,000 random inputs
# differed by an ulp here); a call of more than GRAIN_SIZE elements is cut between threads.
VECTOR_STEP = 64  # elements: a multiple of every vector loop's step
ELEMENTWISE_GRAIN = 32768  # at::internal::GRAIN_SIZE: a call over no more elements runs whole on one thread


def rowwise(function, x: torch.Tensor) -> torch.Tensor:
    """``function`` (elementwise, e.g. an activation) of x [..., n, L] computed so that each row's bits do not depend
    on n: rows padded to a multiple of `VECTOR_STEP` (every element then takes the vector path, never the scalar
    tail) and at most `ELEMENTWISE_GRAIN` elements per call (no thread boundary inside a row). SmolLM2's 1,536-wide
    rows need neither below 22 rows; stories260k's 172-wide ones are padded to 192."""
    if x.device.type != "cpu":
        return function(x)
    rows, width = x.shape[-2], x.shape[-1]
    padded = -(-width // VECTOR_STEP) * VECTOR_STEP
    if padded != width:
        x = F.pad(x, (0, padded - width))
    per_call = max(1, ELEMENTWISE_GRAIN // padded)
    if rows <= per_call:
        out = function(x)
    else:
        out = torch.cat([function(x[..., i:i + per_call, :]) for i in range(0, rows, per_call)], dim=-2)
    return out if padded == width else out[..., :width]


def rotary_function(layer: torch.nn.Module):
    """The `apply_rotary_pos_emb` of the modelling file that defines ``layer``'s attention."""
    return sys.modules[type(layer.self_attn).__module__].apply_rotary_pos_emb


class FusedProjections:
    """A decoder layer's q/k/v projections as one matmul and its gate/up projections as another.

    Each linear call pays a fixed cost besides its weights (dispatch, casting the input to the kernel's
    dtype and back), so stacking the projections that read the same input removes 3 of a layer's 7
    calls: measured on SmolLM2 in int4, 2 threads,
    a one-token step went from 29.1 to 27.1 ms (4 tokens 36.9 → 33.9, 16 tokens 85.0 → 82.0; float32 one
    token 60.9 → 56.6), and outputs are bit-identical (`fuse_outputs`).
    qkv / gate_up are None where the layer's linears cannot be stacked; the step then calls them one by one.
    """

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.sources = self._sources(layer)
        self.qkv = fuse_outputs([attn.q_proj, attn.k_proj, attn.v_proj])
        self.qkv_sizes = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        gated = all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        self.gate_up = fuse_outputs([mlp.gate_proj, mlp.up_proj]) if gated else None

    @staticmethod
    def _sources(layer: nn.Module) -> tuple:
        # Read from the modules' own tables, not through nn.Module.__getattr__: every forward asks (`built_from`),
        # and 30 layers' attribute lookups cost ~0.2 ms a step.
        # o and down are not stacked, but the native stack (`specula.runtime.native_decoder`) holds them too and is
        # rebuilt with these.
        attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
        return (attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"], mlp.get("gate_proj"),
                mlp.get("up_proj"), mlp.get("down_proj"))

    def built_from(self, layer: nn.Module) -> bool:
        """Whether ``layer`` still holds the linears these were built from (not replaced, e.g. requantized)."""
        return self.sources == self._sources(layer)


# Blocks of up to this many rows attend through the cached-attention kernel where it runs (CPU, float32, head
# size a multiple of 8); longer ones (prompts, which every method computes alike) through SDPA, whose blocked
# matmuls win once hundreds of rows share the keys. The kernel gives each row the bits of a one-token step over
# the same tokens (`specula.kernels.attention`: row invariance), so every verify block must go through it: the
# largest bucket of `specula.runtime.compiled_step`, and more than any draft tree verifies.
KERNEL_ROWS = 64


def _attention_kernel(q: torch.Tensor, keys: torch.Tensor):
    """The cached-attention op for this block (`specula.kernels.attention`), or None for SDPA."""
    if (q.shape[2] > KERNEL_ROWS or q.device.type != "cpu" or q.dtype != torch.float32
            or keys.dtype != torch.float32 or q.shape[-1] % 8):
        return None
    return attention_kernel()


def _cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: StaticKVCache, index: int,
                      mask: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    """Write a block's k, v [1, H_kv, n, d] after ``cache``'s prefix (layer ``index``) and attend q [1, H, n, d]
    over the prefix and the block."""
    keys, values = cache.write(index, k, v)
    kernel = None if causal and mask is None else _attention_kernel(q, keys)
    if kernel is not None:
        return kernel(q, keys, values, mask, torch.tensor(keys.shape[2]), scale)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal and mask is None,
                                          scale=scale, enable_gqa=True)


def _segments_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment], index: int,
                        scale: float) -> torch.Tensor:
    """Attention of a packed block: q [1, H, N, d], k, v [1, H_kv, N, d] over ``segments`` (each sequence's rows and
    cache, layer ``index``). Chain segments the kernel takes go through one `packed_attention` call (each row's
    bits those of its own `_cached_attention`); the others, one call each."""
    def alone(s: Segment) -> torch.Tensor:
        return _cached_attention(q[:, :, s.start:s.end], k[:, :, s.start:s.end], v[:, :, s.start:s.end], s.cache,
                                 index, s.mask, s.causal, scale)

    together = [s.chain and s.end - s.start <= KERNEL_ROWS for s in segments]
    chains = [s for s, joins in zip(segments, together, strict=True) if joins]
    # The forks of one target share a dtype and device: one sequence's cache answers for all.
    kernel = _attention_kernel(q[:, :, :1], chains[0].cache.keys[index]) if chains else None
    packed = None if kernel is None else packed_attention_kernel()
    if packed is None:
        return torch.cat([alone(s) for s in segments], dim=2)
    for s in chains:  # the kernel stores each block where StaticKVCache.write would
        s.cache.open_block(s.end - s.start)
    out = packed(q, k, v, [s.cache.keys[index] for s in chains], [s.cache.values[index] for s in chains],
                 [s.start for s in chains], [s.end for s in chains], [s.cache.length for s in chains], scale)
    for s, joins in zip(segments, together, strict=True):
        if not joins:
            out[:, :, s.start:s.end] = alone(s)
    return out


def layer_projections(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, apply_rope,
                      attention_input: torch.Tensor | None = None, fused: FusedProjections | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer's queries [1, H, n, d], keys and values [1, H_kv, n, d] of a block x [1, n, H], rotary
    applied (the first part of `decoder_layer_step`)."""
    attn = layer.self_attn
    n = x.shape[1]
    h = layer.input_layernorm(x) if attention_input is None else attention_input
    head_dim = attn.head_dim
    if fused is not None and fused.qkv is not None:
        q, k, v = fused.qkv(h).split(fused.qkv_sizes, dim=-1)
    else:
        q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    q, k, v = q.view(1, n, -1, head_dim), k.view(1, n, -1, head_dim), v.view(1, n, -1, head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before rotary
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)


def slot_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         mask: torch.Tensor, slots: SlotBlock, scale: float) -> torch.Tensor:
    """Write a block's k, v [1, H_kv, n, d] to ``slots`` of one layer's ``keys``/``values`` [1, H_kv, allocated, d]
    and attend q [1, H, n, d] over the slots before ``slots.end`` as ``mask`` [1, 1, n, allocated] allows."""
    keys.index_copy_(2, slots.indices, k)
    values.index_copy_(2, slots.indices, v)
    kernel = _attention_kernel(q, keys)
    attend = slot_attention if kernel is None else kernel  # both read only the slots before slots.end
    return attend(q, keys, values, mask, slots.end, scale)


def layer_output(layer: torch.nn.Module, x: torch.Tensor, attended: torch.Tensor,
                 fused: FusedProjections | None = None) -> torch.Tensor:
    """The layer's output [1, n, H] for its input x [1, n, H] and attention output ``attended`` [1, H, n, d]: output
    projection, residual, MLP, residual (the last part of `decoder_layer_step`)."""
    attn, n = layer.self_attn, x.shape[1]
    x = x + attn.o_proj(attended.transpose(1, 2).reshape(1, n, -1))
    h = layer.post_attention_layernorm(x)
    mlp = layer.mlp
    if fused is not None and fused.gate_up is not None:
        gate, up = fused.gate_up(h).chunk(2, dim=-1)  # the MLP of transformers' Llama, Mistral and Qwen
    elif all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        gate, up = mlp.gate_proj(h), mlp.up_proj(h)
    else:
        return x + mlp(h)
    return x + mlp.down_proj(rowwise(mlp.act_fn, gate) * up)


def decoder_layer_step(layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       cache: StaticKVCache, index: int, mask: torch.Tensor | None, causal: bool,
                       apply_rope, attention_input: torch.Tensor | None = None,
                       fused: FusedProjections | None = None, slots: SlotBlock | None = None,
                       segments: list[Segment] | None = None) -> torch.Tensor:
    """One `transformers` Llama-style decoder layer on a block x [1, n, H] using ``cache`` layer ``index``.

    ``causal`` asks SDPA for a causal mask when ``mask`` is None (a prefill from an empty cache).
    ``attention_input`` replaces the normalised x as input of q/k/v (EAGLE-3 feeds a wider one there).
    ``fused``: the layer's stacked projections (built from this layer), or None to call each linear.
    ``slots``: write the block to these cache slots and attend up to the last of them (`slot_block_attention`;
    ``mask`` covers the whole allocation), so that the committed length is data rather than a shape
    (`specula.runtime.compiled_step`); None: write after the committed prefix and attend over it.
    ``segments``: x packs several sequences' blocks; each attends over its own cache (``cache``, ``mask`` and
    ``causal`` are then unused).
    """
    q, k, v = layer_projections(layer, x, cos, sin, apply_rope, attention_input, fused)
    scale = layer.self_attn.scaling
    if segments is not None:
        # The linears above and below ran over every sequence's rows at once; attention is per sequence.
        out = _segments_attention(q, k, v, segments, index, scale)
    elif slots is None:
        out = _cached_attention(q, k, v, cache, index, mask, causal, scale)
    else:
        out = slot_block_attention(q, k, v, cache.keys[index], cache.values[index], mask, slots, scale)
    return layer_output(layer, x, out, fused)

