"""The target's next-token distribution over a head's draft vocabulary, from the top-k that generation captured.

Generated data (`specula.training.generated`) keeps, per position, the target's k most probable next tokens
and their probabilities at temperature 1, from the forward that wrote the sequence in the format being served
(a q4_1 LM head has no float weight to recompute logits from, and its features are stored in 16 bits). A
trainer restricted to a draft vocabulary keeps the entries inside it and renormalises them: the distribution
a head learns is the target's top-k restricted to the draft vocabulary.
"""

from __future__ import annotations

import torch


def draft_target_probs(dist_ids: torch.Tensor, dist_probs: torch.Tensor, vocab: torch.Tensor | None,
                       vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities [B, T, Vd], usable bool [B, T]) from top-k ids [B, T, k] and probabilities [B, T, k].

    ``vocab``: the draft vocabulary's sorted target ids [Vd] (None: the whole vocabulary). A position is usable
    where its most probable token lies in the draft vocabulary (as the trainers require of the argmax) and a
    distribution was captured there; elsewhere the returned row is zero.
    """
    if vocab is None:
        slots = dist_ids
        width = vocab_size
    else:
        where = torch.full((vocab_size,), -1, dtype=torch.long, device=dist_ids.device)
        where[vocab.to(dist_ids.device)] = torch.arange(len(vocab), device=dist_ids.device)
        slots = where[dist_ids]
        width = len(vocab)
    probs = dist_probs.float() * (slots >= 0)
    out = torch.zeros(*dist_ids.shape[:-1], width, dtype=torch.float32, device=dist_ids.device)
    out.scatter_add_(-1, slots.clamp(min=0), probs)
    usable = (dist_probs[..., 0] > 0) & (slots[..., 0] >= 0)
    total = out.sum(-1, keepdim=True)
    out = torch.where(usable[..., None], out / total.clamp(min=1e-12), 0.0)
    return out, usable
