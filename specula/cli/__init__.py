"""The `specula` command line: all argument parsing lives in this package.

Each subcommand is one `add_<name>` function that registers its parser and sets
``handler``. Bad input surfaces as one ``specula: error: ...`` line on stderr
and exit status 2, never as a traceback; an interrupt exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from transformers import logging as hf_logging

from specula.cli.bench import add_bench_parser, add_calibrate_parser, add_speedcheck_parser
from specula.cli.chat import add_chat
from specula.cli.check import add_check_parser
from specula.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    PROG,
    ArgumentParser,
    report_error,
    report_os_error,
)
from specula.cli.convert import add_convert_parser
from specula.cli.generate import add_generate
from specula.cli.prompts import add_prompts_parser
from specula.cli.serve import add_serve_parser
from specula.cli.train import add_train
from specula.errors import SpeculaError

# Each entry registers one subcommand on the shared subparsers.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_generate, add_chat, add_check_parser, add_train, add_bench_parser, add_calibrate_parser,
    add_convert_parser, add_speedcheck_parser, add_serve_parser, add_prompts_parser,
]


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
    except BrokenPipeError:
        # The reader went away (`specula generate ... | head`): stop quietly, as other command-line tools do.
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as err:  # a path that cannot be used, or a failed write of our own output (a full disk)
        return report_os_error(err)
    except SystemExit as done:  # --help: argparse has printed and wants to exit
        return done.code if isinstance(done.code, int) else 0


def _discard_stdout() -> None:
    """Point stdout at /dev/null so Python's exit-time flush does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


__all__ = ["build_parser", "main"]
