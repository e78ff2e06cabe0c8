"""Does one static shape make a GPU verify pass row-invariant? (issue 39)

On a GPU (`docs/checks/gpu-h200-stories260k`) a k-token verify pass rounds differently from k one-token steps in
every format: cuBLAS, SDPA and the compiler's kernels are chosen per shape (number of rows), and each choice
orders its reductions its own way. A row's reduction does not depend on the *other* rows of a call, only on the
kernel chosen for the call's shape. So if every target step, the one-token step included, runs at one block
shape, every row should get the same bits whatever the block. The compiled step already pads blocks to
`BLOCK_BUCKETS` and attends through `slot_attention`; this script sets the buckets to ``(64,)`` and measures:

1. plain ops: `F.linear` row by row against the whole block, unpadded and padded to 64 rows, and SDPA with a
   boolean mask over a longer key range (masked keys);
2. `mismatched_blocks` (chains of 1..64 tokens and a 9-node tree) per model and weight format, compiled with
   the default buckets (chains 1, 2, 4, 8 only) and with the single bucket;
3. the compiled one-token step's time with the default buckets and with the single one;
4. `specula check` at T=0 with the single bucket (the probe must find the target row-invariant, and every answer
   identical).

    python scripts/gpu_single_bucket.py --models DIR --out result.json   # DIR holds stories260k and llama2xs
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_check import cell_runner, random_llama, step_times

import specula.runtime.compiled_step as compiled_step
import specula.runtime.static_cache as static_cache
from specula.certify.check import check
from specula.runtime.invariance import mismatched_blocks
from specula.runtime.target import Target

ROOT = Path(__file__).resolve().parent.parent
CHAINS = [1, 2, 3, 4, 5, 8, 11, 16, 24, 33, 48, 64]
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 3]
DEFAULT_BUCKETS = compiled_step.BLOCK_BUCKETS
SINGLE = (64,)
SLICED = static_cache.slot_attention

# A variant of `static_cache.slot_attention` that attends over the whole allocation (masked past the block) rather
# than over the slots before the block's end: one key length for every step, whatever the committed length.
_PROBE = torch.library.Library("probe", "DEF")
_PROBE.define("whole_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, Tensor end, float scale) -> Tensor")


def _whole_attention(q, keys, values, mask, end, scale):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True).contiguous()


_PROBE.impl("whole_attention", _whole_attention, "CompositeExplicitAutograd")
torch.library.register_fake("probe::whole_attention", lambda q, keys, values, mask, end, scale:
                            q.new_empty(*q.shape[:3], values.shape[-1]), lib=_PROBE)
WHOLE = torch.ops.probe.whole_attention


def plain_ops(device: torch.device) -> dict:
    """Rows (of blocks of 1..64) whose `F.linear` / SDPA output differs from the same row computed alone."""
    g = torch.Generator(device="cpu").manual_seed(0)
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(1536, 576, generator=g).to(device, dtype)
        x = torch.randn(64, 576, generator=g).to(device, dtype)
        alone = torch.cat([F.linear(x[i:i + 1], w) for i in range(64)])
        pad = torch.zeros(64, 576, device=device, dtype=dtype)
        padded_alone = torch.cat([F.linear(torch.cat([x[i:i + 1], pad[1:]]), w)[:1] for i in range(64)])
        for k in (2, 4, 8, 16, 33, 64):
            block = F.linear(x[:k], w)
            found[f"linear {dtype} unpadded k={k}"] = int((block != alone[:k]).any(-1).sum())
            block = F.linear(torch.cat([x[:k], pad[k:]]), w)[:k]
            found[f"linear {dtype} padded64 k={k}"] = int((block != padded_alone[:k]).any(-1).sum())
        # attention: 64 query rows (padded), keys 0..L; row i sees keys < 40 + i; one call over 41 keys per row
        # (the row alone, as a one-token step sees its cache) against one over 104 keys
        q = torch.randn(1, 9, 64, 64, generator=g).to(device, dtype)
        keys = torch.randn(1, 9, 104, 64, generator=g).to(device, dtype)
        values = torch.randn(1, 9, 104, 64, generator=g).to(device, dtype)
        visible = torch.arange(104)[None, :] < (40 + torch.arange(64))[:, None]
        visible = visible.to(device)[None, None]
        whole = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        differ = 0
        for i in range(0, 64, 7):
            end = 40 + i
            row = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end],
                                                 attn_mask=visible[..., :end])[:, :, i]
            differ += int(not torch.equal(row, whole[:, :, i]))
        found[f"sdpa {dtype} padded64, 104 keys vs own end (10 rows)"] = differ
    return found


def loaded_invariance(device: torch.device, path: Path, fmt: str, prompt_length: int) -> dict:
    """`mismatched_blocks` of ``path`` loaded in ``fmt`` and compiled, after a prompt of ``prompt_length`` tokens."""
    target = Target.load(path, dtype="float32", device=device, weights=fmt)
    target.compile()
    return {"mismatched": mismatched_blocks(target, CHAINS, TREE_PARENTS, prompt_length=prompt_length)}


def third_run(args, cell, device: torch.device) -> None:
    """With the single bucket the default off a CPU: row invariance at realistic shapes after a long prefix, the
    step's cost there against the dense buckets, and the checks the second run left out."""
    big = random_llama(Path("/tmp/random-llama"), args.models / "stories260k")

    def invariance(path: Path, fmt: str, prompt_length: int) -> dict:
        return loaded_invariance(device, path, fmt, prompt_length)

    def times(fmt: str, buckets: tuple[int, ...]) -> dict:
        compiled_step.GPU_BLOCK_BUCKETS = buckets
        target = Target.load(big, dtype="float32", device=device, weights=fmt)
        target.compile()
        found = step_times(target, 3, 20)
        compiled_step.GPU_BLOCK_BUCKETS = SINGLE
        return found

    for fmt in ("bfloat16", "float32", "int8", "int4"):
        cell(f"random 1B-shaped Llama {fmt} compiled, 2,000-token prompt",
             lambda f=fmt: invariance(big, f, 2000))
    for fmt in ("bfloat16", "int8", "int4", "float32"):
        cell(f"stories260k {fmt} compiled, 400-token prompt", lambda f=fmt: invariance(args.models / "stories260k",
                                                                                     f, 400))
    for name, buckets in (("dense buckets", DEFAULT_BUCKETS), ("single bucket", SINGLE)):
        cell(f"random 1B-shaped Llama bfloat16 step time, {name}", lambda b=buckets: times("bfloat16", b))
    for method, draft in (("sps", "llama2xs"), ("suffix", None), ("eagle", ROOT / "tests/data/eagle-stories260k"),
                          ("ada", ROOT / "tests/data/eagle-stories260k")):
        cell(f"check T=0 {method} bfloat16 compiled", lambda m=method, d=draft: check_cell(args, m, d, "bfloat16"))


def fourth_run(args, cell, device: torch.device) -> None:
    """With slots past the capacity for a block's padding (`compiled_step.allocate_whole`): row invariance up to the
    context limit, and the single bucket's cost measured again, in alternating turns of 100 steps each."""
    big = random_llama(Path("/tmp/random-llama"), args.models / "stories260k")

    def invariance(path: Path, fmt: str, prompt_length: int) -> dict:
        return loaded_invariance(device, path, fmt, prompt_length)

    targets = {}

    def times(buckets: tuple[int, ...]) -> dict:
        compiled_step.GPU_BLOCK_BUCKETS = buckets
        if buckets not in targets:
            targets[buckets] = Target.load(big, dtype="float32", device=device, weights="bfloat16")
            targets[buckets].compile()
        found = step_times(targets[buckets], 5, 100)
        compiled_step.GPU_BLOCK_BUCKETS = SINGLE
        return found

    for fmt in ("bfloat16", "int8", "int4", "float32"):
        cell(f"stories260k {fmt} compiled, 400-token prompt", lambda f=fmt: invariance(args.models / "stories260k",
                                                                                     f, 400))
    cell("random 1B-shaped Llama bfloat16 compiled, 4,000-token prompt", lambda: invariance(big, "bfloat16", 4000))
    for turn in (1, 2):
        for name, buckets in (("dense buckets", DEFAULT_BUCKETS), ("single bucket of 64", SINGLE),
                              ("single bucket of 32", (32,))):
            cell(f"random 1B-shaped Llama bfloat16 step time, {name}, turn {turn}", lambda b=buckets: times(b))


def check_cell(args, method: str, draft, fmt: str) -> dict:
    draft = args.models / draft if isinstance(draft, str) else draft
    report = check(args.models / "stories260k", method, draft, n=4, max_new_tokens=48, temperature=0.0,
                   dtype="float32", device="cuda", weights=fmt, profile=False, compile=True).as_dict()
    g = report["greedy"]
    return {"verdict": report["verdict"], "identical": f"{g['identical']}/{g['prompts']}",
            "near_ties": g["near_ties"], "real": g["real"], "row_invariant": g["row_invariant"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=330.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--run", type=int, choices=(1, 2, 3, 4), default=4,
                        help="which run's cells: 1, 2 (probes, buckets patched), 3 (the single bucket as default), "
                             "4 (and slots past the capacity for a block's padding)")
    args = parser.parse_args()
    device = torch.device(args.device)
    started = time.perf_counter()
    results = {"environment": {"torch": torch.__version__, "cuda": torch.version.cuda,
                               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
               "cells": []}

    run_cell = cell_runner(results, args.out, started, args.budget)

    def cell(name: str, run) -> None:
        run_cell("", name, run)

    def compiled_target(model: str, fmt: str, buckets: tuple[int, ...], attention=SLICED) -> Target:
        compiled_step.GPU_BLOCK_BUCKETS = buckets  # runs 1 and 2 patched BLOCK_BUCKETS (then used on every device)
        static_cache.slot_attention = attention
        target = Target.load(args.models / model, dtype="float32", device=device, weights=fmt)
        target.compile()
        return target

    def invariance(model: str, fmt: str, buckets: tuple[int, ...], chains: list[int], attention=SLICED) -> dict:
        target = compiled_target(model, fmt, buckets, attention)
        return {"mismatched": mismatched_blocks(target, chains, TREE_PARENTS)}

    def step_time(model: str, fmt: str, buckets: tuple[int, ...], attention=SLICED) -> dict:
        target = compiled_target(model, fmt, buckets, attention)
        token = torch.tensor([5], device=device)
        target.prefill(torch.arange(3, 40, device=device))
        for _ in range(3):  # compile and warm
            target.forward(token)
            target.commit([])
        torch.cuda.synchronize() if device.type == "cuda" else None
        t0 = time.perf_counter()
        for _ in range(100):
            target.forward(token).logits.argmax()
            target.commit([])
        torch.cuda.synchronize() if device.type == "cuda" else None
        return {"ms_per_one_token_step": round((time.perf_counter() - t0) * 10, 3)}

    def run_check(method: str, draft, fmt: str, attention=WHOLE) -> dict:
        compiled_step.GPU_BLOCK_BUCKETS = SINGLE
        static_cache.slot_attention = attention
        return check_cell(args, method, draft, fmt)

    if args.run == 4:
        fourth_run(args, cell, device)
    elif args.run == 3:
        third_run(args, cell, device)
    elif args.run == 2:
        for fmt in ("int8", "int4"):
            cell(f"stories260k {fmt} single bucket, sliced attention",
                 lambda f=fmt: invariance("stories260k", f, SINGLE, CHAINS))
        for fmt in ("float32", "bfloat16", "int8"):
            cell(f"llama2xs {fmt} single bucket, sliced attention",
                 lambda f=fmt: invariance("llama2xs", f, SINGLE, CHAINS))
        for model in ("stories260k", "llama2xs"):
            for fmt in ("float32", "bfloat16"):
                for name, buckets in (("default buckets", DEFAULT_BUCKETS), ("single bucket", SINGLE)):
                    cell(f"{model} {fmt} step time, {name}",
                         lambda m=model, b=buckets, f=fmt: step_time(m, f, b))
        for method, draft in (("eagle3", ROOT / "tests/data/eagle3-stories260k"),
                              ("eagle2", ROOT / "tests/data/eagle-stories260k"),
                              ("medusa", ROOT / "specula/heads/bundled/medusa-stories260k"), ("pld", None)):
            for fmt in ("bfloat16", "float32"):
                cell(f"check T=0 {method} {fmt} compiled, single bucket",
                     lambda m=method, d=draft, f=fmt: run_check(m, d, f, SLICED))
    else:  # the first run
        cell("plain ops", lambda: plain_ops(device))
        for fmt in ("float32", "bfloat16"):
            cell(f"stories260k {fmt} single bucket, sliced attention",
                 lambda f=fmt: invariance("stories260k", f, SINGLE, CHAINS))
        for fmt in ("float32", "bfloat16", "int8", "int4"):
            cell(f"stories260k {fmt} single bucket, whole attention",
                 lambda f=fmt: invariance("stories260k", f, SINGLE, CHAINS, WHOLE))
        cell("stories260k float32 default buckets", lambda: invariance("stories260k", "float32", DEFAULT_BUCKETS,
                                                                       [1, 2, 4, 8]))
        for fmt in ("float32", "bfloat16"):
            cell(f"llama2xs {fmt} single bucket, whole attention",
                 lambda f=fmt: invariance("llama2xs", f, SINGLE, CHAINS, WHOLE))
        for model in ("stories260k", "llama2xs"):
            for name, buckets, attention in (("default buckets", DEFAULT_BUCKETS, SLICED),
                                             ("single bucket, whole attention", SINGLE, WHOLE)):
                cell(f"{model} float32 step time, {name}",
                     lambda m=model, b=buckets, a=attention: step_time(m, "float32", b, a))
        for method, draft in (("eagle3", ROOT / "tests/data/eagle3-stories260k"), ("pld", None),
                              ("sps", "llama2xs"), ("suffix", None)):
            for fmt in ("float32", "bfloat16"):
                cell(f"check T=0 {method} {fmt} compiled, single bucket, whole attention",
                     lambda m=method, d=draft, f=fmt: run_check(m, d, f))
    ran = [c for c in results["cells"] if c["status"] == "ran"]
    print(f"{len(ran)} of {len(results['cells'])} cells ran, {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
