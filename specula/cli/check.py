"""`specula check`: certify on this machine that a method's output is the target's output (logic: `certify.check`).

Exit status: 0 certified lossless, 1 NOT lossless, 3 inconclusive, 2 bad input (one `specula: error:` line).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specula.certify.check import ALPHA, check, read_prompts
from specula.certify.sampled import MAX_SAMPLES, TV
from specula.cli.common import add_method_arguments, add_model_arguments, method_options, positive_int
from specula.methods import DEFAULT_TARGET
from specula.sampling import SamplingParams, check_seed


def add_check_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check", help="certify that a method's output is the target's output on this machine",
        description="Certify that speculative output is the target's output: at T=0 token for token against "
                    "vanilla (every divergence explained as a floating-point near-tie or a real one), at T>0 a "
                    "distribution test of the method's loop against the target's exact probabilities, sampled until "
                    "it detects a distortion of --tv (total variation) with power 0.8, its power shown by a planted "
                    "error of that size that must be rejected. A lossy acceptance rule (typical) is NOT lossless "
                    "without a test. Exit 0 certified, 1 NOT lossless, 3 inconclusive, 2 bad input.")
    add_model_arguments(p, DEFAULT_TARGET, method_required=True)
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="JSONL of {\"prompt\": ...} records (default: a bundled set of 8 chat prompts)")
    p.add_argument("--n", type=positive_int, default=8, metavar="N",
                   help="prompts decoded greedily against vanilla (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N",
                   help="new tokens per greedy prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="temperature of the distribution test; 0 runs the greedy part only (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 disables top-k (default: %(default)s)")
    p.add_argument("--samples", type=positive_int, default=300, metavar="N",
                   help="least loop runs per sampled prompt, for the method and again for the control; more are "
                        "run where --tv needs them (default: %(default)s)")
    p.add_argument("--max-samples", type=positive_int, default=MAX_SAMPLES, metavar="N",
                   help="most loop runs per sampled prompt; a test that cannot reach --tv within them is "
                        "inconclusive (default: %(default)s)")
    p.add_argument("--tv", type=float, default=TV, metavar="D",
                   help="the distortion (total variation over the test's cells) the T>0 test must detect with "
                        "power 0.8 (default: %(default)s)")
    p.add_argument("--prefixes", type=positive_int, default=2, metavar="N",
                   help="prompts sampled at T>0 (default: %(default)s)")
    p.add_argument("--tokens", type=positive_int, default=4, metavar="N",
                   help="new tokens per sample, >= 2 (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=ALPHA, metavar="A",
                   help="significance level of the distribution test (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="first sampling seed (default: %(default)s)")
    add_method_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (schema in "
                                                      "specula/certify/report.py)")
    p.set_defaults(handler=run_check)


def run_check(args: argparse.Namespace) -> int:
    SamplingParams(args.temperature, args.top_k, args.top_p)  # bad settings fail before any model loads
    check_seed(args.seed)
    prompts = read_prompts(args.prompts) if args.prompts is not None else None
    report = check(args.target, args.method, args.draft, prompts=prompts, n=args.n,
                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, samples=args.samples, prefixes=args.prefixes, tokens=args.tokens,
                   seed=args.seed, alpha=args.alpha, tv=args.tv, max_samples=max(args.max_samples, args.samples),
                   dtype=args.dtype, device=args.device,
                   profile=not args.no_profile, weights=args.weights, compile=args.compile,
                   **method_options(args))
    print(json.dumps(report.as_dict()) if args.json else report.table())
    return report.exit_code
