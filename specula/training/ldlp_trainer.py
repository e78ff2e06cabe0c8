"""Training AdaEAGLE's draft length predictor (LDLP) for a target and its EAGLE head.

Data: at every response position s of self-distilled samples, the input is the
target's embedding of t_s and its final hidden state f_s; the label is how many
drafts a greedy EAGLE chain of at most ``max_draft_length`` gets accepted after
the next root (`specula.training.ldlp_data`).

Loss (AdaEAGLE): L1 with a penalty factor λ > 1 on under-prediction,

    ℓ(p, y) = λ·(y − p) if p < y else (p − y),

because drafting too few tokens forfeits accepted tokens (a whole extra target
forward), while drafting too many costs only cheap head steps. The seed summary of
the paper does not state its λ; the default here is 2 (``--penalty``).

Evaluation (each epoch and at the end, held-out samples): the predictor's error
against the labels, and a paper-style comparison with fixed draft lengths 1..max:
greedy chain decoding of each held-out continuation is replayed from the exact
per-position acceptance lengths (a cycle after position s with d drafts accepts
a = min(label_s, d) and moves to s + a + 1), giving tokens per cycle τ, drafts per
cycle and accepted/drafted for the LDLP, every fixed length and an oracle that
drafts exactly what will be accepted. Written to ``evaluation.json`` next to the
weights; everything else (batching, Accelerate, checkpoints, exact resume) is
`specula.training.loop.run_training`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_json, prepare_output_dir
from specula.heads.eagle_head import EagleHead
from specula.heads.ldlp import LengthPredictor
from specula.runtime.target import Target
from specula.training.ldlp_data import LabelledFeatures, label_features
from specula.training.loop import TrainConfig, run_training

PENALTY = 2.0
MAX_DRAFT_LENGTH = 8
KEYS = ("input_ids", "loss_mask", "hidden", "length_label", "censored")


def ldlp_loss(target: Target, penalty: float = PENALTY):
    """The loss function for `run_training`: batch has input_ids, hidden, length_label, censored, valid."""
    embed = target.model.get_input_embeddings()

    def loss_fn(model: LengthPredictor, batch: dict[str, torch.Tensor]):
        mask = batch["valid"] & (batch["length_label"] >= 0) & ~batch["censored"]
        with torch.no_grad():
            token_embeds = embed(batch["input_ids"][mask]).float()
        predicted = model(token_embeds, batch["hidden"][mask].float()).float()
        wanted = batch["length_label"][mask].float()
        short = wanted - predicted  # > 0: predicted too few drafts
        loss = torch.where(short > 0, penalty * short, -short)
        count = int(mask.sum())
        with torch.no_grad():
            scale = 1.0 / max(count, 1)
            metrics = {"mae": short.abs().sum() * scale, "under": (short > 0).float().sum() * scale}
        return loss.sum(), count, metrics

    return loss_fn


@torch.no_grad()
def predictions(model: LengthPredictor, target: Target, item: dict[str, torch.Tensor]) -> torch.Tensor:
    """Raw predicted lengths [T] (float) at every position of one labelled item."""
    param = model.layers[0].weight
    embeds = target.model.get_input_embeddings()(item["input_ids"].to(target.device))
    return model(embeds.to(param.device), item["hidden"].to(param.device)).float().cpu()


def replay(labels: torch.Tensor, response: torch.Tensor, policy) -> tuple[int, int, int]:
    """(cycles, drafted, accepted) of greedy chain decoding of one sample, ``policy(s)`` drafts after s.

    Decoding starts after the prompt: the prefill emits the first response token, so the first
    cycle's last accepted token is the prompt's last one.
    """
    first = int(response.long().argmax())
    s, cycles, drafted, accepted = first - 1, 0, 0, 0
    while 0 <= s < len(labels) and labels[s] >= 0:
        d = policy(s)
        a = min(int(labels[s]), d)
        cycles, drafted, accepted, s = cycles + 1, drafted + d, accepted + a, s + a + 1
    return cycles, drafted, accepted


@torch.no_grad()
def compare_lengths(model: LengthPredictor, target: Target, held_out: LabelledFeatures) -> dict:
    """The LDLP against fixed draft lengths on held-out samples (see the module docstring)."""
    model = model.eval()
    top = model.max_draft_length
    names = ["ldlp", *(f"fixed-{k}" for k in range(1, top + 1)), "oracle"]
    totals = {name: [0, 0, 0] for name in names}  # cycles, drafted, accepted
    errors, biases, under, exact, positions = 0.0, 0.0, 0, 0, 0
    for index in range(len(held_out)):
        item = held_out[index]
        labels, censored = item["length_label"], item["censored"]
        raw = predictions(model, target, item)
        rounded = raw.round().clamp(1, top).long()
        trained = (labels >= 0) & ~censored
        diff = raw[trained] - labels[trained].float()
        errors += float(diff.abs().sum())
        biases += float(diff.sum())
        under += int((diff < 0).sum())
        exact += int((rounded[trained] == labels[trained].clamp(min=1)).sum())
        positions += int(trained.sum())
        # A policy maps the last accepted position s to the number of drafts after it.
        policies = {"ldlp": lambda s, r=rounded: int(r[s]), "oracle": lambda s, y=labels: max(1, int(y[s])),
                    **{f"fixed-{k}": lambda s, k=k: k for k in range(1, top + 1)}}
        for name, policy in policies.items():
            for column, value in enumerate(replay(labels, item["loss_mask"].bool(), policy)):
                totals[name][column] += value
    report = {"positions": positions, "samples": len(held_out), "max_draft_length": top,
              "mean_abs_error": round(errors / max(positions, 1), 4),
              "mean_error": round(biases / max(positions, 1), 4),
              "under_predicted": round(under / max(positions, 1), 4),
              "rounded_exact": round(exact / max(positions, 1), 4), "policies": {}}
    for name, (cycles, drafted, accepted) in totals.items():
        cycles = max(cycles, 1)
        report["policies"][name] = {"tau": round((accepted + cycles) / cycles, 4),
                                    "drafted_per_cycle": round(drafted / cycles, 4),
                                    "accepted_per_cycle": round(accepted / cycles, 4),
                                    "accepted_per_drafted": round(accepted / max(drafted, 1), 4)}
    return report


def format_report(report: dict) -> str:
    """The comparison as a small text table."""
    lines = [f"held-out: {report['samples']} samples, {report['positions']} positions; LDLP mean |error| "
             f"{report['mean_abs_error']}, mean error {report['mean_error']}, under-predicted "
             f"{report['under_predicted']:.1%}, rounded exact {report['rounded_exact']:.1%}",
             f"{'policy':<10} {'tau':>6} {'drafted/cycle':>14} {'accepted/cycle':>15} {'accepted/drafted':>17}"]
    for name, row in report["policies"].items():
        lines.append(f"{name:<10} {row['tau']:>6.3f} {row['drafted_per_cycle']:>14.3f} "
                     f"{row['accepted_per_cycle']:>15.3f} {row['accepted_per_drafted']:>17.3f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class LdlpTrainOptions:
    max_draft_length: int = MAX_DRAFT_LENGTH
    intermediate_size: int = 256
    penalty: float = PENALTY

    def __post_init__(self) -> None:
        if not (isinstance(self.penalty, (int, float)) and math.isfinite(self.penalty) and self.penalty >= 1.0):
            raise SpeculaError(f"the under-prediction penalty (--penalty) must be a finite number >= 1, "
                               f"got {self.penalty!r}")


def train_ldlp(target: Target, head: EagleHead, head_key: str, train_set, eval_set, out: Path, config: TrainConfig,
               options: LdlpTrainOptions = LdlpTrainOptions(), labels_dir: Path | None = None,
               resume: bool = False, log=print) -> dict:
    """Label the feature sets with ``head``'s chain acceptance, train a fresh LDLP, write it and its evaluation.

    ``head_key`` is the head's fingerprint (`head_fingerprint`), stored in the LDLP's config.
    Returns the held-out comparison (also in ``out/evaluation.json``; empty without held-out samples).
    """
    if options.penalty < 1.0:
        raise SpeculaError(f"the under-prediction penalty must be >= 1, got {options.penalty}")
    if head.hidden_size != target.config.hidden_size:
        raise SpeculaError(f"EAGLE head hidden size {head.hidden_size} does not fit the target's "
                           f"{target.config.hidden_size}")
    prepare_output_dir(out, "train ldlp", resume)  # the labels may go there before training starts
    head = head.to(device=target.device, dtype=target.dtype).eval()
    train = label_features(head, target, train_set, options.max_draft_length, labels_dir, head_key,
                           "label train", log)
    held_out = label_features(head, target, eval_set, options.max_draft_length, labels_dir, head_key,
                              "label held-out", log)
    torch.manual_seed(config.seed)
    predictor = LengthPredictor.for_target(target.config, options.max_draft_length, options.intermediate_size,
                                           head_key, options.penalty).float().to(target.device)

    def evaluate(model: LengthPredictor, epoch: int) -> dict:
        report = compare_lengths(model, target, held_out)
        best = max((r for n, r in report["policies"].items() if n.startswith("fixed")), key=lambda r: r["tau"])
        return {"mean_abs_error": report["mean_abs_error"], "under_predicted": report["under_predicted"],
                "ldlp_tau": report["policies"]["ldlp"]["tau"],
                "ldlp_drafted_per_cycle": report["policies"]["ldlp"]["drafted_per_cycle"],
                "best_fixed_tau": best["tau"]}

    run_training(predictor, train, ldlp_loss(target, options.penalty), config, out,
                 save_head=lambda model, directory: model.save_pretrained(directory), keys=KEYS, resume=resume,
                 evaluate=evaluate if len(held_out) else None, log=log,
                 kind="train ldlp")
    if not len(held_out):
        return {}
    trained = LengthPredictor.from_pretrained(out, dtype=torch.float32, device=target.device)
    report = compare_lengths(trained, target, held_out)
    atomic_write_json(out / "evaluation.json", report)
    return report
