"""The `specula` command line: all argument parsing lives in this package.

Each subcommand is one `add_<name>` function that registers its parser and sets
``handler``. Bad input surfaces as one ``specula: error: ...`` line on stderr
and exit status 2, never as a traceback; an interrupt exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator

from specula.cli.common import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    PROG,
    ArgumentParser,
    command_threads,
    report_error,
    report_os_error,
)
from specula.errors import SpeculaError

VERBOSITY = "TRANSFORMERS_VERBOSITY"

# Each subcommand's module is imported only when that subcommand runs (or for the full --help): `specula train` pulls
# in the trainers, `bench` the benchmark, `check` the certifier, none of which `specula generate` needs before its
# first token.
Register = Callable[[argparse._SubParsersAction], None]


def _generate(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.generate import add_generate
    add_generate(subparsers)


def _chat(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.chat import add_chat
    add_chat(subparsers)


def _check(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.check import add_check_parser
    add_check_parser(subparsers)


def _train(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.train import add_train
    add_train(subparsers)


def _bench(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.bench import add_bench_parser
    add_bench_parser(subparsers)


def _calibrate(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.bench import add_calibrate_parser
    add_calibrate_parser(subparsers)


def _convert(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.convert import add_convert_parser
    add_convert_parser(subparsers)


def _speedcheck(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.bench import add_speedcheck_parser
    add_speedcheck_parser(subparsers)


def _serve(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.serve import add_serve_parser
    add_serve_parser(subparsers)


def _prompts(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli.prompts import add_prompts_parser
    add_prompts_parser(subparsers)


# Each entry registers one subcommand on the shared subparsers, in the order --help lists them.
SUBCOMMANDS: dict[str, Register] = {
    "generate": _generate, "chat": _chat, "check": _check, "train": _train, "bench": _bench, "calibrate": _calibrate,
    "convert": _convert, "speedcheck": _speedcheck, "serve": _serve, "prompts": _prompts,
}


def build_parser(command: str | None = None) -> ArgumentParser:
    """The parser of every subcommand, or only of ``command`` where it names one (the others are not imported)."""
    parser = ArgumentParser(prog=PROG, description="Lossless speculative decoding for Hugging Face causal LMs.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in [SUBCOMMANDS[command]] if command in SUBCOMMANDS else SUBCOMMANDS.values():
        add(subparsers)
    return parser


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Silence `transformers` warnings: they are not actionable here and would break the one-line error contract
    (e.g. the tokenizer's "sequence length is longer than..." before specula's own context-limit error).
    The previous level comes back afterwards, for callers of main() inside a larger program.

    Without importing `transformers` (a warm start never does): its logger is the standard ``transformers`` logger,
    and ``TRANSFORMERS_VERBOSITY`` is the level it takes if a command imports it on the way."""
    logger = logging.getLogger("transformers")
    level, variable = logger.level, os.environ.get(VERBOSITY)
    logger.setLevel(logging.ERROR)
    os.environ[VERBOSITY] = "error"
    try:
        yield
    finally:
        logger.setLevel(level)
        if variable is None:
            os.environ.pop(VERBOSITY, None)
        else:
            os.environ[VERBOSITY] = variable


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad input, 130 interrupted)."""
    try:
        given = sys.argv[1:] if argv is None else argv
        args = build_parser(_subcommand(given)).parse_args(argv)
        with quiet_libraries(), command_threads(args):
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


def _subcommand(given: list[str]) -> str | None:
    # The top-level parser takes no option but --help, so the first other word names the subcommand.
    return next((word for word in given if not word.startswith("-")), None)


# Commands whose work is over when `main` returns: nothing they start runs on, and nothing of theirs waits for the
# interpreter's exit (no temporary directory, no worker, no server).
PROMPT_EXIT_COMMANDS = {"generate"}


def run() -> None:
    """The `specula` program: `main`, then for a one-shot command an exit without the interpreter's teardown.

    After `specula generate` prints its answer, Python's teardown spent ~0.5 s freeing the model's modules and
    tensors one by one (warm `generate --prompt Hi --max-new-tokens 8` on a 2-core AMD EPYC: last line to exit
    0.5-0.6 s; with this exit 0.05 s). So once stdout, stderr and logging are flushed, such a command ends with
    `os._exit`. Where exit-time work may matter it exits as usual: other commands, and any process that compiled
    (Inductor's compile workers are shut down at exit) or runs another thread.
    """
    code = main()
    if (_subcommand(sys.argv[1:]) in PROMPT_EXIT_COMMANDS and "torch._inductor" not in sys.modules
            and threading.active_count() == 1):
        logging.shutdown()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed pipe: the usual exit reports it as Python does
            sys.exit(code)
        os._exit(code)
    sys.exit(code)


def _discard_stdout() -> None:
    """Point stdout at /dev/null so Python's exit-time flush does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


__all__ = ["build_parser", "main", "run"]
