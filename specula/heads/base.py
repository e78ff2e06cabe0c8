"""The draft-head interface: what a feature-level draft head (EAGLE, EAGLE-3) offers the code that drives it.

`EagleDrafter` (decoding), the batched greedy chains of `specula.training.chain`
(trainers' acceptance and the LDLP's labels) and `specula train` use a head only
through these members, so a new head kind is one class implementing them.
Names follow SpecForge's split of a draft model into reading the target
(`target_features`), one step (`step`) and the output layer (`token_log_probs`, `top_tokens`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from specula.runtime.static_cache import SlotBlock, StaticKVCache
from specula.runtime.target import FeatureRequest, ForwardOutput, Target

# The config key naming the weights format of the target whose features and answers a head learned from (a
# trainer writes it; "q4_1", "float32", ...): a head fits that format best (heads/bundled/*/README.md measure
# what another format costs). Serving frameworks ignore keys they do not know.
TRAINED_ON_WEIGHTS = "trained_on_weights"


class DraftHead(Protocol):
    """A head that predicts the target's next feature from (feature, next-token embedding) pairs.

    H is the head's hidden size; F the width of the target features it reads (H for EAGLE,
    L·H for EAGLE-3's fused layers); V the target's vocabulary.
    """

    hidden_size: int

    def attach(self, target: Target) -> DraftHead:
        """Bind the target modules the head reads but does not store (EAGLE: the LM head) and check that
        the head fits the target. Drivers call it once before drafting; returns the head."""

    def feature_request(self) -> FeatureRequest:
        """Which hidden states the head reads from every target forward."""

    def target_features(self, out: ForwardOutput) -> torch.Tensor:
        """The head's input features [n, F] from a target forward's output rows."""

    def sample_features(self, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """The head's input features [.., T, F] of a cached training sample or batch."""

    def new_cache(self, capacity: int) -> StaticKVCache:
        """An empty KV cache for ``capacity`` pairs."""

    def step(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
             cache: StaticKVCache, mask: torch.Tensor | None, own_features: bool = False,
             slots: SlotBlock | None = None) -> torch.Tensor:
        """Predicted features [n, H] for n pairs after the cache: features [n, F] from the target (or [n, H],
        the head's own predictions, when ``own_features``), token_embeds [n, H], positions [n],
        mask bool [1, 1, n, cache.length + n] or None for a causal chain. ``slots``: where a compiled step
        writes the block (`specula.runtime.compiled_step.padded_block`); its mask then covers the whole allocation."""

    def token_log_probs(self, predicted: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [n, V] over the target vocabulary (-inf for tokens the head never drafts)."""

    def drafted_logits(self, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [n, Vd] over the tokens the head can draft, their target ids int64 [Vd] — None when they are
        the target's whole vocabulary in order): sampled drafts are drawn in this space (EAGLE-3 on SmolLM2:
        8,192 tokens of 49,152), and only their distribution is widened to the target's vocabulary."""

    def top_tokens(self, predicted: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``count`` likeliest tokens per row, as target ids int64 [n, count], with their log-probabilities
        [n, count] (`top_of` the head's logits): greedy drafting needs no whole log-probability rows."""


def top_of(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64 [n, count], log-probabilities [n, count]) of the ``count`` largest of logits [n, V].

    One child (the CPU default) is a max, ~0.15 ms cheaper than a topk over 49,152 logits; the
    log-probabilities come from one log-sum-exp per row instead of a whole log-softmax row.
    """
    logits = logits.float()
    best = logits.max(dim=-1, keepdim=True) if count == 1 else torch.topk(logits, count, dim=-1)
    return best.indices, best.values - torch.logsumexp(logits, dim=-1, keepdim=True)
