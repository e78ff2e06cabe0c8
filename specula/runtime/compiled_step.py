"""The Llama-family target's decode and verify step under `torch.compile`, with static shapes, and an
EAGLE head's draft step alongside it (`HeadStep`).

In eager mode a one-token step of a small model is largely Python and dispatcher overhead: on SmolLM2-135M a
one-token q4_1 step (1 thread, 300 cached tokens) takes about 20 ms eager, of which the q4_1 kernels are ~9 ms
and some 3,000 small operations the rest. Compiled (Inductor), the norms, rotary embedding, casts and residual
adds fuse into a few kernels.

**Regional compilation.** What is compiled is one decoder layer's step (`slot_layer_step`), and that one graph
runs every layer: the layers share their code and shapes, and their weights reach the graph as inputs (the
modules' guards stay on, so a layer of another structure gets a graph of its own: `compiled`). Measured on
this project's reference CPU (AMD EPYC, 1 thread, SmolLM2 q4_1, cache of 1,024 slots, 300-token prefix,
`TORCHINDUCTOR_CACHE_DIR` empty for "cold"):

    graph               first block size cold / warm   next size cold / warm   1-token / 12-token step
    whole model         98.7 s / 7.6 s                 91.1 s / 5.3 s          12.4 / 24.5 ms
    one layer (here)    12.7 s / 2.6 s                 3.5 s / 0.3 s           14.2 / 26.8 ms
    eager               -                              -                       19-20 / 32-40 ms

A whole-model graph is 1.8 ms a step faster (30 calls into a compiled layer cost ~60 us each in guards and
wrappers; the table's layer graph ran without its module guards, which `compiled` keeps for 0.8 ms more), but
its C++ wrapper compiled for 70-90 s per block size, so a tree method meeting five sizes waited eight minutes
before its first answer. One layer's graph compiles in seconds, and a later process loads it from Specula's cache
(`specula.runtime.precompiled`: ~20 ms a size, no tracing; each graph checks its guards once per layer, not per call).

Static shapes keep it to a few compilations (the gpt-fast recipe):
- a block of n tokens is padded to the next size in `BLOCK_BUCKETS` (on a GPU to `GPU_BLOCK_BUCKETS`' one size;
  padding rows attend only to themselves and write cache slots past the block, which `commit` never keeps);
- the graph sees the layer's whole cache (with a mask), so the committed length is data, not a shape;
  attention goes through an op the compiler does not trace (`static_cache.slot_attention`, or the
  cached-attention kernel), which attends over the committed slots only;
- the cache is allocated whole (its capacity, `Target.max_length`, and 63 slots past it for the padding of a
  block near the context limit: `allocate_whole`) when the step is compiled, so its size is
  one shape for good. A cache that grew in steps met a new shape at every growth: each bucket compiled again
  in the middle of a request (~3 s a size from Inductor's cache on the reference CPU; the long prompts of
  Spec-Bench's summarization ran at 0.96x vanilla for it). The size costs nothing per step (SmolLM2 q4_1,
  300-token prefix, 1 / 4 tokens: 14.6 / 16.6 ms with 1,024 slots, 14.0 / 15.7 ms with 8,192), and memory
  only where slots are written (`StaticKVCache.reserve` leaves new slots unwritten: 8,192 slots of SmolLM2,
  362 MiB of float32 keys and values, are 16 MiB resident after 300 tokens). On a GPU the whole allocation is
  taken at once (gpt-fast and vLLM preallocate the same way): 8,192 slots of an 8B Llama in bfloat16 are 1 GiB;
  a smaller ``max_length`` at load bounds it.
Bench and serve compile every bucket before their first request (`Target.warm_up`).
Prefills (a block into an empty cache), longer blocks and sliding-window models run the eager step.

The compiled graph rounds differently from the eager one (Inductor fuses the norms and keeps intermediates in
registers), so a compiled target is, like a quantized one, its own "target": vanilla and every method run the
same compiled steps, and losslessness is checked against that. Each row of a compiled block gets the bits a
compiled one-token step gives it (`tests/test_row_invariance.py`; on a GPU, `GPU_BLOCK_BUCKETS`).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specula.runtime.precompiled import Precompiled, module_structure
from specula.runtime.static_cache import (
    FusedProjections,
    SlotBlock,
    StaticKVCache,
    block_attention_mask,
    layer_output,
    layer_projections,
    slot_block_attention,
)

# Every size up to 12, where drafts are: a padding row costs what a real one does (each row is its own pass through
# the q4_1 kernel, for row invariance), ~0.5 ms on SmolLM2 against ~10 ms for the one-token step. With the
# earlier buckets (1, 2, 4, 8, 12, ...) suffix's usual blocks of 5 and 9 rows ran as 8 and 12: on 12 MT-bench
# questions (compiled q4_1, 1 thread, three alternating pairs of processes) suffix decoded at 87.0-88.2
# tokens/s with those and 92.1-96.7 with these. Each size is one more graph to compile (~5 s cold, ~0.2 s from
# Inductor's cache on 2 cores).
BLOCK_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 24, 32, 48, 64)
# Off a CPU every block runs at one shape. There the kernels are cuBLAS's, SDPA's and Triton's, chosen (and their
# reductions ordered) per shape, so a k-row block rounds differently from a one-token step; at one shape each row
# gets the bits it gets alone. On an NVIDIA H200 (`scripts/gpu_single_bucket.py`, docs/checks/gpu-h200-stories260k)
# a compiled step padded to 64 rows gave chains of 1..64 tokens and a 9-node tree the bits of one-token steps in
# bfloat16, int8 and int4 (with the dense buckets every row of every block of k >= 2 differed); float32 chains
# too, but not the tree, whose ancestors' keys sit at other slots than in the steps; the same on a random Llama of
# a 1B model's layer shapes after 2,000 and 4,000 tokens. A GPU step there is launch-bound, not row-bound: that
# model's bfloat16 one-token step took 3.7-4.2 ms with the dense buckets and 3.3-3.4 ms at 64 rows (two
# alternating turns of 100 steps), and there is one graph to compile instead of 17.
GPU_BLOCK_BUCKETS = (64,)
# Blocks a long-running command (bench, serve) compiles before its first request (`Target.warm_up`): the
# default trees and chains on a CPU verify at most 16 tokens (eagle/eagle2/eagle3 11, pld 11, the bundled
# Medusa tree 16); a larger block still compiles when it is first met.
WARM_UP_BLOCK = 16


def block_buckets(device: torch.device) -> tuple[int, ...]:
    """The block sizes a compiled step on ``device`` runs: `BLOCK_BUCKETS` on a CPU, `GPU_BLOCK_BUCKETS` elsewhere."""
    return BLOCK_BUCKETS if device.type == "cpu" else GPU_BLOCK_BUCKETS


def bucket(n: int, device: torch.device) -> int | None:
    """The padded size of a block of n tokens on ``device``, or None when it is longer than every bucket."""
    return next((size for size in block_buckets(device) if size >= n), None)


def warm_up_blocks(device: torch.device, max_block: int) -> list[int]:
    """Block lengths (of at most ``max_block`` tokens) that between them meet every padded size a block of up to
    ``max_block`` tokens runs at on ``device``: one per bucket (on a GPU one block, padded to its one size)."""
    last = bucket(max_block, device) or max(block_buckets(device))
    return [min(size, max_block) for size in block_buckets(device) if size <= last]


def fits(cache: StaticKVCache, n: int) -> bool:
    """Whether a block of n tokens after ``cache``'s prefix can run compiled: not a prefill, not longer than
    every bucket, and its padding inside the slots the cache has for it (`allocate_whole`)."""
    padded = bucket(n, cache.keys[0].device)
    return (cache.length > 0 and padded is not None and cache.length + n <= cache.capacity
            and cache.length + padded <= cache.capacity + cache.padding)


def allocate_whole(cache: StaticKVCache) -> None:
    """Allocate ``cache`` whole, once: its capacity and, past it, the slots a block's padding rows may write. A
    block near the context limit then runs compiled like every other (it ran eager, and a one-token step there
    with other bits than vanilla's compiled one: on an H200 the last 15 rows of a 64-token chain 400 tokens
    into stories260k's 512 differed)."""
    cache.padding = max(block_buckets(cache.keys[0].device)) - 1
    cache.reserve(cache.capacity + cache.padding)


def padded_block(cache: StaticKVCache, positions: torch.Tensor,
                 visible: torch.Tensor | None) -> tuple[SlotBlock, torch.Tensor, torch.Tensor]:
    """A block of n = len(positions) rows after ``cache``'s prefix, padded to its bucket for a compiled step.

    ``visible``: bool [1, 1, n, prefix + n], what each row may attend to (`block_attention_mask`), or None for
    one token, which sees everything before it. Grows the cache to hold the padded block and returns its slots,
    the positions padded to [padded] and the mask over the whole allocation [1, 1, padded, allocated]: the
    block's rows see what ``visible`` lets them, a padding row only itself (its slot is past the block, so a
    `commit` never keeps it).
    """
    n, prefix = positions.shape[0], cache.length
    padded = bucket(n, positions.device)
    cache.reserve(prefix + padded)
    device = positions.device
    slots = SlotBlock(torch.arange(prefix, prefix + padded, device=device), torch.tensor(prefix + padded))
    positions = torch.cat([positions, positions.new_full((padded - n,), prefix)])
    mask = torch.zeros(padded, cache.allocated, dtype=torch.bool, device=device)
    mask[:n, :prefix + n] = True if visible is None else visible[0, 0]
    rows = torch.arange(n, padded, device=device)
    mask[rows, prefix + rows] = True
    return slots, positions, mask[None, None]


def slot_layer_step(layer: torch.nn.Module, fused: FusedProjections, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    slots: SlotBlock, apply_rope) -> torch.Tensor:
    """One decoder layer over a padded block x [1, n, H] whose keys and values go to ``slots`` of that layer's
    ``keys``/``values`` [1, H_kv, allocated, d]: the region compiled once and run for every layer (`CompiledStep`).
    ``mask`` [1, 1, n, allocated] as `padded_block` builds it; cos, sin: the block's rotary tables."""
    q, k, v = layer_projections(layer, x, cos, sin, apply_rope, None, fused)
    attended = slot_block_attention(q, k, v, keys, values, mask, slots, layer.self_attn.scaling)
    return layer_output(layer, x, attended, fused)


def pads_eager_blocks(device: torch.device) -> bool:
    """Whether an eager block on ``device`` runs padded to the compiled step's shape too (`CompiledStep` with
    ``compile=False``): off a CPU. There cuBLAS and SDPA choose their kernels (and the order of their sums) by the
    rows in a call, so an eager k-token verify pass rounded differently from a one-token step in every format (on
    an H200: bfloat16 3 rows of a 16-token chain, int4 all 4 of a 4-token one, float32 every row of every block);
    at the one shape (`GPU_BLOCK_BUCKETS`) each row gets the bits it gets alone, as the compiled step showed. A CPU
    runs Specula's own row-invariant kernels, at any number of rows."""
    return device.type != "cpu"


class CompiledStep:
    """Runs a `LlamaFamilyRuntime`'s forward for blocks of up to 64 tokens, each padded to its bucket
    (`block_buckets`), each decoder layer through one compiled graph (`slot_layer_step`); the embedding, final norm
    and LM head stay eager. With ``compile=False`` the same padded step runs eager (`pads_eager_blocks`)."""

    def __init__(self, runtime, compile: bool = True):
        self.runtime = runtime
        cache = runtime.cache
        if compile:
            self.layer_step = Precompiled(slot_layer_step, cache.keys[0].device, guard_modules=True)
            allocate_whole(cache)  # the allocation is a shape: one for good
        else:
            self.layer_step = slot_layer_step
            # The cache still grows on demand, but a block near the context limit keeps room for its padding.
            cache.padding = max(block_buckets(cache.keys[0].device)) - 1

    def accepts(self, n: int) -> bool:
        """Whether a block of n tokens takes this path (else the eager step runs it): not a prefill."""
        return fits(self.runtime.cache, n) and all(window is None for window in self.runtime.windows)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor | None, features):
        """The runtime's `ForwardOutput` for a block ``tokens`` [n] at ``positions`` [n] after the prefix."""
        runtime, cache = self.runtime, self.runtime.cache
        n = tokens.shape[0]
        slots, positions, mask = padded_block(cache, positions, block_attention_mask(cache.length, positions,
                                                                                     block_mask))
        tokens = F.pad(tokens, (0, positions.shape[0] - n))
        runtime.refresh_fused()  # before the graph reads the stacks
        out = runtime.run(tokens, positions, {None: mask}, False, features, slots, layer_step=self.layer_step)
        cache.block = n
        return out.select(slice(0, n))


def head_step(head, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
              cache: StaticKVCache, mask: torch.Tensor | None, own_features: bool, slots: SlotBlock | None,
              last: torch.Tensor | None, top: int):
    """An EAGLE head's `step`, then with ``top`` > 0 its `top_tokens` for row ``last`` (int64 [1]) of the block:
    outputs [n, H], or (outputs, tokens [1, top], log-probabilities [1, top])."""
    out = head.step(features, token_embeds, positions, cache, mask, own_features, slots=slots)
    if not top:
        return out
    return (out, *head.top_tokens(out.index_select(0, last), top))


class HeadStep:
    """An EAGLE head's steps for a drafter (`head_step`): eager, or with ``compile`` compiled like the target's
    steps, padded to `block_buckets` (a block into an empty head cache, the prompt, and longer blocks run eager).

    On a CPU an eager head step is mostly per-operation overhead. SmolLM2's EAGLE-3 head in q4_1, the greedy
    one-node draft (step over 1 or 2 pairs, then the top token) after 300 cached pairs, interleaved: eager
    0.87 / 0.94 ms, compiled 0.56 / 0.62 ms; the step alone gained little (0.79 -> 0.73 ms in a decode), as a
    compiled call costs ~0.25 ms of guards and wrappers: what pays is the top token joining the step's graph.
    """

    def __init__(self, head, compile: bool, device: torch.device):
        self.head = head
        self.graph = Precompiled(graph_function(head), device) if compile else None

    def __call__(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                 cache: StaticKVCache, mask: torch.Tensor | None, own_features: bool = False, top: int = 0):
        """As `head_step` over n pairs after ``cache``, the top tokens (if ``top``) of the block's last row."""
        n = positions.shape[0]
        last = torch.tensor([n - 1], device=positions.device) if top else None  # tree levels want no top tokens
        if self.graph is None or not fits(cache, n):
            return head_step(self.head, features, token_embeds, positions, cache, mask, own_features, None, last,
                             top)
        allocate_whole(cache)  # the allocation is a shape: one for good (as the target's)
        visible = block_attention_mask(cache.length, positions, None) if mask is None else mask
        slots, positions, full_mask = padded_block(cache, positions, visible)
        pad = (0, 0, 0, positions.shape[0] - n)
        out = self.graph(self.head, F.pad(features, pad), F.pad(token_embeds, pad), positions, cache, full_mask,
                         slots, own_features, last, top)
        cache.block = n
        return (out[0][:n], *out[1:]) if top else out[:n]


def _head_graph(head, features, token_embeds, positions, cache, mask, slots, own_features, last, top):
    return head_step(head, features, token_embeds, positions, cache, mask, own_features, slots, last, top)


_GRAPHS: dict[str, Callable] = {}  # function and module structures -> the function with a code object of its own


def graph_function(head: torch.nn.Module, function: Callable | None = None,
                   *modules: torch.nn.Module) -> Callable:
    """``function`` (default `_head_graph`) for heads of ``head``'s structure (`module_structure`), and of
    ``modules``' structures where the function is given more modules (a drafter's tree level: the target's
    embedding).

    Dynamo keeps its graphs and guards per code object, and `compiled` leaves out the guards on modules. So in a
    process that compiled an EAGLE head, an EAGLE-3 head sharing the code object met the EAGLE head's graph:
    on an H200 (torch 2.11) its first step failed with ``KeyError: 'layers'`` (the EAGLE head's layer list).
    One code object per structure keeps heads of different structure apart; heads of the same structure share
    graphs, their weights being graph inputs.
    """
    function = function or _head_graph
    structure = "|".join([function.__qualname__, *map(module_structure, (head, *modules))])
    copy = _GRAPHS.get(structure)
    if copy is None:
        code = function.__code__.replace(co_name=f"{function.__name__}_{len(_GRAPHS)}")
        copy = types.FunctionType(code, function.__globals__, code.co_name)
        _GRAPHS[structure] = copy
    return copy
