"""The target's next-token distribution over a head's draft vocabulary, from the top-k that generation captured.

Generated data (`specula.training.generated`) keeps, per position, the target's k most probable next tokens
and their probabilities at temperature 1, from the forward that wrote the sequence in the format being served
(a q4_1 LM head has no float weight to recompute logits from, and its features are stored in 16 bits). A
trainer restricted to a draft vocabulary keeps the entries inside it and renormalises them: the distribution
a head learns is the target's top-k restricted to the draft vocabulary.
"""

from __future__ import annotations

import torch


def draft_target_top(dist_ids: torch.Tensor, dist_probs: torch.Tensor, vocab: torch.Tensor | None,
                     vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft ids [B, T, k], probabilities [B, T, k], usable bool [B, T]) from top-k ids [B, T, k] and probabilities
    [B, T, k]: the target's top-k kept sparse (a dense [B, T, Vd] copy per training-time-test step took gigabytes).

    ``vocab``: the draft vocabulary's sorted target ids [Vd] (None: the whole vocabulary, ``vocab_size`` ids). Entries
    outside it get probability 0 (and id 0); the rest are renormalised. A position is usable where its most probable
    token lies in the draft vocabulary (as the trainers require of the argmax) and a distribution was captured there;
    elsewhere its probabilities are zero. The first entry of a usable row is its most probable draft token.
    """
    if vocab is None:
        slots = dist_ids.long()
    else:
        where = torch.full((vocab_size,), -1, dtype=torch.long, device=dist_ids.device)
        where[vocab.to(dist_ids.device)] = torch.arange(len(vocab), device=dist_ids.device)
        slots = where[dist_ids.long()]
    probs = dist_probs.float() * (slots >= 0)
    usable = (dist_probs[..., 0] > 0) & (slots[..., 0] >= 0)
    total = probs.sum(-1, keepdim=True)
    probs = torch.where(usable[..., None], probs / total.clamp(min=1e-12), 0.0)
    return slots.clamp(min=0), probs, usable
