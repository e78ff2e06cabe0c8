"""Medusa heads (Medusa-1 paper): K small heads that read the target's last hidden state.

Head k (k = 1..K) reads the final post-norm hidden state h_t of the newest token
the target has processed and predicts the token k steps after the target's own
next token t+1, i.e. token t+k+1:

    p_k = softmax(W2_k · B_k(h_t)),   B = blocks applied in turn, each x ↦ x + SiLU(W1 x + b1)

With one block this is the paper's softmax(W2 · (SiLU(W1 · h) + h)). Every block
of every head has its own weights; W2_k is a bias-free H→V projection.

Shared LM head (``shared_lm_head``, our extension): every W2_k is the target's own
frozen LM head, read through `attach(target)` and never stored, so a head is its
residual blocks only. With a large vocabulary this is what keeps heads small
(SmolLM2: 49,152 × 576 per projection, 57 MB in bfloat16 per head, against 0.7 MB for
its block); the config says so with ``medusa_shared_lm_head: true`` and the files
hold only the block tensors. Published Medusa loaders do not know this layout.

Checkpoints use the published Medusa layout: a directory with `config.json`
(`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`, and here also
`hidden_size` and `vocab_size`) and the state dict of the head list in
`medusa_lm_head.safetensors` (what Medusa's trainer and TGI read and write) or
`medusa_lm_head.pt` (the original loader's torch pickle), keys

    {k}.{b}.linear.weight [H, H], {k}.{b}.linear.bias [H]   block b < L of head k (0-based)
    {k}.{L}.weight [V, H]                                    the vocabulary projection

A whole-model `model.safetensors` whose head tensors carry the module prefix
`medusa_head.` loads too (its base-model tensors are ignored).

Loading follows the published checkpoints rather than their configs where the two
disagree, as the original loader effectively must: released configs say 2 heads
for weights holding 5, so the number of heads and of blocks is read from the
tensor names, and config values that disagree are ignored. Anything else that
does not fit — a head or block with tensors missing, unknown tensors, shapes that
disagree with each other or with the config's hidden/vocabulary size — is a
SpeculaError; so is a head that does not fit the target (checked by the drafter).
"""

from __future__ import annotations

import json
import re
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write
from specula.files.readers import check_fields, load_safetensors, load_torch
from specula.runtime.linear_gradient import dequantized_weight, float_weight

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors")
PREFIX = "medusa_head."
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


class ResBlock(nn.Module):
    """x + SiLU(W x + b), [.., H] → [.., H]."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads over hidden size H and vocabulary V; ``medusa_head[k]`` is head k + 1 of the paper."""

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 base_model_name_or_path: str = "", shared_lm_head: bool = False):
        super().__init__()
        if shared_lm_head and num_layers < 1:
            raise SpeculaError("Medusa heads that share the target's LM head need at least one block each")
        if min(hidden_size, vocab_size, num_heads) < 1 or num_layers < 0:
            raise SpeculaError(f"Medusa heads need hidden size, vocabulary and head count >= 1 and blocks >= 0, "
                               f"got {hidden_size}, {vocab_size}, {num_heads}, {num_layers}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.base_model_name_or_path = base_model_name_or_path
        self.shared_lm_head = shared_lm_head
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)],
                          *([] if shared_lm_head else [nn.Linear(hidden_size, vocab_size, bias=False)]))
            for _ in range(num_heads)  # every head its own projection (built anew per head)
        )

    @classmethod
    def for_target(cls, target, num_heads: int = 4, num_layers: int = 1, base_model_name_or_path: str = "",
                   shared_lm_head: bool = False) -> MedusaHeads:
        """Fresh heads for a `Target`, initialised as Medusa does: every vocabulary projection is a copy of
        the target's LM head (or, with ``shared_lm_head``, the LM head itself), and every block starts as
        the identity (zero weight and bias), so each head first predicts what the LM head predicts and
        training only has to learn the shift."""
        lm_head = target.model.get_output_embeddings()
        vocab, hidden = target.vocab_size, target.config.hidden_size
        heads = cls(hidden, vocab, num_heads, num_layers, base_model_name_or_path or getattr(target, "name", ""),
                    shared_lm_head)
        if shared_lm_head:
            heads.zero_blocks()
            return heads.attach(target)
        heads.init_from_lm_head(dequantized_weight(lm_head))  # a quantized LM head has no float weight
        return heads

    def attach(self, target) -> MedusaHeads:
        """With a shared LM head: read tokens through the target's (frozen) LM head, never stored or trained."""
        if self.shared_lm_head:
            # A weak reference, not a submodule: never saved, moved, trained or deep-copied with the heads.
            object.__setattr__(self, "_lm_head", weakref.ref(target.model.get_output_embeddings()))
        return self

    @torch.no_grad()
    def zero_blocks(self) -> None:
        """Every residual block the identity (zero weight and bias)."""
        for head in self.medusa_head:
            for block in head:
                if isinstance(block, ResBlock):
                    block.linear.weight.zero_()
                    block.linear.bias.zero_()

    @torch.no_grad()
    def init_from_lm_head(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise SpeculaError(f"LM head of shape {tuple(weight.shape)} does not fit Medusa heads of hidden size "
                               f"{self.hidden_size} and vocabulary {self.vocab_size}")
        for head in self.medusa_head:
            head[-1].weight.copy_(weight)
        self.zero_blocks()

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits [K', .., V] of the first K' = ``num_heads`` (default all) heads from hidden states [.., H]."""
        heads = self.medusa_head if num_heads is None else self.medusa_head[:num_heads]
        if not self.shared_lm_head:
            return torch.stack([head(hidden) for head in heads])
        lm_head = self.__dict__["_lm_head"]() if "_lm_head" in self.__dict__ else None
        if lm_head is None:
            raise RuntimeError("MedusaHeads.attach(target) must be called before heads sharing the LM head run")
        weight = float_weight(lm_head)  # a quantized LM head has none and casts its input itself
        dtype = hidden.dtype if weight is None else weight.dtype
        return torch.stack([lm_head(head(hidden).to(dtype)) for head in heads])

    @property
    def config(self) -> dict:
        config = {"medusa_num_heads": self.num_heads, "medusa_num_layers": self.num_layers,
                  "base_model_name_or_path": self.base_model_name_or_path, "hidden_size": self.hidden_size,
                  "vocab_size": self.vocab_size}
        return {**config, "medusa_shared_lm_head": True} if self.shared_lm_head else config

    # ---------------------------------------------------------------- checkpoints (published layout)

    def save_pretrained(self, directory: str | Path, weights: str = "safetensors") -> None:
        """Write config.json and ``medusa_lm_head.safetensors`` (or ``.pt`` with weights="pt") atomically."""
        if weights not in ("safetensors", "pt"):
            raise SpeculaError(f"Medusa weights are saved as safetensors or pt, not '{weights}'")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.medusa_head.state_dict().items()}
        if weights == "safetensors":
            from safetensors.torch import save_file

            write = lambda path: save_file(state, path)  # noqa: E731
        else:
            write = lambda path: torch.save(state, path)  # noqa: E731
        dtype = str(next(self.parameters()).dtype).removeprefix("torch.")
        config = dict(self.config, torch_dtype=dtype)
        atomic_write(directory / f"medusa_lm_head.{weights}", write)
        atomic_write(directory / "config.json", lambda path: Path(path).write_text(json.dumps(config, indent=2)))
        # The other format, left by an earlier save, would shadow these weights when loading.
        other = "pt" if weights == "safetensors" else "safetensors"
        (directory / f"medusa_lm_head.{other}").unlink(missing_ok=True)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> MedusaHeads:
        directory = Path(directory)
        if not directory.is_dir():
            raise SpeculaError(f"Medusa head directory not found: {directory}")
        config = _read_config(directory)
        shared = config.get("medusa_shared_lm_head") is True
        state, source = _read_weights(directory)
        heads = _layout(state, source, shared)
        num_heads, num_layers = len(heads), len(heads[0]) - (0 if shared else 1)
        if shared:
            hidden, vocab = int(heads[0][0]["weight"].shape[1]), config.get("vocab_size")
            if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
                raise SpeculaError(f"Medusa config in {directory} shares the target's LM head but gives no "
                                   f"vocab_size")
        else:
            hidden, vocab = (int(n) for n in heads[0][-1]["weight"].shape[::-1])
        for key, value in (("hidden_size", hidden), ("vocab_size", vocab)):
            if key in config and config[key] != value:
                raise SpeculaError(f"{source} holds Medusa heads of {key} {value} but its config says {config[key]}")
        model = cls(hidden, vocab, num_heads, num_layers, str(config.get("base_model_name_or_path", "")), shared)
        expected = model.medusa_head.state_dict()
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise SpeculaError(f"Medusa tensor {name} in {source} has shape {tuple(tensor.shape)}; "
                                   f"heads of hidden size {hidden} and vocabulary {vocab} need "
                                   f"{tuple(expected[name].shape)}")
        model.medusa_head.load_state_dict(state)
        return model.to(device=device, dtype=dtype or heads[0][-1]["weight"].dtype).eval()


def _read_config(directory: Path) -> dict:
    """config.json (optional: the tensors tell everything needed to run the heads)."""
    file = directory / "config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpeculaError(f"Medusa config {file} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise SpeculaError(f"Medusa config {file} is not a JSON object")
    return check_fields(config, f"Medusa config {file}")


def _read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The head tensors with keys ``{k}.{b}...`` (module prefix removed, base-model tensors dropped)."""
    file = next((directory / name for name in WEIGHT_FILES if (directory / name).is_file()), None)
    if file is None:
        raise SpeculaError(f"{directory} holds no Medusa weights (looked for {', '.join(WEIGHT_FILES)})")
    if file.suffix == ".safetensors":
        state = load_safetensors(file, "Medusa weights")
    else:
        state = load_torch(file, "Medusa weights")
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise SpeculaError(f"{file} is not a state dict of tensors")
    integral = sorted(k for k, v in state.items() if not v.dtype.is_floating_point)
    if integral:  # load_state_dict would cast them into the float weights silently
        raise SpeculaError(f"{file}: Medusa tensor {integral[0]} is stored as "
                           f"{str(state[integral[0]].dtype).removeprefix('torch.')}, not as floating point")
    if any(k.startswith(PREFIX) for k in state):
        state = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}
    return state, file


def _layout(state: dict[str, torch.Tensor], source: Path, shared: bool = False) -> list[list[dict[str, torch.Tensor]]]:
    """heads[k][b] = tensors of block b of head k; the last entry of each head is its projection (none when
    the heads share the target's LM head)."""
    if not state:
        raise SpeculaError(f"{source} holds no Medusa head tensors")
    unknown = sorted(k for k in state if not _KEY.match(k))
    if unknown:
        raise SpeculaError(f"{source} holds tensors that are not Medusa head tensors: {unknown[:4]}")
    parts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        head, part, name = _KEY.match(key).groups()
        parts.setdefault(int(head), {}).setdefault(int(part), {})[name.removeprefix("linear.")] = tensor
    count = max(parts) + 1
    missing = [k for k in range(count) if k not in parts]
    if missing:
        raise SpeculaError(f"{source} lacks the tensors of Medusa heads {missing} (it holds heads up to {count - 1})")
    heads = []
    for k in range(count):
        layers = max(parts[k]) + shared  # the projection follows the blocks: index L of a head with L blocks
        if shared:
            if any(set(p) == {"weight"} for p in parts[k].values()):
                raise SpeculaError(f"Medusa head {k} in {source} holds a vocabulary projection, but its config "
                                   f"says the heads share the target's LM head")
        elif set(parts[k][layers]) != {"weight"}:
            raise SpeculaError(f"Medusa head {k} in {source} has no vocabulary projection {k}.{layers}.weight "
                               f"after its blocks")
        blocks = []
        for b in range(layers):
            tensors = parts[k].get(b, {})
            if set(tensors) != {"weight", "bias"}:
                raise SpeculaError(f"Medusa head {k} in {source} lacks {k}.{b}.linear.weight/bias")
            blocks.append(tensors)
        heads.append(blocks if shared else [*blocks, parts[k][layers]])
    if len({len(h) for h in heads}) != 1:
        raise SpeculaError(f"Medusa heads in {source} have different numbers of blocks: "
                           f"{[len(h) - 1 for h in heads]}")
    return heads
