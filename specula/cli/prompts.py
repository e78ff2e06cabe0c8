"""`specula prompts`: training prompts the target writes itself (Magpie), as JSONL `specula train` reads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specula.cli.common import DTYPE_CHOICES, TARGET_HELP, device_name, positive_int
from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_text, check_output_file
from specula.methods import DEFAULT_TARGET
from specula.runtime.target import Target
from specula.sampling import check_seed
from specula.training.synthesis import SynthesisOptions, synthesize_prompts


def add_prompts_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("prompts", help="sample training prompts from the target's own chat template",
                              description="Sample user messages from a chat model's own template (the Magpie "
                                          "technique), filter them for length, language and near-duplicates, and "
                                          "write them as JSONL {\"prompt\": ...} records for `specula train --data`.")
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, metavar="MODEL", help=TARGET_HELP)
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="the JSONL file to write")
    p.add_argument("--count", type=positive_int, default=SynthesisOptions.count, metavar="N",
                   help="prompts to keep (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=SynthesisOptions.temperature, metavar="T")
    p.add_argument("--max-new-tokens", type=positive_int, default=SynthesisOptions.max_new_tokens, metavar="N",
                   help="longest user message sampled (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=SynthesisOptions.batch_size, metavar="N")
    p.add_argument("--min-chars", type=positive_int, default=SynthesisOptions.min_chars, metavar="N")
    p.add_argument("--max-chars", type=positive_int, default=SynthesisOptions.max_chars, metavar="N")
    p.add_argument("--max-similarity", type=float, default=SynthesisOptions.max_similarity, metavar="J",
                   help="drop a prompt whose word 3-grams overlap a kept one's this much (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    p.add_argument("--device", type=device_name, default="cpu")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(handler=run_prompts)


def run_prompts(args: argparse.Namespace) -> int:
    check_seed(args.seed)
    options = SynthesisOptions(count=args.count, seed=args.seed, temperature=args.temperature,
                               max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                               min_chars=args.min_chars, max_chars=args.max_chars,
                               max_similarity=args.max_similarity)
    check_output_file(args.out, "--out", replace=args.force)  # before minutes of sampling, not after
    target = Target.load(args.target, dtype=args.dtype, device=args.device)
    report = synthesize_prompts(target, options, log=lambda message: print(message, file=sys.stderr))
    if not report.prompts:
        raise SpeculaError(f"no sampled message passed the filters ({report.dropped}); loosen them")
    atomic_write_text(args.out, "".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in report.prompts))
    print(f"{len(report.prompts)} prompts written to {args.out}", file=sys.stderr)
    return 0
