"""Many sequences in one target forward: their blocks packed into one row of tokens.

Each sequence is a `Target.fork` of one target (same weights, its own KV cache) with a block to run
(a prompt, a draft tree, or one token). `forward_packed` runs every linear layer once over all the
blocks' tokens — on a CPU a matmul over 16 rows costs a few times one row, not sixteen (the
verify-cost curve `specula calibrate` measures) — and attention per sequence over its own cache,
then hands each sequence the rows of its own block. Nothing mixes across sequences but the rows of a
matmul, so a sequence's output does not depend on its neighbours as long as the kernel computes each
row on its own: exactly so for the q4_1 kernel (`specula.kernels.q4_1`); float32 BLAS may round a row
differently with the batch size, which `specula check` classifies as a near-tie where it happens.

Llama-family targets pack; others run their blocks one after another (the same results, unbatched).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specula.errors import SpeculaError
from specula.runtime.forward import FeatureRequest, ForwardOutput, LlamaFamilyRuntime
from specula.runtime.static_cache import Segment, block_attention_mask
from specula.runtime.target import Target, forward_threads


@dataclass
class Block:
    """One forward a sequence needs: ``tokens`` [n] after its committed prefix, ``mask`` bool [n, n] (which
    block tokens each sees; None = causal chain), ``depths`` [n] (position offsets; None = 0..n-1) and the
    hidden states its drafter asks for."""

    tokens: torch.Tensor
    mask: torch.Tensor | None
    depths: list[int] | torch.Tensor | None
    features: FeatureRequest
    last_logits_only: bool = False  # a prompt: only its last row's logits are used (the rest are not computed)

    def run(self, target: Target) -> ForwardOutput:
        """This block alone through ``target``."""
        return target.forward(self.tokens, self.mask, self.depths, self.features, self.last_logits_only)


@torch.no_grad()
def forward_packed(targets: list[Target], blocks: list[Block]) -> list[ForwardOutput]:
    """Run ``blocks[i]`` after ``targets[i]``'s committed prefix, for every i, in one pass when they pack.

    ``targets`` are forks of one target (distinct caches). Returns one `ForwardOutput` per block, as
    `Target.forward` would (a ``last_logits_only`` block's logits are its last row's alone, [1, V]: sixteen
    joining prompts of 1,000 tokens would otherwise hold 3 GB of SmolLM2 logits); each target's block is then
    provisional until its `Target.commit`.
    """
    if len(targets) != len(blocks):
        raise ValueError(f"{len(targets)} targets for {len(blocks)} blocks")
    runtimes = [t.runtime for t in targets]
    if len(targets) == 1 or not all(isinstance(r, LlamaFamilyRuntime) for r in runtimes):
        return [block.run(target) for target, block in zip(targets, blocks, strict=True)]
    if len({id(r.cache) for r in runtimes}) != len(runtimes):
        raise ValueError("packed sequences need one KV cache each (Target.fork)")
    base = runtimes[0]
    device = targets[0].device
    segments: dict[int | None, list[Segment]] = {w: [] for w in set(base.windows)}
    positions, start = [], 0
    for target, runtime, block in zip(targets, runtimes, blocks, strict=True):
        n, prefix = int(block.tokens.shape[0]), runtime.cache.length
        if prefix + n > target.max_length:
            raise SpeculaError(f"context of {prefix + n} tokens exceeds the limit of {target.max_length}")
        depths = torch.arange(n, device=device) if block.depths is None else torch.as_tensor(block.depths,
                                                                                            device=device)
        positions.append(prefix + depths)
        causal = block.mask is None and prefix == 0
        for window, listed in segments.items():
            mask = block_attention_mask(prefix, positions[-1], block.mask, window)
            chain = block.mask is None and prefix > 0 and window is None
            listed.append(Segment(runtime.cache, start, start + n, mask, causal, chain))
        start += n
    wanted = FeatureRequest(any(b.features.final_hidden for b in blocks),
                            tuple(sorted({i for b in blocks for i in b.features.layer_inputs})))
    spans = segments[next(iter(segments))]
    logit_rows = torch.cat([torch.arange(s.end - 1 if b.last_logits_only else s.start, s.end, device=device)
                            for s, b in zip(spans, blocks, strict=True)])
    base.refresh_fused()
    native = base.native()
    if native is not None and not native.takes_packed(spans):
        native = None
    tokens = torch.cat([block.tokens.to(device) for block in blocks])
    with forward_threads(int(tokens.shape[0]), any(b.last_logits_only for b in blocks), device):
        out = base.run(tokens, torch.cat(positions), {}, False, wanted, segments=segments, logit_rows=logit_rows,
                       native=native)
    outputs, first = [], 0
    for s, block in zip(spans, blocks, strict=True):
        count = 1 if block.last_logits_only else s.end - s.start
        rows = out.select(slice(s.start, s.end))
        outputs.append(ForwardOutput(out.logits[first:first + count], rows.hidden, rows.layer_inputs))
        first += count
    return outputs
