"""Speed check: vanilla decoding through specula's runtime against `transformers` generate.

Both decode the same prompts greedily (stopping at the same EOS),
interleaved run by run so machine drift hits both alike; tokens/s are printed
side by side with their ratio and whether the outputs were identical.

    specula speedcheck --dtype float32,bfloat16 --prompts 8 --max-new-tokens 128
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from specula.bench.questions import read_questions
from specula.decoding import generate_tokens
from specula.drafters.vanilla import VanillaDrafter
from specula.runtime.plain_model import transformers_model
from specula.runtime.target import Target
from specula.sampling import SamplingParams

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "pycode" / "eval.jsonl"


def read_prompts(path: Path, limit: int) -> list[str]:
    """First turns of the first ``limit`` questions of a question file (any format `bench` reads)."""
    return [question.turns[0] for question in read_questions(path)[:limit]]


def run(target_dir: str, dtype: str, prompts: list[str], max_new_tokens: int, max_prompt_tokens: int,
        repeats: int) -> dict:
    target = Target.load(target_dir, dtype=dtype)
    model, tokenizer = transformers_model(target.model), target.tokenizer
    encoded = [torch.tensor(tokenizer(p).input_ids[-max_prompt_tokens:]) for p in prompts]
    greedy = SamplingParams()

    def ours(ids):
        return generate_tokens(target, VanillaDrafter(), ids, max_new_tokens, greedy)[0]

    def theirs(ids):
        with torch.no_grad():
            return model.generate(ids[None], do_sample=False, max_new_tokens=max_new_tokens)[0, len(ids):]

    ours(encoded[0])  # warm-up both
    theirs(encoded[0])
    rates = {"specula": [], "transformers": []}
    identical = 0
    for _ in range(repeats):
        for ids in encoded:
            start = time.perf_counter()
            mine = ours(ids)
            middle = time.perf_counter()
            reference = theirs(ids).tolist()
            end = time.perf_counter()
            rates["specula"].append(len(mine) / (middle - start))
            rates["transformers"].append(len(reference) / (end - middle))
            identical += mine == reference
    mean = {k: statistics.mean(v) for k, v in rates.items()}
    return {
        "target": target_dir, "dtype": str(target.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "runs": len(rates["specula"]), "max_new_tokens": max_new_tokens,
        "specula_tokens_per_s": round(mean["specula"], 1),
        "transformers_tokens_per_s": round(mean["transformers"], 1),
        "ratio": round(mean["specula"] / mean["transformers"], 3),
        "identical_outputs": f"{identical}/{len(rates['specula'])}",
    }
