"""`specula check` for every method on the bundled SmolLM2 in one weight format: the README's per-method table.

Each method's report goes to ``OUT/<format>-<method>.txt`` (the text `specula check` prints) and ``.json`` (its
JSON form); a method whose JSON exists is not run again, so a stopped run resumes. Default check settings, the
bundled heads, no hardware profile, the threads `specula check` takes here. sps has no smaller model with
SmolLM2's tokenizer here, so its draft is SmolLM2 itself in a cheaper format (int4 for a q4_1 target, q4_1 for a
float32 or bfloat16 one). At the end the markdown rows of the table are printed.

    .venv/bin/python scripts/check_table.py --weights q4_1 --out docs/checks/smollm2-identical
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specula.certify.check import check
from specula.files.outputs import atomic_write_bytes
from specula.methods import DEFAULT_TARGET
from specula.openmp import default_threads

METHODS = ["vanilla", "pld", "suffix", "sps", "eagle", "eagle2", "eagle3", "medusa", "ada", "ada-tree"]
SPS_DRAFT_WEIGHTS = {"q4_1": "int4", "float32": "q4_1", "bfloat16": "q4_1"}


def options(label: str, weights: str) -> tuple[str, dict]:
    """(method, check options) of a table row."""
    if label == "ada-tree":
        return "ada", {"tree": True}
    if label == "sps":
        return "sps", {"draft": DEFAULT_TARGET, "draft_weights": SPS_DRAFT_WEIGHTS[weights]}
    return label, {}


def _p(p: float) -> str:
    return "< 1e-300" if p == 0 else f"{p:.2g}"  # a float underflows to 0 below ~1e-308


def row(label: str, weights: str, report: dict) -> str:
    g, s = report["greedy"], report["sampling"]
    sampled = (f"{s['accepted']}/{s['drafted']} | {s['method']['p_value']:.3g} | {_p(s['control']['p_value'])}"
               if s else "– | – | –")
    return (f"| {label} | {weights} | {g['identical']} / {g['near_ties']} / {g['real']} | "
            f"{g['accepted']}/{g['drafted']} | {sampled} | {report['status']} | {report['seconds']:.0f} s |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, choices=sorted(SPS_DRAFT_WEIGHTS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--greedy-only", action="store_true", help="T=0 alone (the sampled test left out)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if default_threads():  # as `specula check` runs on this machine
        torch.set_num_threads(default_threads())
    rows = []
    for label in args.methods:
        path = args.out / f"{args.weights}-{label}"
        if not path.with_suffix(".json").exists():
            method, extra = options(label, args.weights)
            started = time.perf_counter()
            if args.greedy_only:
                extra["temperature"] = 0.0
            report = check(None, method, weights=args.weights, profile=False, **extra)
            text = report.table() + f"\n(check ran in {time.perf_counter() - started:.1f} s)\n"
            atomic_write_bytes(path.with_suffix(".txt"), text.encode())
            atomic_write_bytes(path.with_suffix(".json"), json.dumps(report.as_dict(), indent=1).encode())
            print(f"{label}: {report.verdict}", flush=True)
        rows.append(row(label, args.weights, json.loads(path.with_suffix(".json").read_text())))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
