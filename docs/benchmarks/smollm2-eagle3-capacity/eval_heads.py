"""n-alpha (greedy chains from every response position) of EAGLE-3 heads on captured evaluation sets."""
import os
import sys
import time

import torch

from specula.heads.formats import load_head
from specula.methods import DEFAULT_TARGET
from specula.runtime.target import Target
from specula.training.chain import chain_acceptance

torch.set_num_threads(1)
target = Target.load(DEFAULT_TARGET, dtype="float32", weights="float32")  # only the embedding is read
sets = {name: torch.load(f"{os.environ.get('EVAL_DIR', '.')}/eval-{name}.pt") for name in ("mtbench", "heldout")}
for head_dir in sys.argv[1:]:
    head = load_head(head_dir, 30, dtype=torch.float32)
    start = time.time()
    row = [head_dir, f"layers {1 + len(head.layers)}", f"vocab {head.draft_vocab_size}"]
    for name, samples in sets.items():
        rates = chain_acceptance(head, target, samples, 3)
        row.append(f"{name} " + " ".join(f"{r:.3f}" for r in rates))
    print(" | ".join(row), f"({time.time() - start:.0f} s)", flush=True)
