"""`specula convert`: an EAGLE-3 head between the official/SGLang layout and vLLM's speculators layout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specula.cli.common import positive_int
from specula.formats import FORMATS, convert


def add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("convert", help="convert an EAGLE-3 head to the vLLM speculators or SGLang layout",
                              description="Convert an EAGLE-3 draft head between the official EAGLE-3 / SGLang "
                                          "layout and the vLLM speculators layout (docs/formats.md).")
    p.add_argument("--draft", type=Path, required=True, metavar="DIR", help="the head to convert (either layout)")
    p.add_argument("--to", required=True, choices=FORMATS, help="layout to write")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--target", type=Path, metavar="DIR",
                   help="target model directory (needed for --to speculators: embedding and verifier)")
    p.add_argument("--speculative-tokens", type=positive_int, default=3, metavar="N",
                   help="speculators: draft tokens of the greedy proposal method (default: %(default)s)")
    p.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    source = convert(args.draft, args.to, args.out, args.target, args.speculative_tokens)
    print(f"converted {args.draft} ({source}) to {args.to} in {args.out}", file=sys.stderr)
    return 0
