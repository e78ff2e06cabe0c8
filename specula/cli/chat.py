"""`specula chat`: an interactive conversation (or one read from a pipe), streamed as tokens are accepted."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specula.chat_session import run_chat
from specula.cli.common import (
    DTYPE_CHOICES,
    TARGET_HELP,
    add_method_arguments,
    add_weights_argument,
    device_name,
    method_options,
    positive_int,
)
from specula.methods import DEFAULT_TARGET, METHODS, build_speculator
from specula.sampling import SamplingParams, check_seed


def add_chat(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="chat with a model interactively (reads a pipe too)",
                              description="Chat in the terminal: one message per line, answers streamed as "
                                          "they are accepted; /clear forgets the conversation, /exit or Ctrl-D ends.")
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, metavar="MODEL", help=TARGET_HELP)
    p.add_argument("--method", choices=tuple(METHODS), default="vanilla", help="decoding method (default: %(default)s)")
    p.add_argument("--draft", type=Path, metavar="DIR", help="draft model or head directory")
    p.add_argument("--system", metavar="TEXT", help="system message")
    p.add_argument("--max-new-tokens", type=positive_int, default=512, metavar="N",
                   help="longest answer (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus mass in (0, 1] (default: %(default)s)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed for sampling")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="(default: %(default)s, as stored)")
    p.add_argument("--device", type=device_name, default="cpu", help="torch device (default: %(default)s)")
    add_weights_argument(p)
    p.add_argument("--no-profile", action="store_true",
                   help="ignore the hardware profile `specula calibrate` wrote for this target")
    add_method_arguments(p)
    p.set_defaults(handler=run_chat_command)


def run_chat_command(args: argparse.Namespace) -> int:
    SamplingParams(args.temperature, 0, args.top_p)  # a typo fails before the model loads
    check_seed(args.seed)
    speculator = build_speculator(args.target, method=args.method, draft=args.draft, dtype=args.dtype,
                                  device=args.device, profile=not args.no_profile, weights=args.weights,
                                  **method_options(args))
    return run_chat(speculator, sys.stdin, sys.stdout, system=args.system, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, top_p=args.top_p, seed=args.seed)
