"""The data stage of `specula train`: generation with captured features (`specula train data`, and ``--generated``
on every trainer), so that one command makes the data a head trains on."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specula.cli.common import DTYPE_CHOICES, device_name, number_list, positive_int
from specula.errors import SpeculaError
from specula.files.outputs import prepare_output_dir
from specula.heads.eagle3_head import default_feature_layers, fused_feature_request
from specula.methods import DEFAULT_TARGET
from specula.runtime.target import FeatureRequest, Target
from specula.runtime.weights import WEIGHT_FORMATS
from specula.training.conversations import (
    ANSWER_TOKENS,
    DOCUMENT_ANSWER_SCALE,
    LONG_ANSWER_SCALE,
    JobMaker,
    PromptMix,
)
from specula.training.generated import FEATURE_DTYPES, RUN_FILE, GenerationOptions, default_weights, generate_data
from specula.training.recipe import generated_sets
from specula.training.records import has_chat_template


def add_generation_arguments(p: argparse.ArgumentParser, standalone: bool = False) -> None:
    """Options of generation with capture; ``standalone`` for `specula train data` (which has its own --out)."""
    if not standalone:
        p.add_argument("--generated", type=Path, metavar="DIR",
                       help="train on data the target generated with its features captured (`specula train data`) "
                            "instead of --data; with --gen-tokens it is generated (or extended) first")
    p.add_argument("--gen-tokens", type=positive_int, metavar="N",
                   help="generate until the data holds N response tokens (resumes a run already there)")
    p.add_argument("--gen-weights", choices=[f for f in WEIGHT_FORMATS if f != "auto"],
                   help="weights format the target generates in, the one the head will serve (default: q4_1 where "
                        "its kernel is built, else float32; an existing run keeps its own)")
    p.add_argument("--gen-top-k", type=positive_int, default=32, metavar="K",
                   help="most probable next tokens kept per position with their probabilities (default: "
                        "%(default)s)")
    p.add_argument("--gen-feature-dtype", choices=list(FEATURE_DTYPES), default="float16",
                   help="dtype of stored features and probabilities (default: %(default)s)")
    p.add_argument("--gen-flush-jobs", type=positive_int, default=16, metavar="N",
                   help="finished jobs per shard: a kill loses the jobs in flight and at most N-1 finished ones")
    p.add_argument("--gen-max-jobs", type=positive_int, metavar="N", help="stop after N jobs")
    p.add_argument("--gen-max-length", type=positive_int, default=4096, metavar="N",
                   help="longest conversation in tokens (default: %(default)s)")
    p.add_argument("--gen-answer-tokens", type=positive_int, default=ANSWER_TOKENS, metavar="N",
                   help="longest ordinary answer (default: %(default)s); long-answer jobs may write 1.6 times this "
                        "(1,024), answers about a document 1.2 times (768)")
    p.add_argument("--gsm8k", type=Path, metavar="FILE", help="GSM8K train questions ({'prompt': ...} lines)")
    p.add_argument("--alpaca", type=Path, metavar="FILE", help="Alpaca seed tasks (seed_tasks.jsonl)")
    if standalone:
        p.add_argument("--target", type=Path, default=DEFAULT_TARGET, metavar="DIR",
                       help="target model directory (default: the bundled %(default)s)")
        p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the data directory (resumable)")
        p.add_argument("--capture", choices=("both", "eagle3", "eagle"), default="both",
                       help="features kept: EAGLE-3's fused layers, EAGLE's final hidden, or both (default)")
        p.add_argument("--gen-batch-size", type=positive_int, default=32, metavar="N")
        p.add_argument("--gen-temperature", type=number_list, default=(0.0, 1.0), metavar="T[,T...]",
                       help="answer temperatures, one drawn per job (default: 0,1)")
        p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
        p.add_argument("--device", type=device_name, default="cpu")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--threads", type=positive_int, metavar="N",
                       help="torch threads (default: torch's setting, every core: batched generation uses them; on "
                            "a CPU shared with other work, 1 can be faster)")


def add_train_data_parser(trainers: argparse._SubParsersAction) -> None:
    p = trainers.add_parser("data", help="generate training data with the target's features captured",
                            description="The target writes conversations (Magpie follow-ups, documents and tasks "
                                        "on them, long answers, GSM8K/Alpaca seeds) in the format it serves, "
                                        "its features and top-k distribution recorded as it writes; any trainer "
                                        "reads the result with --generated.")
    add_generation_arguments(p, standalone=True)
    p.set_defaults(handler=run_train_data)


def run_train_data(args: argparse.Namespace) -> int:
    mix_args, options = _mix_arguments(args), _options(args)
    check_data_dir(args.out, "--out")
    target = _load_target(args, args.out)
    config = target.config
    layers = default_feature_layers(config.num_hidden_layers)
    request = {"both": FeatureRequest(True, fused_feature_request(layers, config.num_hidden_layers).layer_inputs),
               "eagle3": fused_feature_request(layers, config.num_hidden_layers),
               "eagle": FeatureRequest(final_hidden=True)}[args.capture]
    request = _stored_request(args.out) or request
    totals = generate_data(target, args.out, _checked_mix(target, mix_args), request, options, log=_log)
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in totals.items()}))
    return 0


def generated_inputs(args: argparse.Namespace, request: FeatureRequest):
    """(target, train set, eval set) of ``--generated``, generating first when ``--gen-tokens`` asks for more."""
    if args.gen_tokens is not None:
        check_data_dir(args.generated, "--generated")
    target = _load_target(args, args.generated)
    if args.gen_tokens is not None:
        config = target.config
        both = FeatureRequest(True, tuple(sorted({*request.layer_inputs, *fused_feature_request(
            default_feature_layers(config.num_hidden_layers), config.num_hidden_layers).layer_inputs})))
        mix = _checked_mix(target, _mix_arguments(args))
        generate_data(target, args.generated, mix, _stored_request(args.generated) or both, _options(args), log=_log)
    train, evaluation = generated_sets(args.generated, request, args.eval_samples, args.seed, args.train_samples,
                                       args.max_prompt_context, target)
    return target, train, evaluation


def check_data_dir(directory: Path, flag: str) -> None:
    """Before the target loads: ``directory`` is new, empty or generated data to resume (its run file), never
    a directory of other files, which generation would fill (and whose ``shards/`` it would clean)."""
    prepare_output_dir(directory, "train data", resume=True, create=False, own_file=RUN_FILE, flag=flag)


def _checked_mix(target: Target, mix_args: dict) -> PromptMix:
    """The prompt mix for ``target``, its jobs proved drawable (seed prompts where there is no chat template)
    before generation creates the data directory: a refused mix leaves nothing behind."""
    mix = PromptMix(chat=has_chat_template(target.tokenizer), **mix_args)
    JobMaker(mix)
    return mix


def _mix_arguments(args: argparse.Namespace) -> dict:
    temperatures = args.gen_temperature if args.gen_temperature is not None else (0.0, 1.0)
    for path in (args.gsm8k, args.alpaca):
        if path is not None and not path.is_file():
            raise SpeculaError(f"seed file not found: {path}")
    answer = args.gen_answer_tokens
    # The longer kinds scale with it, so that a short cap (a quick trial run) shortens every job, not only some.
    return {"seed": args.seed, "temperatures": tuple(temperatures), "answer_tokens": answer,
            "long_tokens": round(answer * LONG_ANSWER_SCALE), "document_tokens": round(answer * DOCUMENT_ANSWER_SCALE),
            "gsm8k": args.gsm8k, "alpaca": args.alpaca}


def _options(args: argparse.Namespace) -> GenerationOptions:
    return GenerationOptions(response_tokens=args.gen_tokens or 100_000, max_jobs=args.gen_max_jobs,
                             batch_size=args.gen_batch_size, top_k=args.gen_top_k,
                             feature_dtype=args.gen_feature_dtype, flush_jobs=args.gen_flush_jobs,
                             max_length=args.gen_max_length)


def _stored_run(directory: Path) -> dict | None:
    """The components of the run file of the data being resumed (None if there is none yet)."""
    path = Path(directory) / RUN_FILE
    if not path.is_file():
        return None
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeculaError(f"cannot resume from {path}: {err}") from err
    components = run.get("components") if isinstance(run, dict) else None
    target = components.get("target") if isinstance(components, dict) else None
    request = components.get("request") if isinstance(components, dict) else None
    if not (isinstance(target, dict) and isinstance(target.get("format"), str) and isinstance(request, dict)
            and isinstance(request.get("layer_inputs"), list) and "final_hidden" in request):
        raise SpeculaError(f"cannot resume from {path}: it is not the run file of generated data")
    return components


def _stored_request(directory: Path) -> FeatureRequest | None:
    run = _stored_run(directory)
    if run is None:
        return None
    return FeatureRequest(run["request"]["final_hidden"], tuple(run["request"]["layer_inputs"]))


def _load_target(args: argparse.Namespace, directory: Path) -> Target:
    """The target in the data's weights format (an existing run's, else --gen-weights or the default)."""
    run = _stored_run(directory)
    weights = run["target"]["format"] if run is not None else args.gen_weights or default_weights(args.device)
    if run is not None and args.gen_weights not in (None, weights):
        raise SpeculaError(f"{directory} was generated with --gen-weights {weights}, not {args.gen_weights}")
    return Target.load(args.target, dtype=args.dtype, device=args.device, weights=weights)


def _log(message: str) -> None:
    print(message, file=sys.stderr)
