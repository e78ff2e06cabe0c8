"""LDLP training data: at every response position, how many drafts a greedy EAGLE chain gets accepted.

For a sample t_0..t_{T-1} with target features f_0..f_{T-1} (the target's own greedy
continuation, so its tokens are the target's choices), position s plays "the last
accepted token" of a decoding cycle: the target has just emitted t_{s+1} (the next
root) and the EAGLE head has read the true pairs (f_i, t_{i+1}) for i <= s. The head
then drafts a chain greedily; its label is the number of drafts equal to t_{s+2},
t_{s+3}, ... before the first miss, at most ``max_length`` — exactly what greedy
decoding with a chain that long would accept there. The chains are drafted by
`specula.training.chain.chain_labels`, all positions of a sample at once (the
trainers' n-α evaluation reads the same chains).

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
from specula.files.outputs import atomic_write
from specula.files.readers import load_torch
from specula.heads.base import DraftHead
from specula.runtime.target import Target
from specula.training.chain import chain_labels
from specula.training.fingerprints import target_fingerprint


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


def label_features(head: DraftHead, target: Target, features, max_length: int, directory: Path | None,
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
