"""Greedy draft chains from every position of a sample at once, checked against the sample's own tokens.

For a sample t_0..t_{T-1} with target features f_0..f_{T-1} (the target's own
continuation, so its tokens are the target's choices), position s plays "the last
accepted token" of a decoding cycle: the head has read the true pairs (f_i, t_{i+1})
for i <= s and drafts a chain greedily; its length is the number of drafts equal to
t_{s+2}, t_{s+3}, ... before the first miss — exactly what greedy decoding with a
chain that long accepts there. The LDLP learns these lengths (`training/ldlp_data.py`)
and the trainers report n-α from them (`chain_acceptance`).

All positions are drafted together, one head step per chain depth: the true pairs are
computed once into the head's KV cache and every chain's draft attends to the true
pairs up to its own start and to its own earlier drafts (a tree-shaped mask over one
shared cache), so there is no per-position Python loop.
"""

from __future__ import annotations

import torch

from specula.heads.base import DraftHead
from specula.runtime.target import Target


@torch.no_grad()
def chain_labels(head: DraftHead, target: Target, sample: dict[str, torch.Tensor], max_length: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels int64 [T], censored bool [T]) for one sample (input_ids [T], loss_mask [T], hidden [T, H]).

    labels[s] is the accepted length of the chain drafted after position s, -1 where s + 2 is not
    a response position (no draft of the chain would be a target choice).
    """
    device = target.device
    embed = target.model.get_input_embeddings()
    head.attach(target)
    dtype = next(head.parameters()).dtype
    ids = sample["input_ids"].to(device)
    response = sample["loss_mask"].bool().to(device)
    length = ids.shape[0]
    labels = torch.full((length,), -1, dtype=torch.long)
    censored = torch.zeros(length, dtype=torch.bool)
    if length < 3:
        return labels, censored
    starts = torch.nonzero(response[2:]).flatten()  # s with t_{s+2} in the response
    if not len(starts):
        return labels, censored
    features = head.sample_features(sample).to(device, dtype)
    pairs = length - 1  # true pair i = (f_i, t_{i+1}) sits in cache slot i
    cache = head.new_cache(pairs + len(starts) * max_length)
    predicted = head.step(features[:pairs], embed(ids[1:]).to(dtype), torch.arange(pairs, device=device),
                          cache, None)
    cache.commit()
    count = torch.zeros(len(starts), dtype=torch.long, device=device)
    slots = torch.full((len(starts), max_length), -1, dtype=torch.long, device=device)  # cache slot of draft n
    alive = torch.arange(len(starts), device=device)  # chains whose drafts all matched so far
    feature = predicted[starts]  # [R, H]: the head's prediction of f_{s+1}
    for n in range(max_length):
        wanted = starts[alive] + 2 + n  # draft n of the chain after s guesses t_{s+2+n}
        checkable = (wanted < length) & response[wanted.clamp(max=length - 1)]
        censored[starts[alive[~checkable]].cpu()] = True  # unbroken, but nothing left to check against
        alive, feature, wanted = alive[checkable], feature[checkable], wanted[checkable]
        if not len(alive):
            break
        guess = head.top_tokens(feature, 1)[0][:, 0]
        hit = guess == ids[wanted]
        count[alive[hit]] += 1
        alive, feature, wanted = alive[hit], feature[hit], wanted[hit]
        if n == max_length - 1 or not len(alive):
            break
        # Feed (own feature, matched token) at position s + 1 + n; it sees the true pairs 0..s and its own drafts.
        prefix, rows = cache.length, len(alive)
        mask = torch.zeros(rows, prefix + rows, dtype=torch.bool, device=device)
        mask[:, :pairs] = torch.arange(pairs, device=device)[None] <= starts[alive][:, None]
        own = slots[alive, :n]
        mask[torch.arange(rows, device=device)[:, None].expand_as(own), own] = True
        mask[torch.arange(rows), prefix + torch.arange(rows)] = True
        feature = head.step(feature, embed(ids[wanted]).to(dtype), starts[alive] + 1 + n, cache,
                            mask[None, None], own_features=True)
        cache.commit()
        slots[alive, n] = prefix + torch.arange(rows, device=device)
    labels[starts.cpu()] = count.cpu()
    return labels, censored


@torch.no_grad()
def chain_acceptance(head: DraftHead, target: Target, samples, max_steps: int = 4) -> list[float]:
    """Acceptance rates n-α, n = 0..max_steps-1, of greedy chains from every response position of ``samples``.

    n-α is the fraction of drafts n (0-based; draft n reads n of the head's own outputs) equal to the
    sample's next token, among the drafts whose earlier drafts all were and that had a token to match.
    """
    tried = torch.zeros(max_steps, dtype=torch.long)
    accepted = torch.zeros(max_steps, dtype=torch.long)
    steps = torch.arange(max_steps)
    for sample in samples:
        lengths, censored = chain_labels(head, target, sample, max_steps)
        drafted = lengths >= 0
        lengths, censored = lengths[drafted, None], censored[drafted, None]
        # Draft n was judged when the first n matched and, if the chain stopped there, not for want of a token.
        tried += ((lengths > steps) | ((lengths == steps) & ~censored)).sum(0)
        accepted += (lengths > steps).sum(0)
    return [a / t if t else 0.0 for a, t in zip(accepted.tolist(), tried.tolist(), strict=True)]
