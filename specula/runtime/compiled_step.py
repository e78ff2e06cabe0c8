"""The Llama-family target's decode and verify step under `torch.compile`, with static shapes, and an
EAGLE head's draft step alongside it (`HeadStep`).

In eager mode a one-token step of a small model is largely Python and dispatcher overhead: on
SmolLM2-135M in int4 (2 threads) the matmul kernels take about 12 ms of a 27 ms step and some
3,000 small operations the rest. Compiled (Inductor), the norms, rotary embedding, casts and
residual adds fuse into a few kernels. Measured on this project's reference CPU (interleaved
medians, cache of 1,024 slots, 300-token prefix): int4 one token 29.0 -> 24.2 ms, 4 tokens 38.4 ->
32.9 ms; q4_1 one token 19.8 -> 12.2 ms, 4 tokens 28.6 -> 21.0 ms (its kernel is an op the graph
calls; of the 12.2 ms, 5 ms are that kernel, 3.5 ms attention, 1.4 ms dynamo's guard checks). In
`specula bench` (MT-bench, 8 questions, both turns) compiled q4_1 vanilla decodes 88.5 tokens/s,
llama.cpp on the same GGUF 84.1. The cost is compilation: about 2 min per new shape on 2 cores (the
C++ wrapper included), seconds once Inductor's on-disk cache holds it; a tree method meets several
block sizes. So it is opt-in (`--compile`): it pays off only in long-running
processes (bench, serve) whose shapes have all been compiled.

Static shapes keep it to a few compilations (the gpt-fast recipe):
- a block of n tokens is padded to the next size in `BLOCK_BUCKETS` (padding rows attend only to
  themselves and write cache slots past the block, which `commit` never keeps);
- the graph sees the whole allocated cache (with a mask), so the committed length is data, not a
  shape; attention goes through an op the compiler does not trace (`static_cache.slot_attention`),
  which attends over the committed slots only; a graph is compiled per (bucket, allocated cache size,
  feature request), and the cache grows in large steps. Bench and serve compile the usual sizes
  before their first request (`Target.warm_up`).
Prefills (a block into an empty cache), longer blocks and sliding-window models run the eager step.

The compiled graph rounds differently from the eager one (Inductor reorders reductions and keeps
fused intermediates in registers), so a compiled target is, like a quantized one, its own "target":
vanilla and every method run the same compiled steps, and losslessness is checked against that
(greedy equality, near-ties classified by `specula check`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specula.kernels.attention import kernel as attention_kernel
from specula.runtime.static_cache import SlotBlock, StaticKVCache, block_attention_mask

BLOCK_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CACHE_STEP = 1024  # KV slots: the compiled step's cache grows in these steps (each size compiles anew)
# Blocks a long-running command (bench, serve) compiles before its first request (`Target.warm_up`): the
# default trees and chains on a CPU verify at most 16 tokens (eagle/eagle2/eagle3 11, pld 11, the bundled
# Medusa tree 16); a larger block still compiles when it is first met.
WARM_UP_BLOCK = 16


def bucket(n: int) -> int | None:
    """The padded size of a block of n tokens, or None when it is longer than every bucket."""
    return next((size for size in BLOCK_BUCKETS if size >= n), None)


def compiled(function, device: torch.device):
    """``function`` under `torch.compile` with static shapes and the options every compiled step here uses."""
    # On a CPU, Inductor's C++ wrapper calls the step's kernels from C++ rather than from generated
    # Python: SmolLM2 q4_1 one-token step 11.2 -> 9.4-10.3 ms (each new shape takes ~2 min to build cold,
    # seconds from Inductor's cache after).
    options = {"cpp_wrapper": True} if device.type == "cpu" else {}
    # No guards on the model's modules (their weights never change once a target is compiled; the KV
    # cache, block shapes and feature requests, which do, stay guarded): every step evaluated ~1 ms of
    # them (median of 3 interleaved runs 10.2 -> 9.3 ms).
    unguarded = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)  # not in older torch
    if unguarded is not None:
        options["guard_filter_fn"] = unguarded
    attention_kernel()  # decided (and built) before tracing: the graph reads the answer
    # One graph per block size, cache size and feature request: more than dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(function, fullgraph=True, dynamic=False, options=options)


def fits(cache: StaticKVCache, n: int) -> bool:
    """Whether a block of n tokens after ``cache``'s prefix can run compiled: not a prefill, not longer than
    every bucket, and its padding inside the cache's capacity (near the context limit it runs eager: its padding
    would write slots that do not exist)."""
    padded = bucket(n)
    return cache.length > 0 and padded is not None and cache.length + padded <= cache.capacity


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
    padded = bucket(n)
    cache.reserve(prefix + padded)
    device = positions.device
    slots = SlotBlock(torch.arange(prefix, prefix + padded, device=device), torch.tensor(prefix + padded))
    positions = torch.cat([positions, positions.new_full((padded - n,), prefix)])
    mask = torch.zeros(padded, cache.allocated, dtype=torch.bool, device=device)
    mask[:n, :prefix + n] = True if visible is None else visible[0, 0]
    rows = torch.arange(n, padded, device=device)
    mask[rows, prefix + rows] = True
    return slots, positions, mask[None, None]


class CompiledStep:
    """Runs a `LlamaFamilyRuntime`'s forward for blocks of up to `BLOCK_BUCKETS[-1]` tokens, compiled."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.graph = compiled(self._graph, runtime.cache.keys[0].device)
        # Each allocated cache size is a shape: grow in large steps, so that a chat stays on one or two.
        runtime.cache.slot_step = max(runtime.cache.slot_step, CACHE_STEP)

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
        out = self.graph(tokens, slots, positions, mask, features)
        cache.block = n
        return out.select(slice(0, n))

    def _graph(self, tokens, slots, positions, mask, features):
        return self.runtime.run(tokens, positions, {None: mask}, False, features, slots)


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
    steps, padded to `BLOCK_BUCKETS` (a block into an empty head cache, the prompt, and longer blocks run eager).

    On a CPU an eager head step is mostly per-operation overhead. SmolLM2's EAGLE-3 head in q4_1, the greedy
    one-node draft (step over 1 or 2 pairs, then the top token) after 300 cached pairs, interleaved: eager
    0.87 / 0.94 ms, compiled 0.56 / 0.62 ms; the step alone gained little (0.79 -> 0.73 ms in a decode), as a
    compiled call costs ~0.25 ms of guards and wrappers: what pays is the top token joining the step's graph.
    """

    def __init__(self, head, compile: bool, device: torch.device):
        self.head = head
        self.graph = compiled(self._graph, device) if compile else None

    def __call__(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                 cache: StaticKVCache, mask: torch.Tensor | None, own_features: bool = False, top: int = 0):
        """As `head_step` over n pairs after ``cache``, the top tokens (if ``top``) of the block's last row."""
        n = positions.shape[0]
        last = torch.tensor([n - 1], device=positions.device) if top else None  # tree levels want no top tokens
        if self.graph is None or not fits(cache, n):
            return head_step(self.head, features, token_embeds, positions, cache, mask, own_features, None, last,
                             top)
        # Each allocated size is a shape: start at, and grow in, large steps (as `Target.warm_up` reserves the
        # target's), so that the graphs the first generation compiles are those of the next ones.
        cache.slot_step = max(cache.slot_step, CACHE_STEP)
        cache.reserve(CACHE_STEP)
        visible = block_attention_mask(cache.length, positions, None) if mask is None else mask
        slots, positions, full_mask = padded_block(cache, positions, visible)
        pad = (0, 0, 0, positions.shape[0] - n)
        out = self.graph(F.pad(features, pad), F.pad(token_embeds, pad), positions, cache, full_mask, slots,
                         own_features, last, top)
        cache.block = n
        return (out[0][:n], *out[1:]) if top else out[:n]

    def _graph(self, features, token_embeds, positions, cache, mask, slots, own_features, last, top):
        return head_step(self.head, features, token_embeds, positions, cache, mask, own_features, slots, last, top)
