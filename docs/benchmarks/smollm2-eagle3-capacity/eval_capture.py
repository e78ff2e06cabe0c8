"""Evaluation answers for scoring heads: the q4_1 target's greedy answers with features captured as it writes
(`specula.training.capture.answer_prompts`, what `specula train eagle3 --eval-prompts` runs).

usage: eval_capture.py mtbench|heldout OUT.pt [THREADS]
mtbench: ../shared/data/mt_bench/question.jsonl, both turns (the model's own first answer in context), 128 tokens
a turn, as `specula bench` asks them; heldout: data/smollm2_heldout_prompts.jsonl, 256 tokens.
"""
import sys
import time

import torch

from specula.bench.questions import read_questions
from specula.methods import DEFAULT_TARGET
from specula.runtime.target import FeatureRequest, Target
from specula.training.capture import answer_prompts

which, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
target = Target.load(DEFAULT_TARGET, dtype="float32", weights="q4_1")
files = {"mtbench": ("../shared/data/mt_bench/question.jsonl", 128),
         "heldout": ("data/smollm2_heldout_prompts.jsonl", 256)}
path, tokens = files[which]
start = time.time()
conversations = [list(q.turns) for q in read_questions(path)]
samples = answer_prompts(target, conversations, FeatureRequest(True, (2, 15, 27)), tokens, batch_size=40)
torch.save(samples, out)
print(f"{len(samples)} samples, {sum(int(s['loss_mask'].sum()) for s in samples)} response tokens, "
      f"{time.time() - start:.0f} s")
