"""The server's engine in one process, its batch kept full: how the draft budget's choices pay, per batch size.

`scripts/serve_load.py` measures the whole server over HTTP, with clients that think between requests; this
puts N requests into a `BatchedEngine` at once with ``--max-batch B``, so B sequences decode together until the
queue runs dry (MT-bench first turns, T=0), and reports tokens/s per configuration, side by side and in
rounds (the machine drifts by minutes). Configurations:

- ``vanilla``: the vanilla method (no drafter);
- ``measured``: the method with the measured draft budget, as `specula serve` runs it;
- ``pooled``: the same, but every draft counted as one kind (the budget before it learned kinds of draft);
- ``table:1:8,4:2``: a fixed ``--draft-budget`` table;
- ``CONFIG@METHOD``: any of these with another method than ``--method`` (``measured@eagle3``).

    .venv/bin/python scripts/serve_batch.py --method suffix --batch 4 --requests 24 \\
        --configs vanilla,pooled,measured --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

import specula
from specula.draft_budget import DraftBudget, measured_curve, parse_budget_table
from specula.serve.engine import BatchedEngine
from specula.serve.requests import Failed, Finished, GenerationRequest

QUESTIONS = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "mt_bench" / "question.jsonl"


class PooledBudget(DraftBudget):
    """The measured budget with every draft counted as one kind."""

    def observe(self, nodes_per_depth, accepted, draft_seconds, cap=None, kind="", **cycle):
        super().observe(nodes_per_depth, accepted, draft_seconds, cap, **cycle)


async def serve(engine: BatchedEngine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Submit every prompt at once; (completion tokens, seconds until the last one finished)."""
    start = time.perf_counter()
    streams = [engine.submit(GenerationRequest(tuple(p), max_tokens, temperature=0.0)) for p in prompts]
    tokens = 0
    for stream in streams:
        async for event in stream:
            if isinstance(event, Finished):
                tokens += event.completion_tokens
            elif isinstance(event, Failed):
                raise SystemExit(f"a request failed: {event.status} {event.message}")
    return tokens, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="suffix")
    p.add_argument("--weights", default="q4_1")
    p.add_argument("--batch", type=int, default=16, help="sequences per forward (--max-batch)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--configs", default="vanilla,pooled,measured")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    configs = [c if "@" in c or c == "vanilla" else f"{c}@{args.method}" for c in args.configs.split(",")]
    speculators = {"vanilla": specula.load(method="vanilla", weights=args.weights)}
    for method in {c.partition("@")[2] for c in configs} - {""}:
        speculators[method] = specula.load(speculators["vanilla"].target, method=method)
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines()][:args.requests]
    prompts = [speculators["vanilla"].encode(q["turns"][0]).tolist() for q in questions]
    curve = measured_curve(speculators["vanilla"].target, args.batch)
    rates: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for config in configs:
            kind, _, method = config.partition("@")
            if kind.startswith("table:"):
                budget = DraftBudget(table=parse_budget_table(kind[6:]), max_batch=args.batch)
            else:
                budget = (PooledBudget if kind == "pooled" else DraftBudget)(curve, max_batch=args.batch)
            speculator = speculators[method or "vanilla"]
            engine = BatchedEngine(speculator, max_queue=len(prompts), max_batch=args.batch, budget=budget)
            engine.start()

            async def run(engine=engine):
                return await serve(engine, prompts, args.max_tokens)

            tokens, seconds = asyncio.run(run())
            engine.stop()
            rates.setdefault(config, []).append(tokens / seconds)
            print(f"round {round_ + 1} {config}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.1f} tokens/s",
                  flush=True)
            if budget.table is None and budget.deepest:
                print(f"    caps at {args.batch} (depth, main chain only): all drafts {budget.best_cap(args.batch)}, "
                      + ", ".join(f"{kind} {budget.best_cap(args.batch, kind)}" for kind in sorted(budget.kinds))
                      + f" (None: uncapped; drafting {budget.draft_cost(1) * 1e3:.2f} ms at depth 1)", flush=True)
    base = rates.get("vanilla")
    for config, values in rates.items():
        ratios = "" if base is None else " ".join(f"{v / b:.2f}x" for v, b in zip(values, base, strict=True))
        print(f"{config}: {' '.join(f'{v:.1f}' for v in values)} tokens/s {ratios}")


if __name__ == "__main__":
    main()
