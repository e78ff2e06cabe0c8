"""Train an EAGLE head on 16 random stories260k sequences and print its per-step losses as JSON.

Run alone or under `torchrun --nproc_per_node 2`; the loss curve must be the same.
"""

import json
import sys
from pathlib import Path

import torch

from specula.runtime.target import FeatureRequest, Target
from specula.training.eagle_trainer import train_eagle
from specula.training.loop import TrainConfig

torch.set_num_threads(1)
stories, out = sys.argv[1], Path(sys.argv[2])
target = Target.load(stories, dtype="float32")
generator = torch.Generator().manual_seed(0)
samples = []
for i in range(16):
    ids = torch.randint(3, 500, (40 + i,), generator=generator)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[10:] = True
    hidden = target.prefill(ids, FeatureRequest(final_hidden=True)).hidden
    samples.append({"input_ids": ids, "loss_mask": mask, "hidden": hidden})
config = TrainConfig(epochs=2, batch_size=4, lr=3e-3, warmup_steps=2, save_every=100)
history = train_eagle(target, samples, [], out, config, log=lambda _: None)
print(json.dumps([h["loss"] for h in history if "loss" in h]))
