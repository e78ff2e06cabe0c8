import sys, time, json
sys.path.insert(0, "scripts")
import torch
import torch.nn.functional as F
from pathlib import Path
from gpu_check import random_llama, CHAINS, TREE_PARENTS
import specula.runtime.static_cache as sc
from specula.runtime.invariance import mismatched_blocks
from specula.runtime.target import Target
dev = torch.device("cuda")
stories = Path(".device/models/stories260k")
big = random_llama(Path("/tmp/random-llama"), stories)
op = sc.slot_attention

def repeated(q, keys, values, mask, end, scale):
    end = int(end)
    rep = q.shape[1] // keys.shape[1]
    k = keys[:, :, :end].repeat_interleave(rep, 1)
    v = values[:, :, :end].repeat_interleave(rep, 1)
    bias = torch.zeros(mask.shape[:3] + (end,), dtype=q.dtype, device=q.device)
    bias.masked_fill_(~mask[..., :end], float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale).contiguous()

def step_ms(path, padded):
    t = Target.load(path, dtype="float32", device=dev, weights="bfloat16")
    if not padded:
        t.runtime.padded = None
    t.prefill(torch.arange(2000, device=dev) % 500 + 3)
    found = {}
    for n in (1, 8):
        b = torch.arange(5, 5 + n, device=dev)
        for i in range(60):
            if i == 10:
                torch.cuda.synchronize(); t0 = time.perf_counter()
            t.forward(b).logits.argmax(); t.commit([])
        torch.cuda.synchronize()
        found[n] = round((time.perf_counter() - t0) / 50 * 1000, 3)
    return found

for name, fn in (("current", op), ("repeated+bias", repeated)):
    sc.slot_attention = fn
    for fmt in ("bfloat16", "float32", "int8", "int4"):
        t0 = time.perf_counter()
        try:
            r = mismatched_blocks(Target.load(stories, dtype="float32", device=dev, weights=fmt), CHAINS, TREE_PARENTS)
        except Exception as e:
            r = repr(e)
        print(name, "stories", fmt, json.dumps(r)[:300], "%.1fs" % (time.perf_counter() - t0), flush=True)
    for fmt in ("bfloat16", "float32"):
        r = mismatched_blocks(Target.load(big, dtype="float32", device=dev, weights=fmt), CHAINS, TREE_PARENTS, prompt_length=2000)
        print(name, "1B-shaped", fmt, json.dumps(r)[:300], flush=True)
    for turn in (1, 2):
        print(name, "turn", turn, "padded", step_ms(big, True), "unpadded", step_ms(big, False), flush=True)
