"""The `specula` command line: a thin layer that parses arguments, calls `specula.api` and prints.

Each subcommand is one `add_<name>` function that registers its parser and sets
``handler``; later subcommands (train, bench, calibrate, serve, convert) plug in
the same way. Bad input surfaces as one ``specula: error: ...`` line on stderr
and exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from specula.errors import SpeculaError

PROG = "specula"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell convention for a process stopped by SIGINT
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but usage errors become the same single line as every other bad input (not usage + exit)."""

    def error(self, message: str) -> NoReturn:
        raise SpeculaError(f"{message} (see '{self.prog} --help')")


def report_error(message: str) -> int:
    """Print one ``specula: error:`` line; returns the exit status for bad input."""
    # Messages from deep inside a library can span lines; the contract is one line.
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_USAGE


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got '{text}'") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def device_name(text: str) -> str:
    import torch

    # Allocating on it catches both a misspelt device and one this torch build or machine lacks
    # (e.g. cuda on a CPU-only build fails with an AssertionError deep inside model.to()).
    try:
        torch.empty(0, device=text)
    except (RuntimeError, AssertionError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise argparse.ArgumentTypeError(f"device '{text}' is not usable: {reason}") from err
    return text


# ---------------------------------------------------------------- generate


def add_generate(subparsers: argparse._SubParsersAction) -> None:
    from specula.api import DEFAULT_TARGET
    from specula.drafters import METHODS

    p = subparsers.add_parser("generate", help="generate text from a prompt with one decoding method",
                              description="Generate a continuation of a prompt, losslessly accelerated.")
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, metavar="DIR",
                   help="local Hugging Face causal LM directory (default: the bundled %(default)s)")
    p.add_argument("--method", choices=METHODS, default="vanilla", help="decoding method (default: %(default)s)")
    p.add_argument("--draft", type=Path, metavar="DIR", help="draft model directory (needed by sps)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    prompt.add_argument("--prompt-file", type=Path, metavar="FILE",
                        help="read the prompt from FILE (UTF-8, used verbatim)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus mass in (0, 1] (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 disables top-k (default: %(default)s)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed for sampling")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="(default: %(default)s, as stored)")
    p.add_argument("--device", type=device_name, default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--num-draft-tokens", type=positive_int, metavar="N",
                   help="draft tokens per cycle for sps and pld (default: the method's own)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    p.set_defaults(handler=run_generate)


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
    import specula
    from specula.decoding import GenerationStats

    prompt = read_prompt(args)
    # Check the sampling settings before loading models, which can take far longer than a typo deserves.
    specula.SamplingParams(args.temperature, args.top_k, args.top_p)
    options = {} if args.num_draft_tokens is None else {"num_tokens": args.num_draft_tokens}
    speculator = specula.load(args.target, method=args.method, draft=args.draft, dtype=args.dtype,
                              device=args.device, **options)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed)
    if args.json:
        result = speculator.generate(prompt, **sampling)
        report = {"method": args.method, "text": result.text, "token_ids": result.token_ids,
                  **result.stats.as_dict()}
        print(json.dumps(report))
        return 0
    stats = GenerationStats()
    for chunk in speculator.stream(prompt, stats=stats, **sampling):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"[{args.method}] {stats.new_tokens} new tokens in {stats.cycles} cycles, tau {stats.tau:.2f}, "
          f"{stats.tokens_per_s:.1f} tokens/s ({stats.stop_reason})", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- entry point

# Each entry registers one subcommand on the shared subparsers (train, bench, calibrate, serve, convert go here).
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_generate]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description="Lossless speculative decoding for Hugging Face causal LMs.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Silence `transformers` warnings: they are not actionable here and would break the one-line error contract
    (e.g. the tokenizer's "sequence length is longer than..." before specula's own context-limit error).
    The previous level comes back afterwards, for callers of main() inside a larger program."""
    from transformers import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    try:
        args = build_parser().parse_args(argv)
        with quiet_libraries():
            return args.handler(args)
    except SpeculaError as err:
        return report_error(str(err))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except SystemExit as done:  # --help: argparse has printed and wants to exit
        return done.code if isinstance(done.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
