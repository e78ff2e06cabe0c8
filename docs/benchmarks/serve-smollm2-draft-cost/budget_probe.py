"""In-process: the server's engine at one client on 12 MT-bench first turns; what the draft budget plans and why."""
import asyncio, json, sys, time
import specula
from specula.serve.engine import BatchedEngine
from specula.serve.requests import GenerationRequest, Finished, TextDelta
from specula.draft_budget import DraftBudget, measured_curve

table = sys.argv[1] if len(sys.argv) > 1 else ""
sp = specula.load(method="suffix", weights="q4_1")
qs = [json.loads(l)["turns"][0] for l in open("../shared/data/mt_bench/question.jsonl")][:12]
budget = DraftBudget(table={1: 32}) if table == "wide" else None
eng = BatchedEngine(sp, budget=budget)

async def main():
    eng.start()
    w = eng.submit(GenerationRequest(tuple(sp.encode("Hi").tolist()), 4, temperature=0.0))
    while isinstance(await w.get(120), TextDelta):
        pass
    t0 = time.perf_counter(); toks = 0
    for q in qs:
        ids = sp.encode(messages=[{"role": "user", "content": q}])
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        s = eng.submit(GenerationRequest(tuple(ids), 128, temperature=0.0))
        while True:
            ev = await s.get(60)
            if isinstance(ev, TextDelta):
                toks += len(ev.token_ids)
            elif ev is None or not isinstance(ev, TextDelta):
                break
    dt = time.perf_counter() - t0
    print(f"{table or 'adaptive'}: {toks} tokens in {dt:.2f} s = {toks/dt:.1f} tok/s")
    b = eng.budget
    if b.table is None:
        print("curve ms:", {k: round(v * 1000, 2) for k, v in b.curve.items()})
        print("deepest", b.deepest, "draft ms at 1,4,8:", [round(b.draft_cost(d)*1000,3) for d in (1,4,8)])
        print("plan B=1:", b.caps(1))
        for kind in ["", *b.kinds]:
            a = b.kinds.get(kind, b.pooled)
            print(f"kind {kind!r}: cycles {a.drafted[0]:.0f}", "P(acc>=i)", [round(r, 2) for r in a.rates()[:8]],
                  "nodes", [round(a.draft_nodes(d), 1) for d in (1, 2, 3, 4, 6, 8)], "best", b.best_depth(1, kind))
    eng.stop()

asyncio.run(main())
