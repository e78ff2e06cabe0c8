"""The Llama-family target's decode and verify step under `torch.compile`, with static shapes.

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
from specula.static_cache import SlotBlock, block_attention_mask

BLOCK_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CACHE_STEP = 1024  # KV slots: the compiled step's cache grows in these steps (each size compiles anew)
# Blocks a long-running command (bench, serve) compiles before its first request (`Target.warm_up`): the
# default trees and chains on a CPU verify at most 16 tokens (eagle/eagle2/eagle3 11, pld 11, the bundled
# Medusa tree 16); a larger block still compiles when it is first met.
WARM_UP_BLOCK = 16


def bucket(n: int) -> int | None:
    """The padded size of a block of n tokens, or None when it is longer than every bucket."""
    return next((size for size in BLOCK_BUCKETS if size >= n), None)


class CompiledStep:
    """Runs a `_LlamaFamilyRuntime`'s forward for blocks of up to `BLOCK_BUCKETS[-1]` tokens, compiled."""

    def __init__(self, runtime):
        self.runtime = runtime
        # On a CPU, Inductor's C++ wrapper calls the step's kernels from C++ rather than from generated
        # Python: SmolLM2 q4_1 one-token step 11.2 -> 9.4-10.3 ms (each new shape takes ~2 min to build cold,
        # seconds from Inductor's cache after).
        options = {"cpp_wrapper": True} if runtime.cache.keys[0].device.type == "cpu" else {}
        # No guards on the model's modules (their weights never change once a target is compiled; the KV
        # cache, block shapes and feature requests, which do, stay guarded): every step evaluated ~1 ms of
        # them (median of 3 interleaved runs 10.2 -> 9.3 ms).
        unguarded = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)  # not in older torch
        if unguarded is not None:
            options["guard_filter_fn"] = unguarded
        attention_kernel()  # decided (and built) before tracing: the graph reads the answer
        self.graph = torch.compile(self._graph, fullgraph=True, dynamic=False, options=options)
        # One graph per block size, cache size and feature request: more than dynamo's default limit of 8.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # Each allocated cache size is a shape: grow in large steps, so that a chat stays on one or two.
        runtime.cache.slot_step = max(runtime.cache.slot_step, CACHE_STEP)

    def accepts(self, n: int) -> bool:
        """Whether a block of n tokens takes this path (else the eager step runs it): not a prefill."""
        cache = self.runtime.cache
        padded = bucket(n)
        # A block padded past the cache's capacity (near the context limit) runs eager: its padding would
        # write slots that do not exist.
        return (cache.length > 0 and padded is not None and cache.length + padded <= cache.capacity
                and all(window is None for window in self.runtime.windows))

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor | None, features):
        """The runtime's `ForwardOutput` for a block ``tokens`` [n] at ``positions`` [n] after the prefix."""
        runtime, cache = self.runtime, self.runtime.cache
        n, padded, prefix = tokens.shape[0], bucket(tokens.shape[0]), cache.length
        cache.reserve(prefix + padded)
        device = tokens.device
        slots = SlotBlock(torch.arange(prefix, prefix + padded, device=device), torch.tensor(prefix + padded))
        tokens = F.pad(tokens, (0, padded - n))
        positions = torch.cat([positions, positions.new_full((padded - n,), prefix)])
        # The block's rows see what the eager step's mask lets them see; None here is one token after a
        # prefix (prefills never come here), which sees everything before it.
        mask = torch.zeros(padded, cache.allocated, dtype=torch.bool, device=device)
        visible = block_attention_mask(prefix, positions[:n], block_mask)
        mask[:n, :prefix + n] = True if visible is None else visible[0, 0]
        rows = torch.arange(n, padded, device=device)
        mask[rows, prefix + rows] = True  # a padding row sees only itself
        runtime.refresh_fused()  # before the graph reads the stacks
        out = self.graph(tokens, slots, positions, mask[None, None], features)
        cache.block = n
        return out.select(slice(0, n))

    def _graph(self, tokens, slots, positions, mask, features):
        return self.runtime.run(tokens, positions, {None: mask}, False, features, slots)
