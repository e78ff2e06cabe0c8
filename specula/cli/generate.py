"""`specula generate`: one prompt, one method, text (streamed) or one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specula.cli.common import (
    PROG,
    add_draft_budget_argument,
    add_method_arguments,
    add_model_arguments,
    method_options,
    positive_int,
)
from specula.decoding import GenerationStats
from specula.errors import SpeculaError
from specula.methods import DEFAULT_TARGET, build_speculator
from specula.sampling import SamplingParams, check_seed


def add_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt with one decoding method",
                              description="Generate a continuation of a prompt, losslessly accelerated.")
    add_model_arguments(p, DEFAULT_TARGET)
    add_draft_budget_argument(p)
    p.add_argument("--system", metavar="TEXT", help="system message (models with a chat template)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt verbatim instead of as a user message through the chat template")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    prompt.add_argument("--prompt-file", type=Path, metavar="FILE",
                        help="read the prompt from FILE (UTF-8)")
    add_sampling_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    add_method_arguments(p)
    p.set_defaults(handler=run_generate)


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus mass in (0, 1] (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 disables top-k (default: %(default)s)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed for sampling")


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt
    try:
        text = args.prompt_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SpeculaError(f"cannot read prompt file {args.prompt_file}: {err}") from err
    if not text.strip():
        raise SpeculaError(f"prompt file {args.prompt_file} is empty")
    return text


def run_generate(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    # Sampling settings are checked before loading models, which can take far longer than a typo deserves;
    # the registry checks the method's options before loading too.
    SamplingParams(args.temperature, args.top_k, args.top_p)
    check_seed(args.seed)
    speculator = build_speculator(args.target, method=args.method, draft=args.draft, dtype=args.dtype,
                                  device=args.device, profile=not args.no_profile, weights=args.weights,
                                  compile=args.compile, draft_budget=args.draft_budget,
                                  **method_options(args))
    # Warn only once loading has accepted the options, so bad input stays a single error line.
    if not speculator.lossless and args.temperature > 0:
        print(f"{PROG}: warning: --acceptance typical is lossy: at temperature > 0 the output is not distributed "
              "as the target's", file=sys.stderr)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed)
    if args.json:
        result = speculator.generate(prompt, system=args.system, raw=args.raw, **sampling)
        report = {"method": args.method, "acceptance": args.acceptance,
                  "lossless": speculator.lossless or args.temperature == 0,  # typical is greedy matching at T=0
                  "text": result.text, "token_ids": result.token_ids, **result.stats.as_dict()}
        print(json.dumps(report))
        return 0
    stats = GenerationStats()
    for chunk in speculator.stream(prompt, stats=stats, system=args.system, raw=args.raw, **sampling):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    # The whole answer's rate, then the prompt's time and the rate after it, as llama.cpp splits them.
    print(f"[{args.method}] {stats.new_tokens} new tokens in {stats.cycles} cycles, tau {stats.tau:.2f}, "
          f"{stats.tokens_per_s:.1f} tokens/s ({stats.stop_reason}); prompt {stats.prompt_tokens} tokens in "
          f"{stats.prefill_time:.2f} s, then {stats.decode_tokens_per_s:.1f} tokens/s", file=sys.stderr)
    return 0
