"""Speed of draft-tree settings side by side: every setting decodes every prompt, interleaved, in one process.

How the CPU defaults of eagle, eagle2, eagle3 and medusa were chosen (numbers in `specula/drafters/eagle.py`
and the heads' READMEs). Each setting is METHOD or METHOD=JSON options, e.g.

    .venv/bin/python scripts/tree_sweep.py --weights q4_1 --prompts data/smollm2_heldout_prompts.jsonl \\
        vanilla eagle 'eagle={"choices": [[0]]}' 'medusa={"choices": [[0], [1]]}' \\
        'eagle3={"total_tokens": 2, "depth": 2, "top_k": 1}'

Prompts are JSONL records with a "prompt" field; use prompts the heads never trained on. The first setting is
the baseline of the speedup column (put vanilla first). Greedy unless --temperature is given (each prompt then
decodes with the same seed in every setting), bundled heads unless a setting names a "draft" directory, no
hardware profile. Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import specula
from specula.certify.check import read_prompts
from specula.decoding import warm_up
from specula.errors import SpeculaError
from specula.runtime.compiled_step import WARM_UP_BLOCK
from specula.sampling import SamplingParams


def parse_setting(text: str) -> tuple[str, dict]:
    method, _, options = text.partition("=")
    if not options:
        return method, {}
    try:
        value = json.loads(options)
    except json.JSONDecodeError as err:
        raise SpeculaError(f"setting {text!r}: the options are not JSON ({err.msg})") from None
    if not isinstance(value, dict):
        raise SpeculaError(f"setting {text!r}: the options must be a JSON object")
    return method, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+", metavar="SETTING")
    parser.add_argument("--prompts", required=True, help="JSONL records with a 'prompt' field")
    parser.add_argument("--weights", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--target", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of prompt i is seed + i (with --temperature)")
    parser.add_argument("--compile", action="store_true",
                        help="a compiled target (and heads), compiled before any prompt is timed")
    args = parser.parse_args(argv)
    try:
        SamplingParams(temperature=args.temperature)  # refused before minutes of loading, not at the first prompt
        if args.max_new_tokens < 1:
            raise SpeculaError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        prompts = read_prompts(args.prompts)
        settings = [parse_setting(text) for text in args.settings]
        base = specula.load(args.target, method="vanilla", weights=args.weights, profile=False, compile=args.compile)
        speculators = [specula.load(base.target, method, profile=False, **options) for method, options in settings]
        if args.compile:  # no timed prompt pays for compiling a block size or a head's step, as in `specula bench`
            for speculator in speculators:
                warm_up(base.target, speculator.drafter, WARM_UP_BLOCK)
                # ... and what a decode meets past the warmed sizes (a merged tree's larger blocks)
                speculator.generate(prompts[0], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    seed=args.seed)
    except SpeculaError as err:
        print(f"tree_sweep: {err}", file=sys.stderr)
        return 2
    totals = [[0, 0.0, 0] for _ in settings]  # new tokens, seconds, cycles
    for number, prompt in enumerate(prompts):
        for speculator, total in zip(speculators, totals, strict=True):
            start = time.perf_counter()
            try:
                result = speculator.generate(prompt, max_new_tokens=args.max_new_tokens,
                                             temperature=args.temperature, seed=args.seed + number)
            except SpeculaError as err:
                print(f"tree_sweep: {err}", file=sys.stderr)
                return 2
            total[1] += time.perf_counter() - start
            total[0] += len(result.token_ids)
            total[2] += result.stats.cycles
    baseline = totals[0][0] / totals[0][1]
    for text, (tokens, seconds, cycles) in zip(args.settings, totals, strict=True):
        print(f"{args.weights} T={args.temperature:g} {text:50s} {tokens / seconds:6.1f} tokens/s  "
              f"{tokens / seconds / baseline:.2f}x  tau {tokens / max(cycles, 1):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
