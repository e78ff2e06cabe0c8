"""LDLP training data: at every response position, how many drafts a greedy EAGLE chain gets accepted.

For a sample t_0..t_{T-1} with target features f_0..f_{T-1} (the target's own greedy
continuation, so its tokens are the target's choices), position s plays "the last
accepted token" of a decoding cycle: the target has just emitted t_{s+1} (the next
root) and the EAGLE head has read the true pairs (f_i, t_{i+1}) for i <= s. The head
then drafts a chain greedily; its label is the number of drafts equal to t_{s+2},
t_{s+3}, ... before the first miss, at most ``max_length`` — exactly what greedy
decoding with a chain that long would accept there (`chain_acceptance` in
`eagle_trainer` measures the same chains one position at a time).

All positions of a sample are drafted together, one head step per chain depth: the
true pairs are computed once into the head's KV cache and every chain's draft
attends to the true pairs up to its own start and to its own earlier drafts (a
tree-shaped mask over one shared cache).

A chain still unbroken when the sample's response ends is *censored*: its label is a
lower bound. Training skips censored positions; the decoding simulation in the
trainer's evaluation uses them as they are (decoding stops there too).

Labels are kept in ``DIR/ldlp-labels-<key>.pt`` (written atomically), where the key
hashes the head, the target, the samples and ``max_length``: a rerun with the same
inputs reuses them, anything else gets its own file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specula.errors import SpeculaError
from specula.heads.eagle_head import EagleHead
from specula.outputs import atomic_write
from specula.readers import load_torch
from specula.target import Target
from specula.training.data import target_fingerprint


@torch.no_grad()
def chain_labels(head: EagleHead, target: Target, sample: dict[str, torch.Tensor], max_length: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels int64 [T], censored bool [T]) for one sample (input_ids [T], loss_mask [T], hidden [T, H]).

    labels[s] is the accepted length of the chain drafted after position s, -1 where s + 2 is not
    a response position (no draft of the chain would be a target choice).
    """
    device = target.device
    embed = target.model.get_input_embeddings()
    lm_head = target.model.get_output_embeddings()
    dtype = head.fc.weight.dtype
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
        guess = head.token_log_probs(feature, lm_head).argmax(-1)
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


class LabelledFeatures:
    """Items of a feature set with ``length_label`` int64 [T] and ``censored`` bool [T] added (a torch Dataset)."""

    def __init__(self, features, labels: list[torch.Tensor], censored: list[torch.Tensor]):
        self.features, self.labels, self.censored = features, labels, censored

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = dict(self.features[index])
        item["length_label"], item["censored"] = self.labels[index], self.censored[index]
        return item


def label_features(head: EagleHead, target: Target, features, max_length: int, directory: Path | None,
                   head_key: str, desc: str = "labels", log=print) -> LabelledFeatures:
    """Label every item of ``features`` (reusing ``directory``'s stored labels for the same inputs)."""
    path = None
    if directory is not None:
        path = Path(directory) / f"ldlp-labels-{_key(features, target, max_length, head_key)}.pt"
        if path.is_file():
            stored = load_torch(path, "LDLP labels file")
            if not isinstance(stored, dict) or not {"labels", "censored"} <= set(stored):
                raise SpeculaError(f"LDLP labels file {path} holds no labels; delete it to label again")
            log(f"reusing LDLP labels of {len(features)} samples from {path}")
            return LabelledFeatures(features, list(stored["labels"]), list(stored["censored"]))
    head = head.eval()
    labels, censored = [], []
    for index in tqdm(range(len(features)), desc=desc, dynamic_ncols=True):
        label, cut = chain_labels(head, target, features[index], max_length)
        labels.append(label)
        censored.append(cut)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: torch.save({"labels": labels, "censored": censored}, tmp))
    return LabelledFeatures(features, labels, censored)


def _key(features, target: Target, max_length: int, head_key: str) -> str:
    digest = hashlib.sha256(json.dumps([head_key, max_length, target_fingerprint(target)], sort_keys=True).encode())
    for index in range(len(features)):
        item = features[index]
        digest.update(item["input_ids"].long().numpy().tobytes())
        digest.update(item["loss_mask"].bool().numpy().tobytes())
    return digest.hexdigest()[:16]
