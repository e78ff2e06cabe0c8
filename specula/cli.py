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

from specula.bench.cli import add_bench_parser, add_calibrate_parser
from specula.check_cli import add_check_parser
from specula.errors import SpeculaError
from specula.formats import add_convert_parser
from specula.training.eagle3_trainer import add_train_eagle3_parser
from specula.training.ldlp_trainer import add_train_ldlp_parser
from specula.training.medusa_trainer import add_train_medusa_parser

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
    p.add_argument("--tree-total-tokens", type=positive_int, metavar="N",
                   help="eagle2/eagle3: draft nodes kept after reranking (default: measured for the device)")
    p.add_argument("--tree-depth", type=positive_int, metavar="N", help="eagle2/eagle3: expansion steps")
    p.add_argument("--tree-top-k", type=positive_int, metavar="K", help="eagle2/eagle3: nodes expanded per step")
    p.add_argument("--tree-choices", type=tree_choices, metavar="JSON",
                   help="eagle: static tree as a JSON list of child-rank paths, e.g. '[[0],[1],[0,0]]'")
    p.add_argument("--ldlp", type=Path, metavar="DIR",
                   help="ada: the draft length predictor (default: DRAFT/ldlp; `specula train ldlp`)")
    p.add_argument("--ada-tree", action="store_true",
                   help="ada: draft an EAGLE-2 dynamic tree of the predicted depth instead of a chain")
    p.add_argument("--no-profile", action="store_true",
                   help="ignore the hardware profile `specula calibrate` wrote for this target")
    p.add_argument("--acceptance", choices=("lossless", "typical"), default="lossless",
                   help="lossless (default) keeps the target's exact output; typical is Medusa's typical "
                        "acceptance: longer accepted paths but LOSSY at T > 0")
    # Two spellings each: Medusa's code names (posterior threshold/alpha) and its paper's symbols (ε, δ).
    p.add_argument("--typical-threshold", "--typical-epsilon", type=float, metavar="EPS",
                   help="typical acceptance ε (default: 0.09)")
    p.add_argument("--typical-alpha", "--typical-delta", type=float, metavar="DELTA",
                   help="typical acceptance δ (default: 0.3)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    p.set_defaults(handler=run_generate)


def tree_choices(text: str) -> list[list[int]]:
    try:
        paths = json.loads(Path(text).read_text() if Path(text).is_file() else text)
    except (OSError, json.JSONDecodeError) as err:
        raise argparse.ArgumentTypeError(f"tree choices must be a JSON list of paths: {err}") from err
    if not (isinstance(paths, list) and paths and all(
            isinstance(p, list) and p and all(isinstance(r, int) and r >= 0 for r in p) for p in paths)):
        raise argparse.ArgumentTypeError("tree choices must be a non-empty JSON list of non-empty rank lists")
    present = {tuple(p) for p in paths}
    if any(tuple(p[:-1]) not in present for p in paths if len(p) > 1):
        raise argparse.ArgumentTypeError("every tree path's parent path must be listed too")
    return paths


def drafter_options(args: argparse.Namespace) -> dict:
    """Method options given on the command line (absent ones keep the method's defaults)."""
    names = {"num_draft_tokens": "num_tokens", "tree_total_tokens": "total_tokens", "tree_depth": "depth",
             "tree_top_k": "top_k", "tree_choices": "choices", "ldlp": "ldlp"}
    options = {option: getattr(args, arg) for arg, option in names.items() if getattr(args, arg) is not None}
    if (args.ldlp is not None or args.ada_tree) and args.method != "ada":
        raise SpeculaError(f"--ldlp and --ada-tree apply only to method ada, not {args.method}")
    if args.ada_tree:
        options["tree"] = True
    tree_options = {"total_tokens", "depth", "top_k", "choices"} & set(options)
    if tree_options and args.method not in ("eagle", "eagle2", "eagle3", "medusa", "ada"):
        raise SpeculaError(f"--tree-* options do not apply to method {args.method}")
    if "num_tokens" in options and args.method not in ("sps", "pld", "ada"):
        raise SpeculaError(f"--num-draft-tokens does not apply to method {args.method}")
    return options


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
    options = drafter_options(args)
    if args.acceptance != "typical" and (args.typical_threshold is not None or args.typical_alpha is not None):
        raise SpeculaError("--typical-threshold and --typical-alpha apply only with --acceptance typical")
    speculator = specula.load(args.target, method=args.method, draft=args.draft, dtype=args.dtype,
                              device=args.device, acceptance=args.acceptance,
                              typical_threshold=args.typical_threshold, typical_alpha=args.typical_alpha,
                              profile=not args.no_profile, **options)
    # Warn only once loading has accepted the options, so bad input stays a single error line.
    if args.acceptance == "typical" and args.temperature > 0:
        print(f"{PROG}: warning: --acceptance typical is lossy: at temperature > 0 the output is not distributed "
              "as the target's", file=sys.stderr)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed)
    if args.json:
        result = speculator.generate(prompt, **sampling)
        report = {"method": args.method, "acceptance": args.acceptance,
                  "lossless": speculator.lossless or args.temperature == 0,  # typical is greedy matching at T=0
                  "text": result.text, "token_ids": result.token_ids, **result.stats.as_dict()}
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


# ---------------------------------------------------------------- train


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """Options every head trainer shares: target, data, self-distillation, caching, schedule, resume."""
    from specula.api import DEFAULT_TARGET

    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, metavar="DIR",
                   help="target model directory (default: the bundled %(default)s)")
    p.add_argument("--data", type=Path, required=True, metavar="FILE",
                   help="JSONL of {'conversations': [...]}, {'prompt': ...} or {'text': ...} records")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the head and checkpoints go")
    p.add_argument("--cache-dir", type=Path, metavar="DIR",
                   help="keep regenerated samples and target features here and reuse them (resumable)")
    p.add_argument("--no-regenerate", action="store_true",
                   help="train on the data's own responses instead of the target's (no self-distillation)")
    p.add_argument("--gen-max-new-tokens", type=positive_int, default=256, metavar="N",
                   help="length of regenerated responses (default: %(default)s)")
    p.add_argument("--gen-temperature", type=float, default=0.0, metavar="T",
                   help="temperature of regenerated responses (default: %(default)s, greedy)")
    p.add_argument("--gen-batch-size", type=positive_int, default=16, metavar="N")
    p.add_argument("--eval-samples", type=positive_int, default=32, metavar="N",
                   help="samples held out for the per-epoch evaluation (default: %(default)s)")
    p.add_argument("--train-samples", type=positive_int, metavar="N",
                   help="train on only the first N non-held-out samples (data-scaling runs share one cache)")
    p.add_argument("--max-prompt-context", type=positive_int, metavar="N",
                   help="train on at most N prompt tokens before each response (faster on long prompts)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32",
                   help="target dtype for features (default: %(default)s)")
    p.add_argument("--device", type=device_name, default="cpu")
    p.add_argument("--epochs", type=positive_int, default=4)
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step over all processes")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--save-every", type=positive_int, default=200, metavar="STEPS")
    p.add_argument("--mixed-precision", choices=("auto", "no", "bf16", "fp16"), default="auto",
                   help="autocast for training (auto: bf16 on CUDA, none on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")


def training_inputs(args: argparse.Namespace, request):
    """Load the target and build (target, train set, eval set, TrainConfig) from the shared options."""
    from specula.target import Target
    from specula.training.loop import TrainConfig
    from specula.training.recipe import DataOptions, feature_sets

    if not args.data.is_file():
        raise SpeculaError(f"data file not found: {args.data}")
    target = Target.load(args.target, dtype=args.dtype, device=args.device)
    options = DataOptions(args.data, args.cache_dir, not args.no_regenerate, args.gen_max_new_tokens,
                          args.gen_temperature, args.gen_batch_size, args.eval_samples, args.seed,
                          args.train_samples, args.max_prompt_context)
    train_set, eval_set = feature_sets(target, options, request, log=lambda message: print(message,
                                                                                           file=sys.stderr))
    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                         grad_clip=args.grad_clip, save_every=args.save_every, seed=args.seed,
                         mixed_precision=args.mixed_precision)
    return target, train_set, eval_set, config


def add_train_eagle(trainers: argparse._SubParsersAction) -> None:
    p = trainers.add_parser("eagle", help="train an EAGLE head (EAGLE-1 paper) by self-distillation",
                            description="Train an EAGLE draft head for a target; it serves eagle and eagle2.")
    add_data_arguments(p)
    p.add_argument("--num-layers", type=positive_int, default=1, help="decoder layers in the head")
    p.set_defaults(handler=run_train_eagle)


def run_train_eagle(args: argparse.Namespace) -> int:
    from specula.target import FeatureRequest
    from specula.training.eagle_trainer import EagleTrainOptions, train_eagle

    target, train_set, eval_set, config = training_inputs(args, FeatureRequest(final_hidden=True))
    train_eagle(target, train_set, eval_set, args.out, config, EagleTrainOptions(num_layers=args.num_layers),
                resume=args.resume, log=lambda message: print(message, file=sys.stderr))
    print(f"EAGLE head written to {args.out}", file=sys.stderr)
    return 0


# Each entry registers one trainer on the `train` subcommand's subparsers.
TRAINERS: list[Callable[[argparse._SubParsersAction], None]] = [add_train_eagle, add_train_eagle3_parser,
                                                                add_train_medusa_parser, add_train_ldlp_parser]


def add_train(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a draft head on data the target generates itself")
    trainers = p.add_subparsers(dest="trainer", required=True, metavar="KIND")
    for add in TRAINERS:
        add(trainers)


# ---------------------------------------------------------------- entry point

# Each entry registers one subcommand on the shared subparsers (train, bench, calibrate, serve, convert go here).
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_generate, add_train, add_bench_parser, add_calibrate_parser, add_convert_parser, add_check_parser,
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
