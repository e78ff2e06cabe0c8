"""Training an EAGLE head (EAGLE-1 paper, section 4): regress the next feature, match the next token.

For a sequence with target features f_0..f_{T-1} (final post-norm hidden
states) and tokens t_0..t_{T-1}, the head reads (f_i + noise, embed(t_{i+1}))
and predicts f_{i+1}. Loss per position = SmoothL1(pred, f_{i+1}) + 0.1 × the
cross-entropy between the target's next-token distribution softmax(LM(f_{i+1}))
and the head's softmax(LM(pred)), both through the target's frozen LM head,
over response positions only. Input features get U(-0.1, 0.1) noise, as in the
paper, so the head tolerates its own imperfect features at draft time.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specula.drafters.eagle import EagleDrafter, check_head_fits
from specula.errors import SpeculaError
from specula.heads.base import TRAINED_ON_WEIGHTS
from specula.heads.eagle_head import EagleHead
from specula.runtime.linear_gradient import float_weight
from specula.runtime.target import Target
from specula.training.chain import chain_acceptance
from specula.training.evaluation import mean_tau
from specula.training.loop import TrainConfig, run_training, uniform_noise

FEATURE_NOISE = 0.1
TOKEN_LOSS_WEIGHT = 0.1


def differentiable_lm_head(target: Target):
    """The target's LM head as a function of features [.., H] -> float32 logits [.., V] that gradients flow through.

    The module itself, in every format: the logits are what the target as loaded computes (a float module's own
    row-invariant float32 kernel included, so a batch split across processes gives the same logits), and a
    quantized one (q4_1, int4: the format data was captured in) passes gradients back through the weight it
    applies (`specula.runtime.linear_gradient`).
    """
    lm_head = target.model.get_output_embeddings()
    weight = float_weight(lm_head)  # a float module computes in its weight's dtype; a quantized one casts itself
    dtype = torch.float32 if weight is None else weight.dtype
    return lambda features: lm_head(features.to(dtype)).float()


def eagle_loss(target: Target, noise: float = FEATURE_NOISE):
    """The loss function for `run_training`: batch has input_ids, loss_mask, hidden, valid, noise_seed."""
    embed = target.model.get_input_embeddings()
    lm_head = differentiable_lm_head(target)

    def loss_fn(head: EagleHead, batch: dict[str, torch.Tensor]):
        features = batch["hidden"].float()
        ids, valid, response = batch["input_ids"], batch["valid"], batch["loss_mask"]
        inputs = features[:, :-1] + uniform_noise(batch, features.shape[-1], noise)[:, :-1]
        with torch.no_grad():
            token_embeds = embed(ids[:, 1:]).float()
        dtype = next(head.parameters()).dtype  # head may be wrapped for data parallelism
        predicted = head(inputs.to(dtype), token_embeds.to(dtype)).float()
        # Position i predicts f_{i+1}, which decides token t_{i+2}: train where that token is a response token.
        decides_response = torch.zeros_like(response[:, 1:])
        decides_response[:, :-1] = response[:, 2:]
        mask = valid[:, 1:] & (response[:, 1:] | decides_response)
        # Only trained positions go through the (large) LM head.
        predicted, wanted = predicted[mask], features[:, 1:][mask]
        with torch.no_grad():
            target_probs = torch.softmax(lm_head(wanted), dim=-1)
        feature_loss = F.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1)
        head_log_probs = torch.log_softmax(lm_head(predicted), dim=-1)
        token_loss = -(target_probs * head_log_probs).sum(-1)
        count = max(int(mask.sum()), 1)
        loss_sum = (feature_loss + TOKEN_LOSS_WEIGHT * token_loss).sum()
        with torch.no_grad():
            metrics = {
                "feature_loss": feature_loss.sum() / count,
                "token_loss": token_loss.sum() / count,
                "top1": (head_log_probs.argmax(-1) == target_probs.argmax(-1)).float().sum() / count,
            }
        return loss_sum, int(mask.sum()), metrics

    return loss_fn


def eagle2_tau(head: EagleHead, target: Target, samples, max_new_tokens: int = 48) -> float:
    """Mean tokens per cycle of greedy `eagle2` decoding from the prompts of held-out samples."""
    return mean_tau(target, EagleDrafter(target, copy.deepcopy(head).eval(), dynamic=True), samples, max_new_tokens)


@dataclass(frozen=True)
class EagleTrainOptions:
    num_layers: int | None = None  # None: 1, or the init head's own
    eval_samples: int = 16  # held-out samples for the n-alpha rates
    tau_prompts: int = 4  # of those, prompts decoded with eagle2 for tau
    init: Path | None = None  # start from this head instead of a fresh one


def check_start_eagle_head(head: EagleHead, hidden_size: int, vocab_size: int, options: EagleTrainOptions) -> None:
    """A head to fine-tune must fit the target, and the options may not ask for another number of layers."""
    check_head_fits(head, hidden_size, vocab_size)
    if options.num_layers is not None and options.num_layers != len(head.layers):
        raise SpeculaError(f"--num-layers {options.num_layers} differs from the --init head's {len(head.layers)}")


def train_eagle(target: Target, train_set, eval_set, out: Path, config: TrainConfig,
                options: EagleTrainOptions = EagleTrainOptions(), resume: bool = False,
                log=print) -> list[dict]:
    """Train an EAGLE head for ``target`` on cached feature samples; writes it to ``out``.

    The head starts fresh or from ``options.init`` (fine-tuning; built straight in float32, so its rotary
    frequencies are exact).
    """
    torch.manual_seed(config.seed)
    if options.init is not None:
        head = EagleHead.from_pretrained(options.init, dtype=torch.float32, device=target.device)
        check_start_eagle_head(head, target.config.hidden_size, target.vocab_size, options)
        log(f"starting from the head in {options.init}")
    else:
        head = EagleHead.for_target(target.config, num_layers=options.num_layers or 1).float().to(target.device)

    head.config[TRAINED_ON_WEIGHTS] = target.weights  # saved with every checkpoint

    def evaluate(model: EagleHead, epoch: int) -> dict:
        subset = [eval_set[i] for i in range(min(len(eval_set), options.eval_samples))]
        rates = chain_acceptance(model, target, subset)
        report = {f"{n}-alpha": round(rate, 4) for n, rate in enumerate(rates)}
        report["eagle2_tau"] = round(eagle2_tau(model, target, subset[: options.tau_prompts]), 3)
        return report

    return run_training(head, train_set, eagle_loss(target), config, out,
                        save_head=lambda model, directory: model.save_pretrained(directory),
                        keys=("input_ids", "loss_mask", "hidden"), resume=resume,
                        evaluate=evaluate if len(eval_set) else None, log=log, kind="train eagle")
