"""specula.load on the main thread, then generations on a long-lived worker thread (a web app's pool) and on main
(session 41: before and after `Speculator.stream` and `specula.load` release their thread's OpenMP team).

    .venv/bin/python docs/benchmarks/serve-smollm2-draft-cost/api_threads.py [METHOD]
"""
import time, threading, queue, sys, specula
sp = specula.load(method=sys.argv[1] if len(sys.argv) > 1 else "vanilla", weights="q4_1")
prompts = ["Tell me about the sea.", "Why is the sky blue?", "Write a haiku about autumn.", "What is a prime number?"]
def gen(label):
    t = time.perf_counter(); n = 0
    for p in prompts:
        g = sp.generate(p, max_new_tokens=96)
        n += len(g.token_ids)
    print(f"{label}: {n / (time.perf_counter() - t):.1f} tokens/s", flush=True)
jobs = queue.Queue()
def worker():
    while (label := jobs.get()) is not None:
        gen(label); jobs.task_done()
th = threading.Thread(target=worker, daemon=True); th.start()
gen("main")
for i in range(2):
    jobs.put(f"worker thread {i}"); jobs.join()
gen("main again")
jobs.put("worker thread after main"); jobs.join()
