"""A/B of the draft budget's two session-48 changes in the engine, batch kept full (T=0, MT-bench first turns).

Run from the repository root: .venv/bin/python docs/benchmarks/serve-smollm2-draft-cost/session48_ab.py BATCH REQUESTS ROUNDS
"""
import asyncio, json, sys, time
import torch
import specula
from specula.draft_budget import DraftBudget, measured_curve
from specula.runtime.verify_cost import verify_cost
from specula.serve.engine import BatchedEngine
from specula.serve.requests import Failed, Finished, GenerationRequest

class Variant(DraftBudget):
    optimistic, chains = True, True
    def best_cap(self, batch, kind=""):
        stats = self.kinds.get(kind, self.pooled)
        def rate(a, d):
            verify = verify_cost(self.curve, round(batch * (1 + a.draft_nodes(d))))
            return batch * a.tau(d, optimistic=self.optimistic) / (verify + batch * self.draft_cost(d))
        shapes = stats.shapes() if self.chains else [(stats.tree, False)]
        options = [(rate(a, d), -d, not c, d, c) for a, c in shapes for d in range(self.deepest + 1)]
        *_, depth, chain = max(options)
        return (None if depth == self.deepest else depth), chain

def variant(optimistic, chains):
    return type("V", (Variant,), {"optimistic": optimistic, "chains": chains})

async def serve(engine, prompts, max_tokens):
    start = time.perf_counter()
    streams = [engine.submit(GenerationRequest(tuple(p), max_tokens, temperature=0.0)) for p in prompts]
    tokens = 0
    for s in streams:
        async for e in s:
            if isinstance(e, Finished): tokens += e.completion_tokens
            elif isinstance(e, Failed): raise SystemExit(e.message)
    return tokens, time.perf_counter() - start

batch = int(sys.argv[1]); requests = int(sys.argv[2]); rounds = int(sys.argv[3])
torch.set_num_threads(1)
van = specula.load(method="vanilla", weights="q4_1", threads=1)
suf = specula.load(van.target, method="suffix")
qs = [json.loads(l) for l in open("../shared/data/mt_bench/question.jsonl")][:requests]
prompts = [van.encode(q["turns"][0]).tolist() for q in qs]
curve = measured_curve(van.target, batch)
print({k: round(v * 1e3, 1) for k, v in curve.items()}, flush=True)
configs = {"vanilla": None, "new": variant(True, True), "no-ucb": variant(False, True), "no-chain": variant(True, False), "old": variant(False, False)}
rates = {}
for r in range(rounds):
    for name, cls in configs.items():
        sp = van if cls is None else suf
        budget = None if cls is None else cls(curve, max_batch=batch)
        engine = BatchedEngine(sp, max_queue=len(prompts), max_batch=batch, budget=budget)
        engine.start()
        tokens, seconds = asyncio.run(serve(engine, prompts, 128))
        engine.stop()
        rates.setdefault(name, []).append(tokens / seconds)
        extra = ""
        if budget is not None:
            budget._plans.clear(); caps = budget.caps(batch)
            extra = f" caps {caps.deepest} {caps.by_kind} chain {sorted(caps.chain_kinds)}"
        print(f"round {r+1} {name}: {tokens / seconds:.1f} tok/s{extra}", flush=True)
for name, v in rates.items():
    print(name, " ".join(f"{x:.1f}" for x in v), " ".join(f"{x / b:.2f}x" for x, b in zip(v, rates["vanilla"])))
