import sys, time
sys.path.insert(0, "scripts")
import torch
from torch.profiler import profile, ProfilerActivity
from pathlib import Path
from gpu_check import random_llama
from specula.runtime.target import Target
dev = torch.device("cuda")
big = random_llama(Path("/tmp/random-llama"), Path(".device/models/stories260k"))
for fmt in ("bfloat16",):
    for padded in (True, False, True, False):
        t = Target.load(big, dtype="float32", device=dev, weights=fmt)
        if not padded:
            t.runtime.padded = None
        t.prefill(torch.arange(2000, device=dev) % 500 + 3)
        b = torch.tensor([5], device=dev)
        for _ in range(10):
            t.forward(b).logits.argmax(); t.commit([])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            t.forward(b).logits.argmax(); t.commit([])
        torch.cuda.synchronize()
        print(fmt, "padded" if padded else "unpadded", "%.3f ms" % ((time.perf_counter() - t0) * 10), flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(20):
                t.forward(b).logits.argmax(); t.commit([])
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=40))
