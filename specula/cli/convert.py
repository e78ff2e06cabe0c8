"""`specula convert`: an EAGLE-3 head between the official/SGLang layout and vLLM's speculators layout, or to GGUF."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specula.cli.common import positive_int
from specula.errors import SpeculaError
from specula.gguf.heads import OUTTYPES, export_eagle3_gguf
from specula.heads.formats import FORMATS, convert

GGUF = "gguf"


def add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("convert", help="convert an EAGLE-3 head to the vLLM speculators or SGLang layout, "
                                              "or to a GGUF for llama.cpp",
                              description="Convert an EAGLE-3 draft head between the official EAGLE-3 / SGLang "
                                          "layout and the vLLM speculators layout (docs/formats.md), or export it "
                                          "as a GGUF that llama.cpp runs with --spec-type draft-eagle3.")
    p.add_argument("--draft", type=Path, required=True, metavar="DIR", help="the head to convert (either layout)")
    p.add_argument("--to", required=True, choices=(*FORMATS, GGUF), help="layout to write")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory (FILE.gguf for gguf)")
    p.add_argument("--target", metavar="DIR|FILE.gguf",
                   help="target model (needed for --to speculators: embedding and verifier; for --to gguf: its "
                        "tokenizer and shape, best the .gguf llama.cpp will run)")
    p.add_argument("--speculative-tokens", type=positive_int, default=3, metavar="N",
                   help="speculators: draft tokens of the greedy proposal method (default: %(default)s)")
    p.add_argument("--outtype", choices=OUTTYPES, default="auto",
                   help="gguf: type of the weight matrices; auto = f16, or bf16 for a bf16 head (default: %(default)s)")
    p.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    if args.to == GGUF:
        if args.target is None:
            raise SpeculaError("--to gguf needs --target: the GGUF carries the target's tokenizer and layer ids "
                               "(give the target's .gguf file that llama.cpp will run)")
        out = export_eagle3_gguf(args.draft, args.target, args.out, args.outtype)
        print(f"exported {args.draft} as an eagle3 GGUF for llama.cpp to {out}", file=sys.stderr)
        return 0
    source = convert(args.draft, args.to, args.out, args.target, args.speculative_tokens)
    print(f"converted {args.draft} ({source}) to {args.to} in {args.out}", file=sys.stderr)
    return 0
