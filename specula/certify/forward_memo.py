"""A target whose forwards are remembered, so that many runs of the decode loop from one prompt share them.

`specula check` runs the method's full loop hundreds of times from the same prompt with different
seeds. Most of those runs share their beginning: the prompt's prefill always, and then every verify
forward until their sampled tokens part. `ForwardMemo` wraps a `Target` and keys each forward on the
exact sequence of cache operations since the last prefill (prefill tokens, every forward's tokens,
block mask, depths and feature request, every commit's kept rows, every truncation): a trie of histories. When a
forward's whole history has been seen, the remembered output is returned and the block's remembered
keys and values are written to the cache slots the real forward would have written.

Why this changes no result: a forward's output and the cache entries it writes are a deterministic
function of the cache contents and its arguments, and the cache contents are in turn a function of
the operations since the prefill. The key holds that whole history, not just the tokens (a token
committed from a verify block and the same token from a one-token step round differently), so a hit
returns bit for bit what the forward would compute, and the loop that consumes it (drafter, acceptor,
sampler, their random generator) runs unchanged. Only the target's forward is skipped; drafters and
acceptors, the code under test, always run. This assumes every cache operation goes through the memo,
i.e. no drafter runs the target's cache behind the loop's back (none does: EAGLE-style drafters only
read the target's embedding and head weights; a draft model has its own `Target`, which `specula check`
wraps in a memo of its own for the same reason).

Only targets with a static KV cache (the Llama-family runtime) are memoized; any other target runs
every forward. Memory is bounded by ``max_bytes``: past it, new forwards are computed and not kept.
"""

from __future__ import annotations

import torch

from specula.runtime.static_cache import StaticKVCache
from specula.runtime.target import FeatureRequest, ForwardOutput, Target

MAX_BYTES = 1 << 30
NO_FEATURES = FeatureRequest()


class _Node:
    """One history: the outputs of the forward that ended it (None after a commit) and its children."""

    __slots__ = ("children", "output", "keys", "values")

    def __init__(self, output: ForwardOutput | None = None, keys=None, values=None):
        self.children: dict[tuple, _Node] = {}
        self.output, self.keys, self.values = output, keys, values


def _nbytes(output: ForwardOutput, keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
    tensors = [output.logits, *keys, *values, *output.layer_inputs.values()]
    tensors += [] if output.hidden is None else [output.hidden]
    return sum(t.numel() * t.element_size() for t in tensors)


class ForwardMemo:
    """``target`` with remembered forwards; use it wherever the loop takes a target (same interface).

    ``forwards`` counts forwards computed, ``hits`` forwards answered from memory.
    """

    def __init__(self, target: Target, max_bytes: int = MAX_BYTES):
        self.target = target
        cache = getattr(target.runtime, "cache", None)
        self.cache = cache if isinstance(cache, StaticKVCache) else None
        self.root = _Node()
        self.node: _Node | None = None  # the current history; None = not tracked (memory budget spent)
        self.max_bytes, self.bytes = max_bytes, 0
        self.forwards = self.hits = 0

    def __getattr__(self, name: str):  # everything but the cache operations is the target's
        return getattr(self.target, name)

    @property
    def length(self) -> int:
        return self.target.length

    def reset(self) -> None:
        self.target.reset()
        self.node = self.root if self.cache is not None else None

    def truncate(self, length: int) -> None:
        self.target.truncate(length)
        # An empty cache is a fresh start. Cutting a tracked history to ``length`` leaves rows that are a function
        # of that history, and later forwards read only rows below the length, so the cut is one more operation
        # of the key (a draft model's loop drops its rejected drafts this way).
        if length == 0 and self.cache is not None:
            self.node = self.root
        elif self.node is not None:
            self.node = self.node.children.setdefault(("truncate", int(length)), _Node())

    def prefill(self, tokens: torch.Tensor, features: FeatureRequest = NO_FEATURES) -> ForwardOutput:
        """`Target.prefill`: reset, forward the whole prompt, commit it (each step remembered)."""
        self.reset()
        out = self.forward(tokens, features=features)
        self.commit()
        return out

    def forward(self, tokens: torch.Tensor, block_mask: torch.Tensor | None = None,
                depths: list[int] | torch.Tensor | None = None,
                features: FeatureRequest = NO_FEATURES, last_logits_only: bool = False) -> ForwardOutput:
        """`Target.forward`, answered from memory when this exact history was seen before."""
        if self.node is None:
            self.forwards += 1
            return self.target.forward(tokens, block_mask, depths, features, last_logits_only)
        key = ("forward", tuple(tokens.tolist()), last_logits_only,
               None if block_mask is None else (tuple(block_mask.shape), block_mask.cpu().numpy().tobytes()),
               None if depths is None else tuple(int(d) for d in depths), features)
        child = self.node.children.get(key)
        if child is not None:
            self.hits += 1
            start, n = self.cache.length, int(tokens.shape[0])
            for layer, (k, v) in enumerate(zip(child.keys, child.values, strict=True)):
                self.cache.keys[layer][:, :, start:start + n] = k
                self.cache.values[layer][:, :, start:start + n] = v
            self.cache.block = n
            self.node = child
            return child.output
        self.forwards += 1
        start = self.cache.length
        out = self.target.forward(tokens, block_mask, depths, features, last_logits_only)
        end = start + self.cache.block
        keys = [k[:, :, start:end].clone() for k in self.cache.keys]
        values = [v[:, :, start:end].clone() for v in self.cache.values]
        size = _nbytes(out, keys, values)
        if self.bytes + size > self.max_bytes:
            self.node = None  # full: compute the rest of this run plainly
            return out
        self.bytes += size
        child = self.node.children[key] = _Node(out, keys, values)
        self.node = child
        return out

    def commit(self, keep: list[int] | None = None) -> None:
        self.target.commit(keep)
        if self.node is not None:
            key = ("commit", None if keep is None else tuple(int(i) for i in keep))
            self.node = self.node.children.setdefault(key, _Node())
