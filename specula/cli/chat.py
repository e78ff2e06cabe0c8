"""`specula chat`: an interactive conversation (or one read from a pipe), streamed as tokens are accepted."""

from __future__ import annotations

import argparse
import sys

from specula.chat.session import run_chat
from specula.cli.common import (
    add_draft_budget_argument,
    add_method_arguments,
    add_model_arguments,
    method_options,
    positive_int,
)
from specula.methods import DEFAULT_TARGET, build_speculator
from specula.sampling import SamplingParams, check_seed


def add_chat(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat with a model interactively (reads a pipe too)",
                              description="Chat in the terminal: one message per line, answers streamed as "
                                          "they are accepted; /clear forgets the conversation, /exit or Ctrl-D ends.")
    add_model_arguments(p, DEFAULT_TARGET)
    add_draft_budget_argument(p)
    p.add_argument("--system", metavar="TEXT", help="system message")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, metavar="N",
                   help="longest answer (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus mass in (0, 1] (default: %(default)s)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed for sampling")
    add_method_arguments(p)
    p.set_defaults(handler=run_chat_command)


def run_chat_command(args: argparse.Namespace) -> int:
    SamplingParams(args.temperature, 0, args.top_p)  # a typo fails before the model loads
    check_seed(args.seed)
    speculator = build_speculator(args.target, method=args.method, draft=args.draft, dtype=args.dtype,
                                  device=args.device, profile=not args.no_profile, weights=args.weights,
                                  compile=args.compile, draft_budget=args.draft_budget,
                                  **method_options(args))
    _tolerate_undecodable(sys.stdin)
    return run_chat(speculator, sys.stdin, sys.stdout, system=args.system, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def _tolerate_undecodable(stream) -> None:
    """Read bytes that are not UTF-8 as lone surrogates: that line is then refused as one failed turn, where a strict
    decoder would raise mid-read and lose the lines buffered after it."""
    try:
        stream.reconfigure(errors="surrogateescape")
    except (AttributeError, ValueError, OSError):  # not a TextIOWrapper (a test's stream, pytest's stdin)
        pass
