"""What a draft costs per tree budget: the median time of an EAGLE-2/3 drafter's `propose` (catch-up step, tree
levels, reranking, the tree read back), and of one tree level alone, measured inside real decodes.

How the cost of a tree level was measured before and after the levels became one compiled graph (issue 42):

    .venv/bin/python scripts/tree_level_cost.py --weights q4_1 --compile --prompts data/smollm2_heldout_prompts.jsonl \\
        1/1/1 2/2/1 3/3/1 4/4/1 4/2/2 6/3/2 8/3/3

Each budget is TOTAL/DEPTH/TOP_K for the bundled EAGLE-3 head alone (no suffix candidates: the head's cost). Every
budget decodes every prompt in turn (two rounds), after a warm-up decode that compiles what it meets. One thread.
Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import specula
from specula.certify.check import read_prompts
from specula.decoding import warm_up
from specula.errors import SpeculaError


def parse_budget(text: str) -> dict:
    try:
        total, depth, top_k = (int(part) for part in text.split("/"))
    except ValueError:
        raise SpeculaError(f"budget {text!r} is not TOTAL/DEPTH/TOP_K, e.g. 4/2/2") from None
    return {"total_tokens": total, "depth": depth, "top_k": top_k}


def timed(function, record: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = function(*args, **kwargs)
        record.append(time.perf_counter() - start)
        return out
    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("budgets", nargs="+", metavar="TOTAL/DEPTH/TOP_K")
    parser.add_argument("--prompts", required=True, help="JSONL records with a 'prompt' field")
    parser.add_argument("--limit", type=int, default=4, help="prompts used (default 4)")
    parser.add_argument("--weights", default="q4_1")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        if args.limit < 1 or args.max_new_tokens < 1:
            raise SpeculaError("--limit and --max-new-tokens must be >= 1")
        budgets = [parse_budget(text) for text in args.budgets]
        prompts = read_prompts(args.prompts)[:args.limit]
        base = specula.load(None, method="vanilla", weights=args.weights, profile=False, compile=args.compile)
        speculators = [specula.load(base.target, "eagle3", profile=False, head_only=True, **budget)
                       for budget in budgets]
        for speculator in speculators:
            warm_up(base.target, speculator.drafter)
            speculator.generate(prompts[0], max_new_tokens=args.max_new_tokens)
    except SpeculaError as err:
        print(f"tree_level_cost: {err}", file=sys.stderr)
        return 2
    proposals: list[list[float]] = [[] for _ in budgets]
    levels: list[list[float]] = [[] for _ in budgets]
    for _ in range(2):
        for prompt in prompts:
            for speculator, propose_times, level_times in zip(speculators, proposals, levels, strict=True):
                drafter, step = speculator.drafter, speculator.drafter.level_step
                drafter.propose = timed(type(drafter).propose.__get__(drafter), propose_times)
                drafter.level_step = timed(step, level_times)
                try:
                    speculator.generate(prompt, max_new_tokens=args.max_new_tokens)
                finally:
                    del drafter.propose
                    drafter.level_step = step
    for text, propose_times, level_times in zip(args.budgets, proposals, levels, strict=True):
        level = f"{statistics.median(level_times) * 1e3:.3f} ms" if level_times else "-"
        print(f"{args.weights} {'compiled' if args.compile else 'eager'} {text:8s} propose median "
              f"{statistics.median(propose_times) * 1e3:.3f} ms (n={len(propose_times)}), level median {level}, "
              f"levels per draft {len(level_times) / len(propose_times):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
