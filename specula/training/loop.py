"""What every head trainer shares: batching cached samples, the optimiser schedule, checkpoints and resume.

A trainer supplies the head and a loss function; this module runs the epochs
under Hugging Face Accelerate (one process, or data parallel when started by
`torchrun` / `accelerate launch`), shows progress, writes checkpoints
atomically every `save_every` steps and resumes from the last one so that an
interrupted run ends with the same weights as an uninterrupted one.

Resume is exact because everything random is derived from (seed, epoch, step):
the sample order of an epoch is a seeded permutation (with ``group_by_length``,
batches of samples of similar length, in a seeded order: `epoch_order`), and the
noise of a sample is seeded from (seed, step, its place in the global batch).

Garbage is refused: settings that are not finite (or a clipping threshold <= 0)
are rejected when the `TrainConfig` is made, and a step whose loss, gradient or
updated weights are not finite stops training with a SpeculaError before
anything of it is saved, so the last checkpoint on disk is always a good one.
Ctrl-C says which checkpoint was kept and how to continue, then propagates.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from specula.errors import SpeculaError
from specula.files.outputs import atomic_replace_dir, atomic_write_json, prepare_output_dir
from specula.files.readers import load_torch

MIXED_PRECISION = ("auto", "no", "bf16", "fp16")


@dataclass
class TrainConfig:
    epochs: int = 4
    batch_size: int = 8  # sequences per optimiser step, over all processes
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    grad_clip: float = 0.5
    save_every: int = 200
    seed: int = 0
    mixed_precision: str = "auto"  # auto: `automatic_precision`
    group_by_length: bool = True  # batches of samples of similar length (`epoch_order`)

    def __post_init__(self) -> None:
        """Refuse settings that can only train garbage (NaN weights, gradient ascent) before any work starts."""
        for name in ("epochs", "batch_size", "save_every"):
            _whole(name, getattr(self, name), 1)
        _whole("warmup_steps", self.warmup_steps, 0)
        _whole("seed", self.seed, None)
        _finite_setting("lr", self.lr, "> 0", lambda v: v > 0)
        # A clipping threshold <= 0 would reverse (ascend) or zero every gradient.
        _finite_setting("grad_clip", self.grad_clip, "> 0", lambda v: v > 0)
        _finite_setting("weight_decay", self.weight_decay, ">= 0", lambda v: v >= 0)
        if not isinstance(self.group_by_length, bool):
            raise SpeculaError(f"group_by_length must be True or False, got {self.group_by_length!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise SpeculaError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}, "
                               f"got {self.mixed_precision!r}")


def automatic_precision() -> str:
    """What ``mixed_precision="auto"`` trains in: bf16 autocast where the hardware multiplies bf16 natively (CUDA;
    CPUs with AVX512-BF16 or AMX), else none (elsewhere a CPU emulates bf16 matmuls).

    Measured on an AMD EPYC with AVX512-BF16 (EAGLE-3 head from scratch, 16,384-token draft vocabulary, 5
    training-time-test steps, batch 8, 1 thread, 5 steps): 66 tokens/s in float32, 100 in bf16, the loss after
    5 steps 26.3188 and 26.3195.
    """
    if torch.cuda.is_available():
        return "bf16"
    native = [getattr(torch.cpu, probe, None) for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return "bf16" if any(probe is not None and probe() for probe in native) else "no"


def _whole(name: str, value, least: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least):
        bound = f" >= {least}" if least is not None else ""
        raise SpeculaError(f"training setting {name} (--{name.replace('_', '-')}) must be a whole number{bound}, "
                           f"got {value!r}")


def _finite_setting(name: str, value, bound: str, ok: Callable[[float], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise SpeculaError(f"training setting {name} (--{name.replace('_', '-')}) must be a finite number {bound}, "
                           f"got {value!r}")


class TrainingDiverged(SpeculaError):
    """A step produced a non-finite loss, gradient or weights; nothing of it was saved."""


def pad_batch(samples: list[dict], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Right-pad the per-sample tensors named ``keys`` to the longest sample; adds ``valid`` [B, T]."""
    length = max(s["input_ids"].shape[0] for s in samples)
    batch: dict[str, torch.Tensor] = {}
    for key in keys:
        first = samples[0][key]
        padded = first.new_zeros((len(samples), length, *first.shape[1:]))
        for row, sample in enumerate(samples):
            padded[row, : sample[key].shape[0]] = sample[key]
        batch[key] = padded
    batch["valid"] = torch.zeros(len(samples), length, dtype=torch.bool)
    for row, sample in enumerate(samples):
        batch["valid"][row, : sample["input_ids"].shape[0]] = True
    return batch


# Samples sorted by length together, within windows of this many batches: enough that a batch's lengths are
# close, few enough that batches are made of other samples every epoch. On 840 captured SmolLM2 samples (24-2,040
# tokens, batch 8) the padded tokens were 52 % real in random batches; 87 / 92 / 95 / 98 % with windows of 8 / 16
# / 32 / 64 batches (with one window for the whole set, every epoch would repeat the same batches).
LENGTH_WINDOW_BATCHES = 16


def epoch_order(size: int, seed: int, epoch: int, lengths: list[int] | None = None,
                batch_size: int = 1) -> list[int]:
    """The order of an epoch's ``size`` samples: a seeded permutation, each sample once.

    With ``lengths`` (tokens per sample) the permutation is cut into windows of `LENGTH_WINDOW_BATCHES` batches,
    each window sorted by length, and the whole batches are shuffled (the last, partial one stays last): a batch
    pads its samples to its longest, and random batches of generated data were half padding."""
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(size, generator=generator).tolist()
    if lengths is None or batch_size <= 1:
        return order
    window = batch_size * LENGTH_WINDOW_BATCHES
    grouped = [i for start in range(0, size, window)
               for i in sorted(order[start:start + window], key=lambda i: -lengths[i])]
    whole = size // batch_size
    batches = torch.randperm(whole, generator=generator).tolist()
    return [i for b in batches for i in grouped[b * batch_size:(b + 1) * batch_size]] + grouped[whole * batch_size:]


def sample_lengths(dataset) -> list[int] | None:
    """Tokens of each sample where the dataset can tell without reading its features (a ``lengths()`` method),
    else None."""
    lengths = getattr(dataset, "lengths", None)
    return None if lengths is None else lengths()


def uniform_noise(batch: dict[str, torch.Tensor], width: int, scale: float) -> torch.Tensor:
    """U(-scale, scale) noise [B, T, width], drawn per sample from its own seed.

    Seeding by sample (``batch["noise_seed"]``) keeps the noise of a sample the same however the
    global batch is split over processes and whenever a run is resumed.
    """
    rows, length = batch["valid"].shape
    noise = torch.zeros(rows, length, width, device=batch["valid"].device)
    for row in range(rows):
        generator = torch.Generator().manual_seed(int(batch["noise_seed"][row]))
        count = int(batch["valid"][row].sum())
        noise[row, :count] = ((torch.rand(count, width, generator=generator) * 2 - 1) * scale).to(noise.device)
    return noise


class Checkpointer:
    """`out/checkpoint/` holds the head (in its release layout) and the trainer state, replaced atomically."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out / "checkpoint"

    def save(self, head: nn.Module, state: dict, save_head: Callable[[nn.Module, Path], None]) -> None:
        def fill(staging: Path) -> None:
            save_head(head, staging)
            torch.save(state, staging / "trainer_state.pt")

        atomic_replace_dir(self.path, fill)

    def load_state(self) -> dict | None:
        file = self.path / "trainer_state.pt"
        if not file.is_file():
            # Interrupted between the two renames of `atomic_replace_dir`: the previous checkpoint is whole there.
            file = self.path.with_name(f".{self.path.name}.old") / "trainer_state.pt"
            if not file.is_file():
                return None
        hint = "; delete that checkpoint directory to start over, or use another --out"
        try:
            state = load_torch(file, "training checkpoint")
        except SpeculaError as err:
            raise SpeculaError(f"{err}{hint}") from err
        wanted = {"step", "config", "history", "head", "optimizer", "scheduler"}
        if not isinstance(state, dict) or not wanted <= set(state) or not isinstance(state["step"], int):
            raise SpeculaError(f"training checkpoint {file} is not a specula trainer state{hint}")
        return state


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def run_training(head: nn.Module, dataset, loss_fn: Callable, config: TrainConfig, out: Path,
                 save_head: Callable[[nn.Module, Path], None], keys: tuple[str, ...], resume: bool = False,
                 evaluate: Callable[[nn.Module, int], dict] | None = None, log: Callable[[str], None] = print,
                 kind: str = "train",
                 ) -> list[dict]:
    """Train ``head`` on ``dataset`` (items: dicts of per-token tensors named ``keys``).

    loss_fn(head, batch) -> (loss_sum, token_count, metrics): a sum over the batch's
    loss tokens, so that the loop can normalise by the token count of the whole global batch.
    ``kind`` names the command in the output directory's marker (`specula.files.outputs`).
    Returns the history of logged records (one per step, plus evaluations).
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from tqdm.auto import tqdm

    mixed = automatic_precision() if config.mixed_precision == "auto" else config.mixed_precision
    # Accelerate keeps one precision per process and refuses another one later (a Python caller training twice,
    # the test suite): its precision state is cleared first; the processes and devices (PartialState) are kept.
    AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=mixed, cpu=not torch.cuda.is_available())
    world, rank = accelerator.num_processes, accelerator.process_index
    if config.batch_size % world:
        raise SpeculaError(f"batch size {config.batch_size} must be a multiple of the {world} processes")
    per_process = config.batch_size // world
    steps_per_epoch = len(dataset) // config.batch_size
    lengths = sample_lengths(dataset) if config.group_by_length else None
    if steps_per_epoch == 0:
        raise SpeculaError(f"{len(dataset)} training samples are fewer than one batch of {config.batch_size}")
    total_steps = steps_per_epoch * config.epochs
    if accelerator.is_main_process:
        prepare_output_dir(out, kind, resume)

    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config.warmup_steps, total_steps))
    checkpointer = Checkpointer(out)
    history: list[dict] = []
    step = 0
    if resume:
        state = checkpointer.load_state()
        if state is None:
            log(f"no checkpoint in {checkpointer.path}; starting from scratch")
        else:
            # Checkpoints written before length grouping existed trained in plain random order.
            if {"group_by_length": False, **state["config"]} != asdict(config):
                raise SpeculaError("the checkpoint was written with other training settings; "
                                   "resume with the same settings or start a new --out")
            try:
                head.load_state_dict(state["head"])
            except RuntimeError as err:
                raise SpeculaError(f"the checkpoint in {checkpointer.path} holds a head of another shape "
                                   f"({str(err).splitlines()[-1].strip()}); start a new --out") from err
            try:
                optimizer.load_state_dict(state["optimizer"])
                scheduler.load_state_dict(state["scheduler"])
            except (ValueError, KeyError, TypeError, RuntimeError) as err:
                raise SpeculaError(f"the optimiser state in {checkpointer.path} does not fit this head ({err}); "
                                   "start a new --out") from err
            step, history = state["step"], state["history"]
            log(f"resumed from step {step} of {total_steps}")
    model, optimizer = accelerator.prepare(head, optimizer)

    progress = tqdm(total=total_steps, initial=step, desc="train", disable=not accelerator.is_main_process,
                    dynamic_ncols=True)
    started, tokens_seen = time.perf_counter(), 0
    ordered_epoch = None  # the epoch whose sample order `order` holds
    saved = step if step else None  # the step of the checkpoint on disk, if any
    check_gradients = mixed != "fp16"  # fp16's loss scaler skips steps with inf gradients by design
    try:
        while step < total_steps:
            epoch, index = divmod(step, steps_per_epoch)
            if epoch != ordered_epoch:  # once per epoch: with lengths the order sorts every window
                order, ordered_epoch = epoch_order(len(dataset), config.seed, epoch, lengths, config.batch_size), epoch
            first = index * config.batch_size + rank * per_process
            batch = pad_batch([dataset[i] for i in order[first:first + per_process]], keys)
            rows = first - index * config.batch_size
            batch["noise_seed"] = (config.seed * 1_000_003 + step) * 4096 + torch.arange(rows, rows + per_process)
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            model.train()
            with accelerator.autocast():
                loss_sum, count, metrics = loss_fn(model, batch)
            # Normalise by the tokens of the global batch, so the gradient is the same for any process count.
            global_count = accelerator.reduce(torch.tensor(float(count), device=accelerator.device), "sum")
            loss = loss_sum * world / global_count.clamp(min=1.0)
            reported = accelerator.reduce(loss.detach() / world, "sum").item()  # the same on every process
            if not math.isfinite(reported):
                raise _diverged("loss", reported, step + 1, checkpointer, saved)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), config.grad_clip)
            if check_gradients and norm is not None and not math.isfinite(float(norm)):
                raise _diverged("gradient norm", float(norm), step + 1, checkpointer, saved)
            optimizer.step()
            scheduler.step()
            if not _finite_weights(model):  # e.g. a huge learning rate: the loss was fine, the update was not
                raise _diverged("updated weights", math.nan, step + 1, checkpointer, saved)
            step += 1
            tokens_seen += int(global_count)
            record = {"step": step, "epoch": epoch, "loss": reported, "lr": scheduler.get_last_lr()[0],
                      **{k: float(accelerator.reduce(v.detach(), "mean")) for k, v in metrics.items()}}
            history.append(record)
            rate = tokens_seen / (time.perf_counter() - started)
            progress.set_postfix(loss=f"{reported:.4f}", tok_s=f"{rate:.0f}")
            progress.update(1)
            epoch_done = step % steps_per_epoch == 0
            if evaluate is not None and epoch_done and accelerator.is_main_process:
                result = {"step": step, "epoch": epoch, "eval": evaluate(accelerator.unwrap_model(model), epoch)}
                history.append(result)
                log(json.dumps(result))
            if step % config.save_every == 0 or step == total_steps or epoch_done:
                accelerator.wait_for_everyone()
                if accelerator.is_main_process:
                    state = {"step": step, "config": asdict(config), "history": history,
                             "head": accelerator.unwrap_model(model).state_dict(),
                             "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
                    checkpointer.save(accelerator.unwrap_model(model), state, save_head)
                saved = step
    except TrainingDiverged:
        progress.close()  # ends the bar's line: the error that follows is a line of its own
        raise
    except KeyboardInterrupt:
        progress.close()
        if accelerator.is_main_process:
            log(f"interrupted at step {step} of {total_steps}: {_kept(checkpointer, saved)}; "
                "run the same command with --resume to continue")
        raise
    progress.close()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        final = accelerator.unwrap_model(model)
        save_head(final, out)
        atomic_write_json(out / "training_history.json", history)
    return history


def _finite_weights(model: nn.Module) -> bool:
    return bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())


def _kept(checkpointer: Checkpointer, saved: int | None) -> str:
    if saved is None:
        return "no checkpoint had been written yet"
    return f"the checkpoint of step {saved} is kept in {checkpointer.path}"


def _diverged(what: str, value: float, step: int, checkpointer: Checkpointer, saved: int | None) -> TrainingDiverged:
    return TrainingDiverged(f"training diverged at step {step}: the {what} is {value} (not finite), so nothing of "
                            f"that step was saved; {_kept(checkpointer, saved)}. Lower --lr or --grad-clip and "
                            "train into a new --out")
