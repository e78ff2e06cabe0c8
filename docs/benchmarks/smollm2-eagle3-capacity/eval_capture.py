"""Evaluation data for head selection: the q4_1 target's greedy answers with features captured as it writes.

mtbench: 80 questions, both turns (the model's own first answer in context), 128 tokens a turn, like `specula bench`.
heldout: data/smollm2_heldout_prompts.jsonl, 256 tokens.
Writes a list of sample dicts (GeneratedData's keys) to OUT.pt.
"""
import json
import sys
import time

import torch

from specula.methods import DEFAULT_TARGET
from specula.runtime.target import FeatureRequest, Target
from specula.training.capture import CaptureEngine
from specula.training.conversations import Conversation, Job, Turn

which, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
target = Target.load(DEFAULT_TARGET, dtype="float32", weights="q4_1")
request = FeatureRequest(True, (2, 15, 27))
jobs = []
if which == "mtbench":
    for i, line in enumerate(open("../shared/data/mt_bench/question.jsonl")):
        q = json.loads(line)
        turns = (Turn("user", (q["turns"][0],)), Turn("assistant", (), 0.0, 128),
                 Turn("user", (q["turns"][1],)), Turn("assistant", (), 0.0, 128))
        jobs.append(Job(i, "mtbench", 0, 0.0, (Conversation(turns),)))
else:
    for i, line in enumerate(open("data/smollm2_heldout_prompts.jsonl")):
        p = json.loads(line)["prompt"]
        jobs.append(Job(i, "heldout", 0, 0.0, (Conversation((Turn("user", (p,)), Turn("assistant", (), 0.0, 256))),)))
samples = []


def done(job, found):
    for s in found:
        probs = s.dist_probs.float()
        ids = s.dist_ids.long()
        samples.append({"input_ids": s.input_ids.long(), "loss_mask": s.loss_mask, "dist_ids": ids,
                        "dist_probs": probs, "target_top": torch.where(probs[:, 0] > 0, ids[:, 0], 0),
                        "layer_inputs": s.layer_inputs, "hidden": s.hidden})


start = time.time()
engine = CaptureEngine(target, request, 32, torch.float32, 40, 4096)
engine.run(iter(jobs), done)
torch.save(samples, out)
print(f"{len(samples)} samples, {sum(int(s['loss_mask'].sum()) for s in samples)} response tokens, "
      f"{time.time() - start:.0f} s")
