"""Training an EAGLE-3 head with training-time test (EAGLE-3 paper, section 3.2).

For a sequence with tokens t_0..t_{T-1}, per slot j and simulated draft step
i = 0..K-1 the head reads (hidden, embed(t_{j+1+i})) and predicts the target's
next-token distribution at position j+1+i. Step 0's hidden is the fused target
feature g_j; step i's is step i-1's output at the same slot, which is what the
head will read when drafting i tokens past j. The loss is
Σᵢ 0.8^i × soft cross-entropy(target distribution restricted to the draft
vocabulary and renormalised, head distribution), over positions that decide a
response token and whose target argmax lies in the draft vocabulary. There is
no feature-regression loss: the head's outputs are free vectors.

The draft vocabulary is the `draft_vocab_size` most frequent tokens of the
training responses (ties by lower id).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specula.drafters.eagle import EAGLE3_BUDGETS, budget_device, check_head_fits
from specula.errors import SpeculaError
from specula.heads.base import TRAINED_ON_WEIGHTS
from specula.heads.eagle3_head import Eagle3Head, default_feature_layers, fused_feature_request
from specula.heads.formats import load_head
from specula.runtime.target import FeatureRequest, Target
from specula.training.chain import chain_acceptance
from specula.training.eagle_trainer import eagle2_tau
from specula.training.loop import TrainConfig, run_training
from specula.training.target_distribution import draft_target_top

STEP_DECAY = 0.8
DEFAULT_STEPS = 7  # the most training-time-test steps a head trains by default (the paper's GPU drafts go deeper)
DRAFT_VOCAB_SIZE = 2048


def default_steps(device: torch.device | str) -> int:
    """Training-time-test steps when none are asked for: as many draft steps as the head takes per cycle in the
    device's default budget (`EAGLE3_BUDGETS`: one on a CPU), at most `DEFAULT_STEPS`.

    A step past the drafts the head will take costs a head pass and trains nothing the budget uses: on the 2-core
    CPU a one-step head trained 6-7x faster than a five-step one (1,449 against 190-245 tokens/s) and drafted its
    first token better after the same epoch (held-out 0-alpha 0.204 against 0.177; docs/defaults.md).
    """
    return min(int(EAGLE3_BUDGETS[budget_device(torch.device(device))]["depth"]), DEFAULT_STEPS)


def choose_draft_vocab(dataset, vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, float]:
    """(sorted target ids [Vd], share of response tokens they cover) from a dataset's response tokens."""
    if not 1 <= draft_vocab_size <= vocab_size:
        raise SpeculaError(f"draft vocabulary size must be in [1, {vocab_size}], got {draft_vocab_size}")
    counts = response_token_counts(dataset, vocab_size)
    # Stable sort of -count keeps lower ids first among equal counts (including never-seen tokens).
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    return torch.sort(order).values, coverage_of(counts, order)


def response_token_counts(dataset, vocab_size: int) -> torch.Tensor:
    """int64 [V]: how often each token id occurs in the dataset's responses (loss_mask positions)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for index in range(len(dataset)):
        item = dataset[index]
        counts += torch.bincount(item["input_ids"][item["loss_mask"].bool()], minlength=vocab_size)
    return counts


def coverage_of(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of the counted response tokens whose id is in ``ids`` [Vd]."""
    return float(counts[ids.cpu()].sum()) / max(int(counts.sum()), 1)


def eagle3_loss(target: Target, steps: int = DEFAULT_STEPS, decay: float = STEP_DECAY):
    """The loss for `run_training`: batch has input_ids, loss_mask, valid, and the head's cached features."""
    embed = target.model.get_input_embeddings()
    lm_head = target.model.get_output_embeddings()
    lm_vocab = int(target.vocab_size)

    def loss_fn(head: Eagle3Head, batch: dict[str, torch.Tensor]):
        core = getattr(head, "module", head)  # unwrapped when data parallel
        ids, valid, response = batch["input_ids"], batch["valid"], batch["loss_mask"].bool()
        length = ids.shape[1]
        dtype = core.fc.weight.dtype
        # Stored features (float16 or bfloat16 on disk) are cast before they are concatenated: under CPU autocast
        # (--mixed-precision bf16) torch.cat refuses float16 inputs.
        features = core.sample_features({k: batch[k].to(dtype) for k in ("layer_inputs", "hidden") if k in batch})
        with torch.no_grad():
            vocab = core.target_vocab_ids()
            if "dist_probs" in batch:  # generated data: the target's own top-k, captured as it wrote (kept sparse)
                *distribution, in_vocab = draft_target_top(batch["dist_ids"], batch["dist_probs"],
                                                           vocab if core.t2d is not None else None, lm_vocab)
            else:
                # Only the draft vocabulary's rows of the LM head: the target's full argmax was kept with the
                # features (target_top), so the 49,152-wide product is never repeated at training time.
                rows = lm_head.weight[vocab] if core.t2d is not None else lm_head.weight
                target_logits = (batch["hidden"].to(rows.dtype) @ rows.T).float()  # [B, T, Vd]
                in_vocab = torch.ones_like(valid) if core.t2d is None else core.t2d[batch["target_top"]]
                distribution = [torch.softmax(target_logits, dim=-1)]  # [B, T, Vd]
            # Position p decides token t_{p+1}: train where that is a response token (or p is the last one).
            decides = response.clone()
            decides[:, :-1] |= response[:, 1:]
            trained = valid & decides & in_vocab
            token_embeds = embed(ids).to(dtype)
        step_embeds, step_masks = [], []
        for i in range(steps):
            shift = 1 + i
            embeds = torch.zeros_like(token_embeds)
            mask = torch.zeros_like(trained)
            if shift < length:
                embeds[:, :-shift] = token_embeds[:, shift:]
                mask[:, :-shift] = trained[:, shift:]
            step_embeds.append(embeds)
            step_masks.append(mask)
        outputs = head(features, step_embeds)
        loss_sum = features.new_zeros((), dtype=torch.float32)
        metrics = {}
        for i, (out, mask) in enumerate(zip(outputs, step_masks, strict=True)):
            if not bool(mask.any()):
                continue
            wanted = [part[:, 1 + i:][mask[:, : length - 1 - i]] for part in distribution]
            cross_entropy, agree = soft_cross_entropy(core, out[mask], *wanted)
            loss_sum = loss_sum + decay ** i * cross_entropy
            metrics[f"acc{i}"] = agree.float().mean()
        return loss_sum, int(step_masks[0].sum()), metrics

    return loss_fn


# Rows of draft logits alive at once in `soft_cross_entropy`: 2,048 x 16,384 float32 logits are 128 MiB.
LOSS_CHUNK_ROWS = 2048


def soft_cross_entropy(head: Eagle3Head, outputs: torch.Tensor, *wanted: torch.Tensor,
                       chunk: int = LOSS_CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ -wanted · log softmax(head.draft_logits(outputs)), whether each row's argmax agrees with wanted's [N]).

    outputs [N, H]; ``wanted`` the target distribution per row, dense (probabilities [N, Vd]) or sparse (draft ids
    [N, k], probabilities [N, k], most probable first). Computed ``chunk`` rows at a time, each chunk's logits
    recomputed in the backward pass (`torch.utils.checkpoint`), so that [N, Vd] logits, log-probabilities and their
    gradients never exist whole: with them whole, a length-grouped batch of eight of the longest captured samples
    (~5,600 trained rows, 5 training-time-test steps, 16,384 draft tokens) was killed at 24 GB; chunked, that step
    peaks at 16.2 GB, and 14.9 GB with sparse targets.
    """
    loss = outputs.new_zeros((), dtype=torch.float32)
    agree = []
    for start in range(0, outputs.shape[0], chunk):
        rows = [part[start:start + chunk] for part in wanted]
        part, top = torch.utils.checkpoint.checkpoint(_chunk_cross_entropy, head, outputs[start:start + chunk], *rows,
                                                      use_reentrant=False)
        loss = loss + part
        agree.append(top)
    return loss, torch.cat(agree)


def _chunk_cross_entropy(head: Eagle3Head, outputs: torch.Tensor, *wanted: torch.Tensor):
    log_probs = torch.log_softmax(head.draft_logits(outputs).float(), dim=-1)
    if len(wanted) == 1:  # dense
        return -(wanted[0] * log_probs).sum(), log_probs.argmax(-1) == wanted[0].argmax(-1)
    ids, probs = wanted
    return -(probs * log_probs.gather(-1, ids)).sum(), log_probs.argmax(-1) == ids[:, 0]


@dataclass(frozen=True)
class Eagle3TrainOptions:
    draft_vocab_size: int | None = None  # None: DRAFT_VOCAB_SIZE, or the init head's own
    feature_layers: tuple[int, ...] | None = None  # None: 2, N//2, N-3, or the init head's own
    steps: int | None = None  # None: default_steps of the target's device
    eval_samples: int = 16
    tau_prompts: int = 4
    init: Path | None = None  # start from this head (its draft vocabulary and fused layers) instead of a fresh one
    layers: int | None = None  # decoder layers of a fresh head; None: one, or the init head's own
    output_from_target: bool = False  # a fresh head's lm_head and norm start as the target's
    chat_samples: list | None = None  # held-out chat answers (`capture.answer_prompts`): chat-n-alpha per epoch


def feature_request(target_config, feature_layers: tuple[int, ...] | None) -> FeatureRequest:
    """What to cache for an EAGLE-3 head: its fused layers and the final hidden (for the target's distribution)."""
    count = target_config.num_hidden_layers
    layers = list(feature_layers or default_feature_layers(count))
    if any(not 0 <= i <= count for i in layers):
        raise SpeculaError(f"feature layers must be in [0, {count}] for a {count}-layer target, got {layers}")
    return FeatureRequest(final_hidden=True, layer_inputs=fused_feature_request(layers, count).layer_inputs)


def check_start_head(head: Eagle3Head, hidden_size: int, vocab_size: int, options: Eagle3TrainOptions) -> None:
    """A head to fine-tune must fit the target, and the options may not ask for another vocabulary or layers."""
    check_head_fits(head, hidden_size, vocab_size)
    if options.feature_layers is not None and list(options.feature_layers) != head.feature_layers:
        raise SpeculaError(f"--feature-layers {','.join(map(str, options.feature_layers))} differs from the --init "
                           f"head's {','.join(map(str, head.feature_layers))}")
    if options.output_from_target:
        raise SpeculaError("--output-from-target starts a fresh head; --init starts from a trained one")
    if options.layers is not None and options.layers != 1 + len(head.layers):
        raise SpeculaError(f"--head-layers {options.layers} differs from the --init head's {1 + len(head.layers)}")
    if options.draft_vocab_size is not None and options.draft_vocab_size != head.draft_vocab_size:
        raise SpeculaError(f"--draft-vocab-size {options.draft_vocab_size} differs from the --init head's "
                           f"{head.draft_vocab_size}")


def train_eagle3(target: Target, train_set, eval_set, out: Path, config: TrainConfig,
                 options: Eagle3TrainOptions = Eagle3TrainOptions(), resume: bool = False, log=print) -> list[dict]:
    """Train an EAGLE-3 head for ``target`` on cached feature samples; writes it to ``out``.

    The head starts fresh, or from ``options.init`` in either layout `specula.heads.formats` reads (fine-tuning on new
    data, e.g. sampled answers for a head trained on greedy ones); such a head keeps its draft vocabulary and
    fused layers.
    """
    torch.manual_seed(config.seed)
    vocab_size = int(target.vocab_size)
    if options.init is not None:
        head = load_head(options.init, target.config.num_hidden_layers, dtype=torch.float32).to(target.device)
        check_start_head(head, target.config.hidden_size, vocab_size, options)
        draft_vocab_size = head.draft_vocab_size
        coverage = coverage_of(response_token_counts(train_set, vocab_size), head.target_vocab_ids())
        log(f"starting from the head in {options.init}")
    else:
        draft_vocab_size = min(options.draft_vocab_size or DRAFT_VOCAB_SIZE, vocab_size)
        draft_vocab, coverage = choose_draft_vocab(train_set, vocab_size, draft_vocab_size)
        head = Eagle3Head.for_target(target.config, None if draft_vocab_size == vocab_size else draft_vocab,
                                     list(options.feature_layers) if options.feature_layers else None,
                                     options.layers or 1)
        head = head.float().to(target.device)
        if options.output_from_target:
            final_norm = getattr(getattr(target.model, "model", None), "norm", None)
            if final_norm is None:
                raise SpeculaError("--output-from-target needs a Llama-style target (model.norm, its final norm)")
            head.start_from_target_output(target.model.get_output_embeddings(), final_norm)
    log(f"draft vocabulary: {draft_vocab_size} of {vocab_size} tokens, covering {coverage:.2%} of response tokens")
    steps = options.steps or default_steps(target.device)
    if options.steps is None:
        log(f"training-time test: {steps} step(s), the draft depth of {target.device.type}'s default budget "
            "(--ttt-steps to change)")

    def evaluate(model: Eagle3Head, epoch: int) -> dict:
        report = {}
        subset = [eval_set[i] for i in range(min(len(eval_set), options.eval_samples))]
        if subset:
            rates = chain_acceptance(model, target, subset)
            report = {f"{n}-alpha": round(rate, 4) for n, rate in enumerate(rates)}
            report["eagle2_tau"] = round(eagle2_tau(model, target, subset[: options.tau_prompts]), 3)
        if options.chat_samples:
            chat = chain_acceptance(model, target, options.chat_samples)
            report.update({f"chat-{n}-alpha": round(rate, 4) for n, rate in enumerate(chat)})
        report["draft_vocab_coverage"] = round(coverage, 4)
        return report

    head.config[TRAINED_ON_WEIGHTS] = target.weights  # saved with every checkpoint

    generated = len(train_set) > 0 and "dist_probs" in train_set[0]  # captured top-k: no hidden needed
    keys = ("input_ids", "loss_mask", "target_top") + (("dist_ids", "dist_probs") if generated else ("hidden",))
    keys += ("hidden",) if generated and head.feature_request().final_hidden else ()
    keys += ("layer_inputs",) if head.feature_request().layer_inputs else ()
    return run_training(head, train_set, eagle3_loss(target, steps), config, out,
                        save_head=lambda model, directory: model.save_pretrained(directory), keys=keys,
                        resume=resume, evaluate=evaluate if len(eval_set) or options.chat_samples else None,
                        log=log, kind="train eagle3")
