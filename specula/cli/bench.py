"""The `bench`, `calibrate` and `speedcheck` subcommands.

Each sets ``handler`` to a function of the parsed arguments returning the exit
status; bad input raises SpeculaError (one ``specula: error:`` line, exit 2).
The command line and a bench config file are merged here into `BenchSettings`;
the measuring lives in `specula.bench`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from specula.bench.calibrate import CalibrationOptions, calibrate, format_report
from specula.bench.config import method_specs, parse_option, read_config
from specula.bench.llama_server import LlamaServerNotInstalled, find_llama_server
from specula.bench.questions import load_questions, read_questions
from specula.bench.suite import BenchSettings, results_path, run_bench
from specula.bench.vanilla_vs_hf import DEFAULT_PROMPTS, read_prompts
from specula.bench.vanilla_vs_hf import run as vanilla_vs_hf
from specula.cli.common import (
    DTYPE_CHOICES,
    add_compile_argument,
    add_weights_argument,
    device_name,
    positive_int,
    unit_fraction,
)
from specula.errors import SpeculaError
from specula.files.outputs import check_replaceable_file, prepare_output_dir
from specula.methods import DEFAULT_TARGET, METHODS, resolve_draft
from specula.openmp import default_threads
from specula.runtime.auto_weights import resolve_auto_weights
from specula.runtime.loading import check_model_dir
from specula.runtime.model_source import model_name
from specula.runtime.profile import all_defaults, load_profile, profile_path, save_profile
from specula.runtime.weights import resolve_weights
from specula.sampling import SamplingParams, check_seed

# MT-bench: the chat evaluation set of the papers, for the bundled chat model (pycode/eval.jsonl served the old
# code fixture).
DEFAULT_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mt_bench" / "question.jsonl"


def _split(value) -> list[str]:
    """A comma-separated string or a list (from a config) as a list of non-empty strings."""
    if value is None:
        return []
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


def _floats(value, name: str) -> list[float]:
    return [_float(v, name) for v in (value if isinstance(value, list) else _split(value))]


def _float(value, name: str) -> float:
    """A number from the command line or a config file (where a string such as "x" is no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SpeculaError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError as err:
        raise SpeculaError(f"{name} must be a number, got {value!r}") from err


def _text(value, name: str) -> str | None:
    """A name or path from a config file: a string (a number or a table there is a mistake, not a name)."""
    if value is not None and not isinstance(value, (str, Path)):
        raise SpeculaError(f"{name} must be a string, got {value!r}")
    return None if value is None else str(value)


def _flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise SpeculaError(f"{name} must be true or false, got {value!r}")
    return value


def _int(value, name: str, minimum: int | None = 1) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpeculaError(f"{name} must be a whole number, got {value!r}")
    try:
        number = int(value)
    except ValueError as err:
        raise SpeculaError(f"{name} must be a whole number, got {value!r}") from err
    if minimum is not None and number < minimum:
        raise SpeculaError(f"{name} must be >= {minimum}, got {number}")
    return number


def _device(value) -> str:
    """A config file's device, checked as --device is (`device_name`)."""
    try:
        return device_name(_text(value, "device"))
    except argparse.ArgumentTypeError as err:
        raise SpeculaError(f"device: {err}") from None


# ---------------------------------------------------------------- bench


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="Spec-Bench-style benchmark: methods side by side, tables and plots",
        description="Run methods side by side on question sets (one model load, warm-up, questions interleaved "
                    "across methods) and write results.json, results.md and plots to --out. Rerun the same "
                    "command to resume. Options may also come from a TOML/JSON --config ([bench] and "
                    "[methods.LABEL] tables); the command line wins.")
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML (or .json) file with [bench] and [methods.*]")
    p.add_argument("--target", metavar="DIR", help="target model (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--methods", metavar="LIST",
                   help="comma-separated method labels: our methods (vanilla, sps, pld, eagle, eagle2, ...) and "
                        "transformers baselines hf, hf_assisted, hf_pld, llama.cpp baselines llamacpp, "
                        "llamacpp-draft; a label may name any method via its config table")
    p.add_argument("--option", action="append", default=[], metavar="LABEL.KEY=VALUE",
                   help="a method option, e.g. sps.draft=../shared/models/llama2xs or eagle2.total_tokens=16 "
                        "(repeatable; overrides the config)")
    p.add_argument("--data", metavar="FILES", help=f"comma-separated question files (JSONL or .jsonl.gz with "
                                                   f"turns, prompt or text; default {DEFAULT_DATA})")
    p.add_argument("--category", metavar="LIST", help="only these categories (or MT-bench subcategories)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="at most N questions per category and file")
    p.add_argument("--temperature", metavar="LIST", help="one or more temperatures, e.g. 0,1 (default: 0)")
    p.add_argument("--top-p", type=float, metavar="P", help="(default: 1.0)")
    p.add_argument("--top-k", type=int, metavar="K", help="0 disables top-k (default: 0, also for transformers)")
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N", help="per turn (default: 128)")
    p.add_argument("--max-prompt-tokens", type=positive_int, metavar="N",
                   help="keep only the last N prompt tokens (default: what fits the context)")
    p.add_argument("--seed", type=int, metavar="S", help="base seed for sampling (default: 0)")
    p.add_argument("--out", type=Path, metavar="DIR", help="output directory (resumes from its results.json)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help="(default: auto, as stored)")
    p.add_argument("--device", type=device_name, help="torch device (default: cpu)")
    add_weights_argument(p, default=None)  # every row (transformers baselines too) runs on the same target weights
    add_compile_argument(p, default=None)
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help="torch threads for the run, llama.cpp rows too (default: generate's, docs/defaults.md)")
    p.add_argument("--warmup-tokens", type=positive_int, metavar="N", help="warm-up length per method (default 16)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="llama.cpp's llama-server binary for the llamacpp rows (default: $SPECULA_LLAMA_SERVER, "
                        "else llama-server on PATH)")
    p.add_argument("--profile", type=Path, metavar="FILE",
                   help="hardware profile from specula calibrate (default: the target's, when present)")
    p.add_argument("--no-profile", action="store_true", help="ignore any hardware profile")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_bench_command)


def bench_settings(args: argparse.Namespace):
    """Merge command line, config file and defaults into BenchSettings (loads no model)."""

    config = read_config(args.config) if args.config else {"bench": {}, "methods": {}}
    bench = config["bench"]

    def pick(name: str, default=None):
        value = getattr(args, name, None)
        return value if value is not None else bench.get(name, default)

    target = _text(pick("target", DEFAULT_TARGET), "target")
    check_model_dir(target, "target")
    out = _text(pick("out"), "out")
    if out is None:
        raise SpeculaError("bench needs --out DIR (or out in the config's [bench] table)")
    temperatures = _floats(pick("temperature", [0.0]), "temperature")
    top_p = _float(pick("top_p", 1.0), "top_p")
    top_k = _int(pick("top_k", 0), "top_k", minimum=0)
    for t in temperatures:
        SamplingParams(t, top_k, top_p)  # validates
    seed = _int(pick("seed", 0), "seed", minimum=0)
    check_seed(seed)
    dtype = _text(pick("dtype", "auto"), "dtype")
    if dtype not in DTYPE_CHOICES:
        raise SpeculaError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    weights = _text(pick("weights", "auto"), "weights")
    resolve_weights(weights)  # a config file's value is not checked by argparse
    if not temperatures or len(set(temperatures)) != len(temperatures):
        raise SpeculaError("give each temperature once (e.g. --temperature 0,1)")
    data = _split(pick("data", str(DEFAULT_DATA)))
    if data == [str(DEFAULT_DATA)] and not DEFAULT_DATA.exists():  # e.g. installed from a wheel
        raise SpeculaError(f"no --data given and the default question file {DEFAULT_DATA} (MT-bench, beside a "
                           f"repository checkout in ../shared/data) is not here: pass --data FILE")
    categories = _split(pick("category")) or None
    limit = _int(pick("limit"), "limit")
    questions = load_questions(data, categories, limit)

    profile = None
    if not args.no_profile:
        profile = load_profile(model_name(target), args.profile)
    device = _device(pick("device", "cpu"))
    # auto as the profile chose, else as this machine decided for the target: spelled out in the report
    weights = resolve_auto_weights(weights, target, device, profile)
    labels = _split(pick("methods"))
    specs = method_specs(labels, config["methods"], args.option, all_defaults(profile, device))
    # A directory holding its results.json is an earlier run to resume; any other non-empty one is not ours to fill.
    prepare_output_dir(out, "bench", resume=True, create=False, own_file=results_path(Path(out)).name)
    llama_server = None
    if any(spec.is_llamacpp for spec in specs):
        try:
            # before any model loads: fail fast
            llama_server = str(find_llama_server(_text(pick("llama_server"), "llama_server")))
        except LlamaServerNotInstalled as err:
            # llama.cpp is an optional reference (built from source, outside the install): when nobody named
            # a binary and none is on PATH, its rows are skipped with one line; a named one must exist.
            if all(spec.is_llamacpp for spec in specs):
                raise
            skipped = [spec.label for spec in specs if spec.is_llamacpp]
            print(f"specula: skipping {', '.join(skipped)}: {err}", file=sys.stderr)
            specs = [spec for spec in specs if not spec.is_llamacpp]
    for spec in specs:
        if spec.is_llamacpp:
            if spec.draft is not None and not Path(spec.draft).exists():
                raise SpeculaError(f"draft of method {spec.label} not found: {spec.draft}")
            continue
        if spec.is_hf:
            if spec.draft is not None and not Path(spec.draft).is_dir():
                raise SpeculaError(f"draft directory of method {spec.label} not found: {spec.draft}")
            continue
        try:
            draft = resolve_draft(spec.method, target, spec.draft)
        except SpeculaError as err:
            raise SpeculaError(f"method {spec.label}: {err}") from None
        spec.draft = None if draft is None else str(draft)
    settings = BenchSettings(
        target=target, methods=specs, data=data, questions=questions, out=Path(out), temperatures=temperatures,
        max_new_tokens=_int(pick("max_new_tokens", 128), "max_new_tokens"), seed=seed,
        dtype=dtype, weights=weights, compile=_flag(pick("compile", False), "compile"),
        device=device, threads=_int(pick("threads", default_threads()), "threads"),
        top_p=top_p, top_k=top_k, max_prompt_tokens=_int(pick("max_prompt_tokens"), "max_prompt_tokens"),
        warmup_tokens=_int(pick("warmup_tokens", 16), "warmup_tokens"), categories=categories, limit=limit,
        profile=profile, progress=not args.no_progress, llama_server=llama_server,
    )
    settings.command = canonical_command(settings)
    return settings


def canonical_command(settings) -> str:
    """The run as one `specula bench` command with every setting spelled out (recorded in results.md)."""
    parts = ["specula", "bench", "--target", settings.target,
             "--methods", ",".join(spec.label for spec in settings.methods), "--data", ",".join(settings.data)]
    if settings.categories:
        parts += ["--category", ",".join(settings.categories)]
    if settings.limit:
        parts += ["--limit", str(settings.limit)]
    parts += ["--temperature", ",".join(f"{t:g}" for t in settings.temperatures),
              "--max-new-tokens", str(settings.max_new_tokens), "--seed", str(settings.seed),
              "--dtype", settings.dtype, "--weights", settings.weights] + ["--compile"] * settings.compile
    if settings.threads:
        parts += ["--threads", str(settings.threads)]
    if settings.max_prompt_tokens:
        parts += ["--max-prompt-tokens", str(settings.max_prompt_tokens)]
    if (settings.top_k, settings.top_p) != (0, 1.0):
        parts += ["--top-k", str(settings.top_k), "--top-p", f"{settings.top_p:g}"]
    if settings.llama_server:
        parts += ["--llama-server", settings.llama_server]
    parts.append("--no-profile")  # profile defaults, if any were used, are spelled out below
    for spec in settings.methods:
        parts += ["--option", f"{spec.label}.method={spec.method}"] * (spec.label != spec.method)  # own method
        if spec.draft is not None:
            parts += ["--option", f"{spec.label}.draft={spec.draft}"]
        for key, value in spec.options.items():
            parts += ["--option", f"{spec.label}.{key}={json.dumps(value)}"]
    parts += ["--out", str(settings.out)]
    return " ".join(shlex.quote(p) for p in parts)


def run_bench_command(args: argparse.Namespace) -> int:
    settings = bench_settings(args)
    try:
        results = run_bench(settings)
    except KeyboardInterrupt:
        print(f"specula: interrupted: the records finished so far are kept in {settings.out / 'results.json'}; "
              "run the same command again to resume", file=sys.stderr)
        raise
    out = settings.out
    print(f"{len(results['records'])} records in {out / 'results.json'}; table in {out / 'results.md'}",
          file=sys.stderr)
    for temperature, table in results["aggregates"].items():
        for method, row in table.items():
            s = row["overall"]
            speed = "–" if s["speedup"] is None else f"{s['speedup']:.2f}x"
            tau = "–" if s["tau"] is None else f"{s['tau']:.2f}"
            equal = "" if s.get("greedy_equal") is None else f", greedy equal {s['greedy_equal']:.2f}"
            server = results.get("llamacpp", {}).get(temperature, {}).get(method)
            own = "" if not server or server["decode_tokens_per_s"] is None else \
                f" (llama.cpp's own decode rate {server['decode_tokens_per_s']:.1f} tokens/s)"
            print(f"T={temperature} {method}: {s['tokens_per_s']:.1f} tokens/s, speedup {speed}, tau {tau}{equal}{own}")
    return 0


# ---------------------------------------------------------------- calibrate


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure α, c and verification cost; predict the best draft budget; save a profile",
        description="Measure on this machine the acceptance rate α of a method, its cost coefficient c and the "
                    "target's verification cost for 1..128 tokens; print the lecture's predictions next to the "
                    "measured speedup and write a hardware profile that bench uses as defaults.")
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, metavar="DIR",
                   help="target model directory (default: the bundled %(default)s)")
    p.add_argument("--method", required=True, metavar="M", help="method to calibrate (sps, pld, eagle2, ...)")
    p.add_argument("--draft", type=Path, metavar="DIR", help="draft model or head directory")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter option for the measured runs, e.g. num_tokens=4 (repeatable)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, metavar="FILE",
                   help="question file whose first turns are the prompts (default: %(default)s)")
    p.add_argument("--prompts", type=positive_int, default=4, metavar="N", help="(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N", help="(default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=256, metavar="N", help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="(default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=5, metavar="N",
                   help="timed forwards per verification size (default: %(default)s)")
    p.add_argument("--max-nodes", type=positive_int, default=128, metavar="N",
                   help="largest tree budget considered (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="(default: %(default)s, as stored)")
    p.add_argument("--device", type=device_name, default="cpu")
    add_weights_argument(p)
    add_compile_argument(p)
    p.add_argument("--min-agreement", type=unit_fraction, default=0.8, metavar="F",
                   help="with --weights auto, choose only formats whose greedy top-1 tokens agree with the float32 "
                        "model's on at least this fraction of positions (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=default_threads(), metavar="N",
                   help="torch threads (default: generate's, whose profile this is: docs/defaults.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, metavar="FILE",
                   help="profile file to write (default: ~/.cache/specula/runtime/profile-<target name>.json)")
    p.add_argument("--no-save", action="store_true", help="print only; write no profile")
    p.add_argument("--json", action="store_true", help="print the profile as JSON instead of the summary")
    p.set_defaults(handler=run_calibrate_command)


def run_calibrate_command(args: argparse.Namespace) -> int:
    if args.method not in METHODS or args.method == "vanilla":
        raise SpeculaError(f"cannot calibrate method '{args.method}'; choose one of "
                           f"{', '.join(m for m in METHODS if m != 'vanilla')}")
    SamplingParams(args.temperature)
    check_seed(args.seed)
    check_model_dir(args.target, "target")
    if args.out is not None and not args.no_save:  # checked before minutes of measuring, not after them
        check_replaceable_file(args.out, "--out", "a hardware profile", is_profile)
    options = {}
    for text in args.option:
        _, key, value = parse_option(f"{args.method}.{text}")
        options[key] = value
    prompts = [q.turns[0] for q in read_questions(args.data)[: args.prompts]]
    opts = CalibrationOptions(
        target=str(args.target), method=args.method, draft=None if args.draft is None else str(args.draft),
        options=options, prompts=prompts, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature, dtype=args.dtype,
        weights=args.weights, device=args.device,
        threads=args.threads, repeats=args.repeats, max_nodes=args.max_nodes, seed=args.seed,
        min_agreement=args.min_agreement, compile=args.compile)
    profile = calibrate(opts, log=lambda message: print(message, file=sys.stderr))
    if args.json:
        print(json.dumps(profile, indent=2))
    else:
        print(format_report(profile, args.method))
    if not args.no_save:
        path = save_profile(profile, args.out or profile_path(profile["target"]))
        print(f"profile written to {path}", file=sys.stderr)
    return 0


def is_profile(path: Path) -> bool:
    """Whether ``path`` holds a profile `specula calibrate` wrote (it merges into one), not some other file."""
    try:
        return "target" in load_profile("", path)
    except SpeculaError:
        return False


# ---------------------------------------------------------------- speed check


def add_speedcheck_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("speedcheck", help="vanilla tokens/s of specula's runtime against transformers",
                              description="Decode the same prompts greedily with specula's vanilla loop and "
                                          "`transformers` generate, interleaved, and print both rates.")
    p.add_argument("--target", default=str(DEFAULT_TARGET), metavar="DIR")
    p.add_argument("--dtype", default="float32", help="one or more of float32,bfloat16,float16 (comma separated)")
    p.add_argument("--prompts-file", type=Path, default=DEFAULT_PROMPTS, metavar="FILE")
    p.add_argument("--prompts", type=positive_int, default=6, metavar="N")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=256, metavar="N")
    p.add_argument("--repeats", type=positive_int, default=1, metavar="N")
    p.set_defaults(handler=run_speedcheck)


def run_speedcheck(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompts_file, args.prompts)
    for dtype in args.dtype.split(","):
        result = vanilla_vs_hf(args.target, dtype, prompts, args.max_new_tokens, args.max_prompt_tokens, args.repeats)
        print(json.dumps(result))
    return 0
