"""SmolLM2 q4_1 steps on the loading thread and on a second thread, two OpenMP threads each, before and after the
loading thread lets its OpenMP team go (`specula.openmp.release_thread_team`): the session-41 measurement.

    .venv/bin/python docs/benchmarks/serve-smollm2-draft-cost/openmp_teams.py
"""
import statistics
import threading
import time

import torch

import specula
import specula.runtime.decode_threads as decode_threads
from specula.openmp import release_thread_team
from specula.runtime.target import FeatureRequest

speculator = specula.load(method="suffix", weights="q4_1")
prefix = [i % 1000 + 100 for i in range(300)]


def steps(label: str) -> None:
    decode_threads._shared = decode_threads.DecodeThreads((2, 2))  # two threads every step
    target = speculator.target.fork()
    target.prefill(torch.tensor(prefix))
    times = {}
    for r in range(40):
        for n in (1, 3, 8):
            start = time.perf_counter()
            target.forward(torch.tensor(prefix[:n]), None, features=FeatureRequest())
            if r >= 5:
                times.setdefault(n, []).append(time.perf_counter() - start)
            target.commit([])
    print(f"{label}: median ms of a step over 1 / 3 / 8 tokens:",
          " / ".join(f"{statistics.median(t) * 1000:.2f}" for t in times.values()), flush=True)


def on_a_second_thread(label: str) -> None:
    thread = threading.Thread(target=steps, args=(label,))
    thread.start()
    thread.join()


on_a_second_thread("second thread, loading thread's team kept")
steps("loading thread")
on_a_second_thread("second thread, loading thread's team kept")
print("released:", release_thread_team())
on_a_second_thread("second thread, loading thread's team released")
