"""`specula train KIND`: the options every head trainer shares and one parser per head kind.

Each `run_*` handler turns the parsed options into the trainer's option objects and calls it;
the training itself lives in `specula.training`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from specula.bench.questions import read_questions
from specula.cli.common import DTYPE_CHOICES, device_name, number_list, positive_int
from specula.cli.train_data import add_generation_arguments, add_train_data_parser, generated_inputs
from specula.drafters.medusa import CHOICES_FILE, check_heads_fit, read_choices_file
from specula.errors import SpeculaError
from specula.files.outputs import check_cache_dir, check_replaceable_file, prepare_output_dir
from specula.heads.eagle_head import EagleHead
from specula.heads.formats import load_head
from specula.heads.ldlp import head_fingerprint
from specula.heads.medusa_head import MedusaHeads
from specula.methods import DEFAULT_TARGET
from specula.runtime.loading import check_model_dir
from specula.runtime.target import FeatureRequest, Target
from specula.training.capture import answer_prompts
from specula.training.eagle3_trainer import (
    DEFAULT_STEPS,
    DRAFT_VOCAB_SIZE,
    Eagle3TrainOptions,
    check_start_head,
    feature_request,
    train_eagle3,
)
from specula.training.eagle_trainer import EagleTrainOptions, check_start_eagle_head, train_eagle
from specula.training.features import OnlineFeatures
from specula.training.ldlp_trainer import MAX_DRAFT_LENGTH, PENALTY, LdlpTrainOptions, format_report, train_ldlp
from specula.training.loop import TrainConfig
from specula.training.medusa_trainer import (
    DECAY,
    TREE_NODES,
    TREE_TOP_K,
    MedusaTrainOptions,
    check_start_heads,
    train_medusa,
    write_tree,
)
from specula.training.recipe import DataOptions, feature_sets
from specula.training.records import read_records
from specula.training.regeneration import prepare_samples


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """Options every head trainer shares: target, data, self-distillation, caching, schedule, resume."""

    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, metavar="DIR",
                   help="target model directory (default: the bundled %(default)s)")
    p.add_argument("--data", type=Path, metavar="FILE",
                   help="JSONL of {'conversations': [...]}, {'prompt': ...} or {'text': ...} records (or --generated)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the head and checkpoints go")
    p.add_argument("--cache-dir", type=Path, metavar="DIR",
                   help="keep regenerated samples and target features here and reuse them (resumable; "
                        "after prompts are added to --data only the new ones are regenerated)")
    p.add_argument("--no-regenerate", action="store_true",
                   help="train on the data's own responses instead of the target's (no self-distillation)")
    p.add_argument("--gen-max-new-tokens", type=positive_int, default=256, metavar="N",
                   help="length of regenerated responses (default: %(default)s)")
    p.add_argument("--gen-temperature", type=number_list, metavar="T[,T...]",
                   help="temperature of regenerated responses (default: 0, greedy; --generated: 0,1); several, "
                        "e.g. 0,1, give each prompt one response per temperature (heads serve greedy and sampled "
                        "decoding alike)")
    p.add_argument("--gen-batch-size", type=positive_int, default=16, metavar="N")
    p.add_argument("--eval-samples", type=positive_int, default=32, metavar="N",
                   help="samples held out for the per-epoch evaluation (default: %(default)s)")
    p.add_argument("--train-samples", type=positive_int, metavar="N",
                   help="train on only the first N non-held-out prompts, at each --gen-temperature (data-scaling "
                        "runs share one cache)")
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
                   help="autocast for training (auto: bf16 on CUDA and on CPUs with native bf16, AVX512-BF16 or "
                        "AMX; none on other CPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-group-by-length", dest="group_by_length", action="store_false",
                   help="batch samples in plain random order instead of with samples of similar length (less "
                        "padding; the default)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    add_generation_arguments(p)


def training_inputs(args: argparse.Namespace, request):
    """Load the target and build (target, train set, eval set, TrainConfig) from the shared options."""

    if (args.data is None) == (args.generated is None):
        raise SpeculaError("give either --data (prompts the target answers) or --generated (`specula train data`)")
    if args.data is not None and not args.data.is_file():
        raise SpeculaError(f"data file not found: {args.data}")
    # Settings and --out are checked before the target loads and regenerates data, which can take minutes.
    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
                         grad_clip=args.grad_clip, save_every=args.save_every, seed=args.seed,
                         mixed_precision=args.mixed_precision, group_by_length=args.group_by_length)
    if args.generated is not None:
        prepare_output_dir(args.out, f"train {args.trainer}", args.resume, create=False)
        return (*generated_inputs(args, request), config)
    options = DataOptions(data=args.data, cache_dir=args.cache_dir, regenerate=not args.no_regenerate,
                          max_new_tokens=args.gen_max_new_tokens, temperatures=args.gen_temperature or (0.0,),
                          batch_size=args.gen_batch_size, eval_samples=args.eval_samples, seed=args.seed,
                          train_samples=args.train_samples, max_prompt_context=args.max_prompt_context)
    kind = f"train {args.trainer}"
    prepare_output_dir(args.out, kind, args.resume, create=False)
    if args.cache_dir is not None:
        check_cache_dir(args.cache_dir, "--cache-dir")
    target = Target.load(args.target, dtype=args.dtype, device=args.device)
    # --out is claimed by the trainer once its data proved usable (`run_training`), so a run refused here (too few
    # samples, a damaged record) leaves no empty --out behind.
    train_set, eval_set = feature_sets(target, options, request, log=lambda message: print(message,
                                                                                           file=sys.stderr))
    return target, train_set, eval_set, config


def target_config_of(target: Path):
    """The target's transformers config, read without loading its weights: head checks run before minutes of
    loading and regeneration. (`transformers` is imported here, not at the top: the full `specula --help` imports
    this module and took 6 s on a 2-core AVX2 machine, 3.3 s of it `transformers`.)"""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(check_model_dir(target, "target"), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:  # what `Target.load` refuses the same way (e.g. no model_type)
        raise SpeculaError(f"target config in {target} cannot be read: {str(err).splitlines()[0]}") from err


def add_train_eagle(trainers: argparse._SubParsersAction) -> None:
    p = trainers.add_parser("eagle", help="train an EAGLE head (EAGLE-1 paper) by self-distillation",
                            description="Train an EAGLE draft head for a target; it serves eagle and eagle2.")
    add_data_arguments(p)
    p.add_argument("--num-layers", type=positive_int, help="decoder layers in the head (default: 1; with --init "
                                                           "the head's own)")
    p.add_argument("--init", type=Path, metavar="HEAD_DIR",
                   help="fine-tune this EAGLE head instead of training a fresh one, e.g. on sampled answers for a "
                        "head trained on greedy ones")
    p.set_defaults(handler=run_train_eagle)


def run_train_eagle(args: argparse.Namespace) -> int:
    options = EagleTrainOptions(num_layers=args.num_layers, init=args.init)
    if args.init is not None:  # checked before the target loads and data is regenerated
        target_config = target_config_of(args.target)
        check_start_eagle_head(EagleHead.from_pretrained(args.init), target_config.hidden_size,
                               target_config.vocab_size, options)
    target, train_set, eval_set, config = training_inputs(args, FeatureRequest(final_hidden=True))
    train_eagle(target, train_set, eval_set, args.out, config, options,
                resume=args.resume, log=lambda message: print(message, file=sys.stderr))
    print(f"EAGLE head written to {args.out}", file=sys.stderr)
    return 0


def add_train_eagle3_parser(trainers: argparse._SubParsersAction) -> None:
    p = trainers.add_parser("eagle3", help="train an EAGLE-3 head (training-time test) by self-distillation",
                            description="Train an EAGLE-3 draft head for a target; it serves --method eagle3.")
    add_data_arguments(p)
    p.add_argument("--draft-vocab-size", type=positive_int, metavar="N",
                   help=f"most frequent response tokens the head predicts (default: {DRAFT_VOCAB_SIZE}; with "
                        "--init the head's own)")
    p.add_argument("--feature-layers", type=_layer_list, metavar="I,J,K",
                   help="target layers whose inputs are fused (default: 2,N//2,N-3; N means the final hidden)")
    p.add_argument("--ttt-steps", type=positive_int, metavar="K",
                   help="simulated draft steps per sample (default: the draft depth of the device's default "
                        f"budget, at most {DEFAULT_STEPS}: 1 on a CPU)")
    p.add_argument("--head-layers", type=positive_int, metavar="N",
                   help="decoder layers of a fresh head (default: 1, the paper's; each more costs a layer's step "
                        "per draft level; vLLM, SGLang and llama.cpp run one-layer heads only)")
    p.add_argument("--output-from-target", action="store_true",
                   help="start a fresh head's LM head and final norm as the target's (its LM head's rows of the "
                        "draft vocabulary) instead of at random")
    p.add_argument("--eval-prompts", type=Path, metavar="FILE",
                   help="chat prompts held out from training ({'prompt'} or MT-bench-style {'turns': [...]} lines, "
                        "e.g. data/smollm2_heldout_prompts.jsonl): the target answers them greedily, 128 tokens a "
                        "turn, before training, and each epoch reports n-alpha on those answers as chat-n-alpha")
    p.add_argument("--init", type=Path, metavar="HEAD_DIR",
                   help="fine-tune this EAGLE-3 head (keeping its draft vocabulary and fused layers) instead of "
                        "training a fresh one, e.g. on sampled answers for a head trained on greedy ones")
    p.set_defaults(handler=run_train_eagle3)


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got '{text}'") from err
    if not layers:
        raise argparse.ArgumentTypeError("give at least one layer")
    return layers


def run_train_eagle3(args: argparse.Namespace) -> int:
    config = target_config_of(args.target)
    options = Eagle3TrainOptions(args.draft_vocab_size, args.feature_layers, args.ttt_steps, init=args.init,
                                 layers=args.head_layers, output_from_target=args.output_from_target)
    layers = args.feature_layers
    if args.init is not None:
        # Checked before the target loads and data is regenerated; the head decides which features to cache.
        start = load_head(args.init, num_target_layers=config.num_hidden_layers)
        check_start_head(start, config.hidden_size, config.vocab_size, options)
        layers = tuple(start.feature_layers)
    request = feature_request(config, layers)
    # The bench's question reader: turns / prompt / text lines, as `specula bench` reads MT-bench.
    chat = [list(q.turns) for q in read_questions(args.eval_prompts)] if args.eval_prompts is not None else None
    target, train_set, eval_set, train_config = training_inputs(args, request)
    if chat is not None:
        options = replace(options, chat_samples=answer_prompts(target, chat, request))
    train_eagle3(target, train_set, eval_set, args.out, train_config, options, resume=args.resume,
                 log=lambda message: print(message, file=sys.stderr))
    print(f"EAGLE-3 head written to {args.out}", file=sys.stderr)
    return 0


def add_train_medusa_parser(trainers: argparse._SubParsersAction) -> None:
    """Register `specula train medusa` and `specula train medusa-tree` on the `train` subcommand's subparsers."""
    p = trainers.add_parser("medusa", help="train Medusa heads (Medusa-1, frozen target) by self-distillation",
                            description="Train Medusa heads for a target; they serve --method medusa.")
    add_data_arguments(p)
    p.add_argument("--num-heads", type=positive_int, help="heads, i.e. tree depth (default: 4; with --init the "
                                                         "heads' own)")
    p.add_argument("--num-layers", type=int, help="residual blocks per head (default: 1; with --init the heads' own)")
    p.add_argument("--decay", type=float, default=DECAY,
                   help="loss weight of head k is decay^(k-1) (default: %(default)s)")
    p.add_argument("--tree-nodes", type=positive_int, default=TREE_NODES,
                   help="candidates of the tree built from held-out accuracies (default: %(default)s)")
    p.add_argument("--shared-lm-head", action="store_true",
                   help="project through the target's frozen LM head instead of a trained copy per head: only "
                        "the residual blocks are trained and stored (small files with a large vocabulary; "
                        "published Medusa loaders do not read this layout; with --init the heads' own)")
    p.add_argument("--init", type=Path, metavar="HEAD_DIR",
                   help="fine-tune these Medusa heads (keeping their count, blocks and LM-head layout) instead of "
                        "training fresh ones, e.g. on sampled answers for heads trained on greedy ones")
    p.set_defaults(handler=run_train_medusa)
    add_medusa_tree_parser(trainers)


def run_train_medusa(args: argparse.Namespace) -> int:
    if args.num_layers is not None and args.num_layers < 0:
        raise SpeculaError(f"--num-layers must be >= 0, got {args.num_layers}")
    if args.shared_lm_head and args.num_layers == 0:
        raise SpeculaError("--shared-lm-head needs --num-layers >= 1 (the blocks are all that is trained)")
    if not 0.0 < args.decay <= 1.0:
        raise SpeculaError(f"--decay must be in (0, 1], got {args.decay}")
    options = MedusaTrainOptions(num_heads=args.num_heads, num_layers=args.num_layers, decay=args.decay,
                                 tree_nodes=args.tree_nodes, base_model_name_or_path=str(args.target),
                                 shared_lm_head=args.shared_lm_head, init=args.init)
    if args.init is not None:  # checked before the target loads and data is regenerated
        target_config = target_config_of(args.target)
        check_start_heads(MedusaHeads.from_pretrained(args.init), target_config.hidden_size,
                          target_config.vocab_size, options)
    target, train_set, eval_set, config = training_inputs(args, FeatureRequest(final_hidden=True))
    train_medusa(target, train_set, eval_set, args.out, config, options, resume=args.resume,
                 log=lambda message: print(message, file=sys.stderr))
    print(f"Medusa heads written to {args.out}", file=sys.stderr)
    return 0


def add_medusa_tree_parser(trainers: argparse._SubParsersAction) -> None:
    p = trainers.add_parser("medusa-tree", help="build a Medusa tree for a node budget from measured head accuracies",
                            description="Measure each Medusa head's per-rank accuracy on the target's own "
                                        "continuations of held-out prompts and keep the most probable paths.")
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET, metavar="DIR",
                   help="target model directory (default: the bundled %(default)s)")
    p.add_argument("--draft", type=Path, required=True, metavar="HEAD_DIR", help="the Medusa heads")
    p.add_argument("--data", type=Path, required=True, metavar="FILE",
                   help="held-out JSONL records (the formats `specula train` reads)")
    p.add_argument("--nodes", type=positive_int, default=TREE_NODES,
                   help="candidates in the tree, root not counted (default: %(default)s)")
    p.add_argument("--top-k", type=positive_int, default=TREE_TOP_K, help="ranks measured per head")
    p.add_argument("--samples", type=positive_int, default=64, help="records measured (default: %(default)s)")
    p.add_argument("--out", type=Path, metavar="FILE", help=f"where the tree goes (default: HEAD_DIR/{CHOICES_FILE})")
    p.add_argument("--cache-dir", type=Path, metavar="DIR", help="keep the regenerated samples here")
    p.add_argument("--no-regenerate", action="store_true", help="measure on the data's own responses")
    p.add_argument("--gen-max-new-tokens", type=positive_int, default=256, metavar="N")
    p.add_argument("--gen-batch-size", type=positive_int, default=16, metavar="N")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32")
    p.add_argument("--device", type=device_name, default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run_medusa_tree)


def run_medusa_tree(args: argparse.Namespace) -> int:
    if not args.data.is_file():
        raise SpeculaError(f"data file not found: {args.data}")
    if args.cache_dir is not None:
        check_cache_dir(args.cache_dir, "--cache-dir")
    check_replaceable_file(args.out or args.draft / CHOICES_FILE, "--out", "a Medusa tree", is_tree)
    records = read_records(args.data)[: args.samples]
    target = Target.load(args.target, dtype=args.dtype, device=args.device)
    heads = MedusaHeads.from_pretrained(args.draft, dtype=target.dtype, device=target.device).attach(target)
    check_heads_fit(heads, target.config.hidden_size, target.vocab_size)
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731
    samples = prepare_samples(target, records, cache_dir=args.cache_dir, regenerate=not args.no_regenerate,
                              max_new_tokens=args.gen_max_new_tokens, batch_size=args.gen_batch_size,
                              seed=args.seed, log=log)
    samples = [s for s in samples if bool(s.loss_mask.any())]
    if not samples:
        raise SpeculaError(f"no record of {args.data} has a response to measure the heads on")
    out = args.out or args.draft / CHOICES_FILE
    report = write_tree(out, heads, OnlineFeatures(target, samples, FeatureRequest(final_hidden=True)),
                        args.nodes, args.top_k)
    print(json.dumps({**report, "out": str(out)}))
    return 0


def is_tree(path: Path) -> bool:
    """Whether ``path`` holds Medusa tree choices (which `train medusa-tree` replaces), not some other file."""
    try:
        read_choices_file(path)
    except SpeculaError:
        return False
    return True


def add_train_ldlp_parser(trainers: argparse._SubParsersAction) -> None:
    """Register `specula train ldlp` on the `train` subcommand's subparsers."""
    p = trainers.add_parser("ldlp", help="train AdaEAGLE's draft length predictor for an EAGLE head",
                            description="Train an LDLP that predicts, from the last accepted token, how many "
                                        "drafts an EAGLE head will get accepted; it serves --method ada.")
    add_data_arguments(p)
    p.add_argument("--draft", type=Path, required=True, metavar="HEAD_DIR",
                   help="the trained EAGLE head whose acceptance lengths the LDLP learns")
    p.add_argument("--max-draft-length", type=positive_int, default=MAX_DRAFT_LENGTH, metavar="N",
                   help="longest chain labelled and drafted (default: %(default)s)")
    p.add_argument("--intermediate-size", type=positive_int, default=256, metavar="N",
                   help="width of the MLP's hidden layers (default: %(default)s)")
    p.add_argument("--penalty", type=float, default=PENALTY, metavar="LAMBDA",
                   help="L1 loss factor when the prediction is too short, >= 1 (default: %(default)s)")
    p.set_defaults(handler=run_train_ldlp, epochs=8)


def run_train_ldlp(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.penalty) and args.penalty >= 1.0):
        raise SpeculaError(f"--penalty must be a finite number >= 1, got {args.penalty}")
    # Check the head before regenerating data, which can take far longer than a wrong path deserves.
    if not args.draft.is_dir():
        raise SpeculaError(f"EAGLE head directory not found: {args.draft}")
    head = EagleHead.from_pretrained(args.draft)
    target_config = json.loads((check_model_dir(args.target, "target") / "config.json").read_text())
    if target_config.get("hidden_size") not in (None, head.hidden_size):
        raise SpeculaError(f"EAGLE head hidden size {head.hidden_size} does not fit the target's "
                           f"{target_config['hidden_size']}")
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731
    target, train_set, eval_set, config = training_inputs(args, FeatureRequest(final_hidden=True))
    options = LdlpTrainOptions(args.max_draft_length, args.intermediate_size, args.penalty)
    report = train_ldlp(target, head, head_fingerprint(args.draft), train_set, eval_set, args.out, config, options,
                        labels_dir=args.cache_dir or args.out, resume=args.resume, log=log)
    if report:
        print(format_report(report))
    print(f"LDLP written to {args.out}", file=sys.stderr)
    return 0


# Each entry registers one trainer on the `train` subcommand's subparsers.
TRAINERS: list[Callable[[argparse._SubParsersAction], None]] = [add_train_eagle, add_train_eagle3_parser,
                                                                add_train_medusa_parser, add_train_ldlp_parser,
                                                                add_train_data_parser]


def add_train(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a draft head on data the target generates itself")
    trainers = p.add_subparsers(dest="trainer", required=True, metavar="KIND")
    for add in TRAINERS:
        add(trainers)
