"""Forward times of the target per weight format: one token and k tokens (k = 1, 2, 4, 8, 16) after a prefix.

Every variant is loaded into this one process and timed interleaved (repeat r runs every k of every
variant in a shuffled order), so a noisy neighbour slows all of them alike; the table shows medians.
Peak and final RSS are measured per variant in a fresh subprocess (load + the prefix), since a
process has only one peak. Variants without ``+head``/``@float32`` load as `Target.load` does (quantized
layer by layer while reading, `specula.runtime.streamed_load`); the others load the float model whole first. The
KV cache is allocated for what the prefix and the timed blocks need (it grows on demand).
The times are of `Target.forward` (all decoder layers and the LM head over k tokens after the
committed prefix), not of a whole decoding method.

Variants: a format of `specula.runtime.weights` (float32, bfloat16, int8, int4, q4_1), optionally with
``-requant`` (int4 from a GGUF requantized from its dequantized floats instead of carrying the
file's blocks), ``+head`` (the LM head in that format too) and ``@float32`` (int8/int4 kernels
computing in float32 instead of bfloat16: exact but ~10x slower on AVX2), in that order:
``int4-requant+head@float32``.

Run on a quiet machine (nothing else running, the same threads as decoding will use):

    OMP_NUM_THREADS=2 .venv/bin/python scripts/time_weights.py --threads 2 --repeats 30 \
        --json runs/time_weights.json
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from specula.runtime.loading import load_causal_lm, load_converted_lm  # noqa: E402
from specula.runtime.model_source import DEFAULT_MODEL, gguf_source, model_name  # noqa: E402
from specula.runtime.target import Target  # noqa: E402
from specula.runtime.weights import GROUPED_FORMATS, KERNEL_DTYPE, quantize_linear_weights  # noqa: E402

QUESTIONS = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
DEFAULT_VARIANTS = ("float32", "bfloat16", "int8", "int4", "q4_1", "int8+head", "int4+head")
DEFAULT_KS = (1, 2, 4, 8, 16)


def load_variant(target: str, variant: str, dtype: str = "auto") -> Target:
    """The target in ``variant`` (see the module docstring)."""
    fmt, float32 = variant.removesuffix("@float32"), variant.endswith("@float32")
    fmt, head = fmt.removesuffix("+head"), fmt.endswith("+head")
    fmt, requant = fmt.removesuffix("-requant"), fmt.endswith("-requant")
    source = None if requant or fmt not in GROUPED_FORMATS else gguf_source(target)
    if head or float32:  # options Target.load does not take: load whole, then convert
        model, tokenizer = load_causal_lm(target, dtype)
        report = quantize_linear_weights(model, fmt, lm_head=head, gguf_file=source,
                                         compute_dtype=torch.float32 if float32 else KERNEL_DTYPE)
    else:
        model, tokenizer, report = load_converted_lm(target, dtype, "cpu", "target", fmt, source)
    loaded = Target(model, tokenizer, name=model_name(target))
    loaded.weights, loaded.weights_report = fmt, report
    return loaded


def text_tokens(target: Target, count: int) -> torch.Tensor:
    """[count] tokens of MT-bench questions (plain text, no template), for a realistic prefix."""
    lines = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text(encoding="utf-8").splitlines()]
    ids = target.tokenizer("\n\n".join(lines), return_tensors="pt").input_ids[0]
    if len(ids) < count:
        raise SystemExit(f"only {len(ids)} tokens of text, {count} needed")
    return ids[:count]


def forward_seconds(target: Target, prefix: int, tokens: torch.Tensor) -> float:
    target.truncate(prefix)  # drops the last timed block; the prefix stays committed
    start = time.perf_counter()
    target.forward(tokens)
    return time.perf_counter() - start


def rss_of_this_process() -> tuple[int, int]:
    """Bytes: (peak, current) resident set of this process, from /proc (VmHWM, VmRSS). Not ru_maxrss, which a
    child inherits from its parent across fork and exec on Linux."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            fields[name] = int(value.split()[0]) * 1024
    if len(fields) < 2:  # not Linux: ru_maxrss (bytes on macOS, KiB elsewhere) as an upper bound for both
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return peak, peak
    return fields["VmHWM"], fields["VmRSS"]


def rss_mib(args: argparse.Namespace, variant: str) -> tuple[float, float]:
    """(peak, final) RSS in MiB of a fresh process that loads ``variant`` and runs the prefix."""
    command = [sys.executable, __file__, "--rss-of", variant, "--target", args.target, "--dtype", args.dtype,
               "--threads", str(args.threads), "--prefix", str(args.prefix)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    peak, final = done.stdout.strip().splitlines()[-1].split()
    return float(peak), float(final)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=DEFAULT_MODEL, help="model (default: %(default)s)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma separated (default: %(default)s)")
    p.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)), help="tokens per forward (default: %(default)s)")
    p.add_argument("--prefix", type=int, default=200, help="committed tokens before each timed forward")
    p.add_argument("--repeats", type=int, default=30, help="interleaved repeats per variant and k")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards per variant and k first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="activation dtype of the target (default: as stored)")
    p.add_argument("--no-rss", action="store_true", help="skip the per-variant peak RSS subprocesses")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--rss-of", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_of:  # child mode: load one variant, run the prefix, print peak RSS in MiB
        target = load_variant(args.target, args.rss_of, args.dtype)
        with torch.inference_mode():
            target.prefill(text_tokens(target, args.prefix))
        print(*(size / 2**20 for size in rss_of_this_process()))
        return
    variants = args.variants.split(",")
    ks = [int(k) for k in args.ks.split(",")]
    targets = {}
    for variant in variants:
        start = time.perf_counter()
        targets[variant] = load_variant(args.target, variant, args.dtype)
        print(f"loaded {variant} in {time.perf_counter() - start:.1f} s: {targets[variant].weights_report.summary()}",
              file=sys.stderr)
    tokens = text_tokens(targets[variants[0]], args.prefix + max(ks))
    prefix, block = tokens[:args.prefix], tokens[args.prefix:]
    times = {(v, k): [] for v in variants for k in ks}
    rng = random.Random(0)
    with torch.inference_mode():
        for target in targets.values():
            target.prefill(prefix)
        for v in variants:
            for k in ks:
                for _ in range(args.warmup):
                    forward_seconds(targets[v], args.prefix, block[:k])
        for _ in range(args.repeats):
            order = [(v, k) for v in variants for k in ks]
            rng.shuffle(order)
            for v, k in order:
                times[v, k].append(forward_seconds(targets[v], args.prefix, block[:k]))
    rss = {} if args.no_rss else {v: rss_mib(args, v) for v in variants}
    results = []
    print(f"\nmedian forward time after {args.prefix} tokens, {args.threads} threads, {args.repeats} interleaved "
          f"repeats (torch {torch.__version__})")
    header = f"{'variant':<16}{'1 token':>10}{'tok/s':>8}" + "".join(f"{f'{k} tok':>9}" for k in ks[1:])
    print(header + ("" if args.no_rss else f"{'peak RSS':>11}{'final RSS':>12}"))
    for v in variants:
        medians = {k: statistics.median(times[v, k]) for k in ks}
        one = medians[ks[0]]
        row = f"{v:<16}{one * 1e3:>8.2f}ms{1 / one:>8.1f}" + "".join(f"{medians[k] / one:>8.2f}x" for k in ks[1:])
        if not args.no_rss:
            row += f"{rss[v][0]:>7.0f} MiB{rss[v][1]:>8.0f} MiB"
        print(row)
        results.append({"variant": v, "median_seconds": {str(k): medians[k] for k in ks},
                        "peak_rss_mib": rss[v][0] if rss else None, "final_rss_mib": rss[v][1] if rss else None,
                        "weights": targets[v].weights_report.summary()})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"target": args.target, "threads": args.threads, "prefix": args.prefix,
                                         "repeats": args.repeats, "torch": torch.__version__,
                                         "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
