"""First-draft hits of a head by the target's confidence in the token it drafts (MT-bench eval set)."""
import os
import sys

import torch

from specula.heads.formats import load_head
from specula.methods import DEFAULT_TARGET
from specula.runtime.target import Target
from specula.training.chain import chain_labels

torch.set_num_threads(1)
target = Target.load(DEFAULT_TARGET, dtype="float32", weights="float32")
which = sys.argv[2] if len(sys.argv) > 2 else "mtbench"
samples = torch.load(f"{os.environ.get('EVAL_DIR', '.')}/eval-{which}.pt")
head = load_head(sys.argv[1], 30, dtype=torch.float32)
edges = torch.tensor([0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.01])
hits = torch.zeros(len(edges) - 1)
tries = torch.zeros(len(edges) - 1)
in_vocab = 0
total = 0
for s in samples:
    labels, censored = chain_labels(head, target, s, 1)
    starts = (labels >= 0).nonzero().flatten()
    # draft after s guesses t_{s+2}; the target decided it at position s+1 with probability dist_probs[s+1, 0]
    conf = s["dist_probs"][starts + 1, 0]
    tok = s["input_ids"][starts + 2]
    in_vocab += int(head.t2d[tok].sum())
    total += len(starts)
    bucket = torch.bucketize(conf, edges, right=True) - 1
    hits.index_add_(0, bucket, (labels[starts] > 0).float())
    tries.index_add_(0, bucket, torch.ones(len(starts)))
for i in range(len(edges) - 1):
    share, rate = tries[i] / tries.sum(), hits[i] / max(tries[i], 1)
    print(f"p1 in [{edges[i]:.2f},{edges[i + 1]:.2f}): share {share:.3f} alpha1 {rate:.3f}")
print(f"all: {hits.sum() / tries.sum():.3f}; target token in draft vocab {in_vocab / total:.3f}")
