"""The GPU path, checked: what "lossless" means on a CUDA device, format by format and method by method (issue 39).

On a CPU every format's verify pass is row-invariant (`tests/test_row_invariance.py`), so speculative output is
bit-identical to vanilla's. On a GPU the kernels are cuBLAS's and PyTorch's (none of ours), whose reductions may
depend on how many rows a call holds. This script measures that on the tiny stories260k target and runs
`specula check` for every method there, so the README can say per format what holds on a GPU:

1. row invariance: `specula.runtime.invariance.mismatched_rows` for chains of k = 1..64 tokens and a 9-node tree
   after a 37-token prompt, per weight format, eager;
2. the packed step of the server: each of 5 sequences of different lengths gets the logits of its block alone;
3. `specula check` at T=0 (token equality with vanilla, every divergence classified near-tie or real) for every
   method in every format, then the compiled step's row invariance per format in ``--compiled-formats``, then at
   T=1 (the distribution test with its power control) every method in float32, then T=0 again with the compiled
   step in each of ``--compiled-formats``.

Cells run in that order until ``--budget`` seconds have passed; the rest are written as not run (never as passed).
Results go to ``--out`` (JSON, rewritten after every cell) and one line per cell to stdout.

    python scripts/gpu_check.py --models DIR --out gpu_check.json    # DIR holds stories260k and llama2xs
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from pathlib import Path

import torch
from cpu_threads import save_random_llama

from specula.certify.check import check
from specula.runtime.forward import FeatureRequest
from specula.runtime.invariance import mismatched_blocks
from specula.runtime.packed import Block, forward_packed
from specula.runtime.target import Target

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ["float32", "bfloat16", "int8", "int4", "q4_1"]
CHAINS = [1, 2, 3, 4, 5, 8, 11, 16, 24, 33, 48, 64]
COMPILED_CHAINS = [1, 2, 4, 8, 16]  # each block size is one more compiled graph
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 3]  # the tree of tests/test_row_invariance.py
# method -> draft (None: the method needs none); heads are the test fixtures and the bundled stories head
DRAFTS = {
    "sps": "llama2xs",
    "pld": None,
    "suffix": None,
    "eagle": ROOT / "tests/data/eagle-stories260k",
    "eagle2": ROOT / "tests/data/eagle-stories260k",
    "eagle3": ROOT / "tests/data/eagle3-stories260k",
    "medusa": ROOT / "specula/heads/bundled/medusa-stories260k",
    "ada": ROOT / "tests/data/eagle-stories260k",
}

SAMPLED_ORDER = ["eagle3", "sps", "eagle2", "medusa", "ada", "pld", "suffix", "eagle"]  # T=1 cells, most telling first


def invariance(target: Target, chains: list[int] = CHAINS) -> dict[str, list[int]]:
    """{block: rows whose logits differ from one-token steps} for the chains and the tree ({} = row-invariant)."""
    return mismatched_blocks(target, chains, TREE_PARENTS)


def packed_equal(target: Target) -> list[int]:
    """Sequences (of 5, blocks of 1, 64, 4, 16, 5 tokens) whose packed logits differ from their block alone."""
    generator = torch.Generator().manual_seed(1)
    counts = [1, 64, 4, 16, 5]
    targets = [target.fork() for _ in counts]
    for i, t in enumerate(targets):
        t.prefill(torch.randint(3, target.vocab_size, (20 + 13 * i,), generator=generator).to(target.device))
    blocks = [Block(torch.randint(3, target.vocab_size, (n,), generator=generator).to(target.device), None, None,
                    FeatureRequest()) for n in counts]
    differ = []
    for i, (t, block, out) in enumerate(zip(targets, blocks, forward_packed(targets, blocks), strict=True)):
        t.commit([])
        if not torch.equal(block.run(t).logits, out.logits):
            differ.append(i)
    return differ


def random_llama(directory: Path, tokenizer_from: Path) -> Path:
    """A Llama of random weights with a 1B model's layer shapes (hidden 2,048, 16 query and 4 key-value heads of
    128, MLP 5,632; 4 layers, 4,096 positions) and ``tokenizer_from``'s tokenizer, saved once to ``directory``."""
    if not (directory / "config.json").exists():
        save_random_llama(directory, tokenizer_from, vocab_size=512, hidden_size=2048, intermediate_size=5632,
                          num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                          max_position_embeddings=4096)
    return directory


def step_times(target: Target, warm: int, timed: int) -> dict:
    """ms per 1-, 4- and 8-token step of ``target`` after a 2,000-token prompt: ``warm`` steps, then ``timed``."""
    device = target.device
    target.reset()
    target.prefill(torch.arange(3, 2003, device=device) % 500 + 3)
    found = {}
    for n in (1, 4, 8):
        block = torch.arange(5, 5 + n, device=device)
        for repeat in range(warm + timed):
            if repeat == warm:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            target.forward(block).logits.argmax()
            target.commit([])
        torch.cuda.synchronize()
        found[f"ms per {n}-token step"] = round((time.perf_counter() - t0) / timed * 1000, 3)
    return found


def eager_step_times(path: Path, device: torch.device, padded: bool, timed: int = 100) -> dict:
    """`step_times` of ``path`` in bfloat16, eager, with blocks padded to the compiled step's one shape (the default
    off a CPU: `compiled_step.pads_eager_blocks`) or not."""
    target = Target.load(path, dtype="float32", device=device, weights="bfloat16")
    if not padded:
        target.runtime.padded = None
    return step_times(target, 5, timed)


def cell_runner(results: dict, out: Path, started: float, budget: float, only: list[str] | None = None,
                skip: list[str] | None = None):
    """``cell(kind, name, run)``: runs ``run()`` (a dict of findings) unless ``budget`` seconds have passed since
    ``started`` (then it is recorded as not run), ``only`` leaves it out or ``skip`` names it; an exception is
    recorded as a finding.
    Each record goes into ``results["cells"]``, the whole of ``results`` to ``out`` (JSON) and a line to stdout."""

    def cell(kind: str, name: str, run) -> None:
        label = f"{kind} {name}".strip()
        record = {"kind": kind, "name": name} if kind else {"name": name}
        if (only and not any(text in label for text in only)) or (skip and any(text in label for text in skip)):
            return
        if time.perf_counter() - started > budget:
            record["status"] = "not run (time budget)"
        else:
            t0 = time.perf_counter()
            try:
                record.update(run())
                record.setdefault("status", "ran")
            except Exception as err:  # a cell that breaks is a finding: record it and go on
                record.update(status="error", error=f"{type(err).__name__}: {err}",
                              traceback=traceback.format_exc())
            record["seconds"] = round(time.perf_counter() - t0, 2)
        results["cells"].append(record)
        out.write_text(json.dumps(results, indent=1))
        shown = {k: v for k, v in record.items() if k not in ("kind", "name", "traceback", "report")}
        print(f"[{time.perf_counter() - started:6.1f}s] {label}: {json.dumps(shown)}", flush=True)
        if "traceback" in record:
            print(record["traceback"], flush=True)

    return cell


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, required=True, help="folder holding stories260k and llama2xs")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; later cells are recorded as not run")
    parser.add_argument("--n", type=int, default=4, help="greedy prompts per check")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--compiled-formats", type=lambda text: text.split(","), default=["float32"],
                        metavar="F,...", help="formats of the compiled cells, in order (default: float32)")
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="run only the cells whose '<kind> <name>' contains one of these (a second run's share)")
    parser.add_argument("--skip", nargs="+", metavar="TEXT",
                        help="leave out the cells whose '<kind> <name>' contains one of these")
    args = parser.parse_args()
    stories = args.models / "stories260k"
    device = torch.device(args.device)
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    results = {"environment": {"torch": torch.__version__, "cuda": torch.version.cuda, "device": name,
                               "python": platform.python_version()},
               "cells": []}

    cell = cell_runner(results, args.out, started, args.budget, args.only, args.skip)

    for fmt in FORMATS:
        cell("invariance", f"{fmt} eager", lambda fmt=fmt: {
            "mismatched": invariance(Target.load(stories, dtype="float32", device=device, weights=fmt))})
    for fmt in ("float32", "bfloat16", "int8", "q4_1"):
        cell("packed", f"{fmt} eager", lambda fmt=fmt: {
            "differing_sequences": packed_equal(Target.load(stories, dtype="float32", device=device, weights=fmt))})
    big = Path("/tmp/random-llama")
    for fmt in ("bfloat16", "float32"):
        cell("invariance", f"{fmt} eager, random 1B-shaped Llama after 2,000 tokens", lambda fmt=fmt: {
            "mismatched": mismatched_blocks(Target.load(random_llama(big, stories), dtype="float32", device=device,
                                                        weights=fmt), CHAINS, TREE_PARENTS, prompt_length=2000)})
    for turn in (1, 2):
        for padded in (True, False):
            cell("cost", f"bfloat16 eager steps, blocks {'padded to 64' if padded else 'unpadded'}, turn {turn}",
                 lambda padded=padded: eager_step_times(random_llama(big, stories), device, padded))

    def run_check(method: str, fmt: str, temperature: float, compile: bool = False) -> dict:
        draft = DRAFTS[method]
        draft = args.models / draft if isinstance(draft, str) else draft
        report = check(stories, method, draft, n=args.n, max_new_tokens=args.max_new_tokens,
                       temperature=temperature, dtype="float32", device=str(device), weights=fmt, profile=False,
                       compile=compile).as_dict()
        g = report["greedy"]
        summary = {"verdict": report["verdict"], "identical": f"{g['identical']}/{g['prompts']}",
                   "near_ties": g["near_ties"], "real": g["real"], "row_invariant": g["row_invariant"],
                   "report": report}
        if report["sampling"]:
            s = report["sampling"]
            summary.update(p_value=s["method"]["p_value"], control_p=s["control"]["p_value"],
                           detectable_tv=s["power"]["detectable_tv"])
        return summary

    for fmt in FORMATS:
        for method in DRAFTS:
            cell("check T=0", f"{method} {fmt}", lambda m=method, f=fmt: run_check(m, f, 0.0))

    def compiled_invariance(fmt: str) -> dict:
        target = Target.load(stories, dtype="float32", device=device, weights=fmt)
        target.compile()
        # a CPU compiles one graph per block size; elsewhere every block runs at one size (GPU_BLOCK_BUCKETS)
        return {"mismatched": invariance(target, COMPILED_CHAINS if device.type == "cpu" else CHAINS)}

    for fmt in args.compiled_formats:
        cell("invariance", f"{fmt} compiled", lambda fmt=fmt: compiled_invariance(fmt))
    for method in SAMPLED_ORDER:
        cell("check T=1", f"{method} float32", lambda m=method: run_check(m, "float32", 1.0))
    for fmt in args.compiled_formats:
        for method in DRAFTS:
            cell("check T=0", f"{method} {fmt} compiled",
                 lambda m=method, f=fmt: run_check(m, f, 0.0, compile=True))
    ran = [c for c in results["cells"] if c["status"] == "ran"]
    print(f"{len(ran)} of {len(results['cells'])} cells ran, {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
