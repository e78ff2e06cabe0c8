"""Training Medusa heads (Medusa-1: the target stays frozen, only the heads learn) and sizing their tree.

Loss. For a sample with tokens t_0..t_{T-1} and the target's final post-norm
hidden states h_0..h_{T-1}, head k (k = 1..K) reads h_i and predicts t_{i+k+1}:

    L = Σ_k λ_k · CE(head_k(h_i), t_{i+k+1}),   λ_k = decay^(k-1), decay = 0.8 (Medusa's 0.8^k)

over the positions whose predicted token is a response token. The sum of every
head's cross-entropies is divided by the number of positions of head 1 (deeper
heads have at most k - 1 fewer per sample), so the loop's per-token
normalisation applies. On self-distilled data t_{i+k+1} is the target's own
choice, so the hard labels are what the heads must guess at decoding time.

Initialisation (Medusa's): every head's vocabulary projection starts as a copy
of the target's LM head and every residual block as the identity, so each head
starts out predicting the target's next token; the projection is trained (it is
the head's own copy, the target's stays frozen). With ``shared_lm_head`` there is
no copy: every head projects through the target's frozen LM head and only the
blocks learn (the files then hold the blocks alone). Everything else — batching,
Accelerate, checkpoints, exact resume — is `specula.training.loop.run_training`.

Evaluation (each epoch, held-out samples): each head's top-1 and top-5 accuracy
and the τ of greedy `medusa` decoding with the default tree. At the end the
held-out per-rank accuracies size a tree for the node budget (`build_choices`),
written beside the heads as `medusa_choices.json`, which `medusa` then uses;
`specula train medusa-tree` rebuilds it for another budget or other data.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specula.drafters.medusa import CHOICES_FILE, DEFAULT_CHOICES, MedusaDrafter, check_heads_fit
from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_json
from specula.heads.medusa_head import MedusaHeads
from specula.runtime.target import Target
from specula.training.evaluation import mean_tau
from specula.training.loop import TrainConfig, run_training
from specula.training.medusa_tree import build_choices, expected_accepted

DECAY = 0.8
TREE_NODES = 15  # candidates of the built tree (the root not counted), the size of DEFAULT_CHOICES
TREE_TOP_K = 10  # ranks measured per head


def head_targets(ids: torch.Tensor, valid: torch.Tensor, response: torch.Tensor, num_heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, tokens), both [K, B, T]: whether head k + 1 trains at position i, and the token t_{i+k+2} it predicts."""
    batch, length = ids.shape
    mask = torch.zeros(num_heads, batch, length, dtype=torch.bool, device=ids.device)
    tokens = torch.zeros(num_heads, batch, length, dtype=ids.dtype, device=ids.device)
    for k in range(num_heads):
        offset = k + 2
        if length > offset:
            mask[k, :, :-offset] = valid[:, offset:] & response[:, offset:]
            tokens[k, :, :-offset] = ids[:, offset:]
    return mask, tokens


def medusa_loss(num_heads: int, decay: float = DECAY):
    """The loss function for `run_training`: batch has input_ids, loss_mask, hidden, valid."""
    weights = [decay ** k for k in range(num_heads)]

    def loss_fn(heads: MedusaHeads, batch: dict[str, torch.Tensor]):
        mask, tokens = head_targets(batch["input_ids"], batch["valid"], batch["loss_mask"].bool(), num_heads)
        trained = mask.any(0)  # positions where at least one head has a target: only they go through the heads
        dtype = next(heads.parameters()).dtype  # heads may be wrapped for data parallelism
        logits = heads(batch["hidden"][trained].to(dtype)).float()  # [K, N, V]
        loss_sum = logits.new_zeros(())
        metrics = {}
        for k in range(num_heads):
            rows = mask[k][trained]
            wanted = tokens[k][trained][rows]
            loss_sum = loss_sum + weights[k] * F.cross_entropy(logits[k][rows], wanted, reduction="sum")
            with torch.no_grad():
                hits = (logits[k][rows].argmax(-1) == wanted).float()
                metrics[f"top1_head{k + 1}"] = hits.mean() if hits.numel() else hits.new_zeros(())
        return loss_sum, int(mask[0].sum()), metrics

    return loss_fn


@torch.no_grad()
def rank_accuracy(heads: MedusaHeads, samples, top_k: int = TREE_TOP_K) -> torch.Tensor:
    """[K, top_k] float64: the fraction of response positions where head k + 1's rank-r token is the right one.

    Samples are dicts with input_ids [T], loss_mask [T] and the target's hidden [T, H]; on the
    target's own greedy continuations the right token is the one the target decodes.
    """
    heads = heads.eval()
    param = next(heads.parameters())
    top_k = min(top_k, heads.vocab_size)
    hits = torch.zeros(heads.num_heads, top_k, dtype=torch.float64)
    tried = torch.zeros(heads.num_heads, dtype=torch.float64)
    for sample in samples:
        ids, response = sample["input_ids"].to(param.device), sample["loss_mask"].bool().to(param.device)
        valid = torch.ones_like(response)
        mask, tokens = head_targets(ids[None], valid[None], response[None], heads.num_heads)
        ranked = torch.topk(heads(sample["hidden"].to(param.device, param.dtype)), top_k, dim=-1).indices
        for k in range(heads.num_heads):
            rows = mask[k, 0]
            hits[k] += (ranked[k][rows] == tokens[k, 0][rows][:, None]).sum(0).double().cpu()
            tried[k] += int(rows.sum())
    return hits / tried.clamp(min=1.0)[:, None]


def medusa_tau(heads: MedusaHeads, target: Target, samples, choices=None, max_new_tokens: int = 48) -> float:
    """Mean tokens per cycle of greedy `medusa` decoding from the prompts of held-out samples."""
    return mean_tau(target, MedusaDrafter(target, copy.deepcopy(heads).eval(), choices), samples, max_new_tokens)


def write_tree(path: Path, heads: MedusaHeads, samples, nodes: int = TREE_NODES, top_k: int = TREE_TOP_K) -> dict:
    """Measure rank accuracies on ``samples``, build the ``nodes``-candidate tree and write it as JSON."""
    accuracy = rank_accuracy(heads, samples, top_k)
    choices = build_choices(accuracy, nodes)
    report = {"choices": choices, "nodes": len(choices),
              "expected_accepted": round(expected_accepted(choices, accuracy), 4),
              "accuracy": [[round(a, 4) for a in row] for row in accuracy.tolist()],
              "measured_on_samples": len(samples)}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, report)
    return report


@dataclass(frozen=True)
class MedusaTrainOptions:
    num_heads: int | None = None  # None: 4, or the init heads' own
    num_layers: int | None = None  # residual blocks per head; None: 1, or the init heads' own
    decay: float = DECAY
    eval_samples: int = 16  # held-out samples for the per-epoch accuracies
    tau_prompts: int = 4  # of those, prompts decoded with medusa for tau
    tree_nodes: int = TREE_NODES
    tree_top_k: int = TREE_TOP_K
    base_model_name_or_path: str = ""  # recorded in config.json (default: the target's directory name)
    shared_lm_head: bool = False  # heads read tokens through the target's frozen LM head (blocks only are trained)
    init: Path | None = None  # start from these heads instead of fresh ones


def check_start_heads(heads: MedusaHeads, hidden_size: int, vocab_size: int, options: MedusaTrainOptions) -> None:
    """Heads to fine-tune must fit the target, and the options may not ask for another shape or layout."""
    check_heads_fit(heads, hidden_size, vocab_size)
    for flag, asked, own in (("--num-heads", options.num_heads, heads.num_heads),
                             ("--num-layers", options.num_layers, heads.num_layers)):
        if asked is not None and asked != own:
            raise SpeculaError(f"{flag} {asked} differs from the --init heads' {own}")
    if options.shared_lm_head and not heads.shared_lm_head:
        raise SpeculaError("--shared-lm-head asks for heads that share the target's LM head; the --init heads "
                           "have their own")


def start_heads(target: Target, options: MedusaTrainOptions) -> MedusaHeads:
    """Fresh heads initialised as Medusa does, or ``options.init``'s (float32, checked against the target)."""
    if options.init is None:
        num_layers = 1 if options.num_layers is None else options.num_layers
        heads = MedusaHeads.for_target(target, options.num_heads or 4, num_layers, options.base_model_name_or_path,
                                       options.shared_lm_head)
        return heads.float().to(target.device)
    heads = MedusaHeads.from_pretrained(options.init, dtype=torch.float32, device=target.device)
    check_start_heads(heads, target.config.hidden_size, target.vocab_size, options)
    return heads.attach(target)


def train_medusa(target: Target, train_set, eval_set, out: Path, config: TrainConfig,
                 options: MedusaTrainOptions = MedusaTrainOptions(), resume: bool = False, log=print) -> list[dict]:
    """Train Medusa heads for ``target`` on cached feature samples; writes them (and their tree) to ``out``.

    The heads start fresh or from ``options.init`` (fine-tuning; its head count, blocks and LM-head layout kept).
    """
    if (options.num_heads is not None and options.num_heads < 1) or (options.num_layers or 0) < 0:
        raise SpeculaError("Medusa training needs at least one head and zero or more blocks per head")
    if not 0.0 < options.decay <= 1.0:
        raise SpeculaError(f"the Medusa loss decay must be in (0, 1], got {options.decay}")
    torch.manual_seed(config.seed)
    heads = start_heads(target, options)
    if options.init is not None:
        log(f"starting from the heads in {options.init}")
    default_tree = [p for p in DEFAULT_CHOICES if len(p) <= heads.num_heads]

    def held_out() -> list:
        return [eval_set[i] for i in range(min(len(eval_set), options.eval_samples))]

    def evaluate(model: MedusaHeads, epoch: int) -> dict:
        subset = held_out()
        accuracy = rank_accuracy(model, subset, top_k=5)
        report = {}
        for k, row in enumerate(accuracy.tolist()):
            report[f"head{k + 1}_top1"] = round(row[0], 4)
            report[f"head{k + 1}_top5"] = round(sum(row), 4)
        report["medusa_tau"] = round(medusa_tau(model, target, subset[: options.tau_prompts], default_tree), 3)
        return report

    history = run_training(heads, train_set, medusa_loss(heads.num_heads, options.decay), config, out,
                           save_head=lambda model, directory: model.save_pretrained(directory),
                           keys=("input_ids", "loss_mask", "hidden"), resume=resume,
                           evaluate=evaluate if len(eval_set) else None, log=log, kind="train medusa")
    if len(eval_set) and int(os.environ.get("RANK", "0")) == 0:  # one process writes the tree
        report = write_tree(out / CHOICES_FILE, heads, held_out(), options.tree_nodes, options.tree_top_k)
        log(f"tree of {report['nodes']} candidates, {report['expected_accepted']} expected accepted drafts per "
            f"cycle, written to {out / CHOICES_FILE}")
    return history
