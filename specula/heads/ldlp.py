"""AdaEAGLE's Lightweight Draft Length Predictor (LDLP): how many tokens to draft next.

A three-layer MLP reads the target's embedding e_j of the last accepted token t_j
and the target's final post-norm hidden state f_j at that token (the EAGLE feature)
and regresses the number of draft tokens the target would accept from an EAGLE
chain drafted after the next root t_{j+1}. Each input is RMS-normalised without
parameters first: embeddings and features live on very different scales, and the
MLP should not have to learn that away. Decoding rounds the prediction and clips
it to [1, max_draft_length].

Checkpoint: ``config.json`` (``model_type`` "specula-ldlp", sizes, ``max_draft_length``,
``penalty``, the fingerprint of the EAGLE head it was trained for) and
``model.safetensors`` with ``layers.{0,1,2}.weight`` / ``.bias``, written atomically.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specula.errors import SpeculaError
from specula.heads.checkpoint import build_module, load_checked, load_state_dict, read_config, save_module

MODEL_TYPE = "specula-ldlp"
CONFIG_KEYS = ("hidden_size", "embedding_size", "intermediate_size", "max_draft_length", "vocab_size")


class LengthPredictor(nn.Module):
    """MLP(cat(rms(e_j), rms(f_j))) → predicted accepted length, a real number per row."""

    def __init__(self, config: dict):
        super().__init__()
        missing = [k for k in CONFIG_KEYS if not isinstance(config.get(k), int) or config[k] < 1]
        if missing:
            raise SpeculaError(f"LDLP config lacks positive integer {', '.join(missing)}")
        self.config = dict(config, model_type=MODEL_TYPE)
        width = config["intermediate_size"]
        self.layers = nn.ModuleList([nn.Linear(config["embedding_size"] + config["hidden_size"], width),
                                     nn.Linear(width, width), nn.Linear(width, 1)])
        self.max_draft_length = int(config["max_draft_length"])

    @classmethod
    def for_target(cls, target_config, max_draft_length: int = 8, intermediate_size: int = 256,
                   head_fingerprint: str = "", penalty: float | None = None) -> LengthPredictor:
        """A fresh predictor for a target (sizes from its config) and the EAGLE head it will drive."""
        hidden = int(target_config.hidden_size)
        return cls({"hidden_size": hidden, "embedding_size": hidden, "intermediate_size": intermediate_size,
                    "max_draft_length": max_draft_length, "vocab_size": int(target_config.vocab_size),
                    "draft_head_fingerprint": head_fingerprint, "penalty": penalty})

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted lengths [...] from embeddings [..., E] and final hidden states [..., H]."""
        x = torch.cat([_rms(token_embeds), _rms(hidden)], dim=-1).to(self.layers[0].weight.dtype)
        x = F.silu(self.layers[0](x))
        x = F.silu(self.layers[1](x))
        return self.layers[2](x).squeeze(-1)

    @torch.no_grad()
    def draft_length(self, token_embed: torch.Tensor, hidden: torch.Tensor, cap: int | None = None) -> int:
        """The prediction for one token (embed [E], hidden [H]) rounded and clipped to [1, min(cap, max)]."""
        top = self.max_draft_length if cap is None else min(cap, self.max_draft_length)
        prediction = float(self(token_embed, hidden))
        if not math.isfinite(prediction):  # float32 overflow in the MLP: clipped as a finite value would be (NaN: 1)
            return top if prediction == math.inf else 1
        return max(1, min(top, round(prediction)))

    # ---------------------------------------------------------------- checkpoints

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json and model.safetensors atomically (write, then rename)."""
        save_module(self, directory, self.config, self.layers[0].weight.dtype)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> LengthPredictor:
        directory = Path(directory)
        config = read_config(directory, "LDLP", " (train one with `specula train ldlp`)")
        if config.get("model_type") != MODEL_TYPE:
            raise SpeculaError(f"{directory} is not an LDLP (model_type {config.get('model_type')!r}, "
                               f"expected {MODEL_TYPE!r})")
        predictor = build_module(cls, config, f"LDLP in {directory}")
        state = load_state_dict(directory)
        broken = sorted(name for name, tensor in state.items()
                        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()))
        if broken:  # such a predictor answers NaN, which no draft length can be made of
            raise SpeculaError(f"LDLP in {directory} has non-finite (NaN or infinite) weights in "
                               f"{', '.join(broken[:3])}; train it again with `specula train ldlp`")
        load_checked(predictor, state, f"LDLP in {directory}")
        return predictor.to(device=device, dtype=dtype or state["layers.0.weight"].dtype).eval()

    def check_fits(self, hidden_size: int, vocab_size: int, head_fingerprint: str | None = None) -> None:
        """Refuse a predictor made for another target, or trained against another EAGLE head."""
        if self.config["hidden_size"] != hidden_size or self.config["embedding_size"] != hidden_size:
            raise SpeculaError(f"LDLP input sizes {self.config['embedding_size']}+{self.config['hidden_size']} do "
                               f"not fit the target's hidden size {hidden_size}")
        if self.config["vocab_size"] != vocab_size:
            raise SpeculaError(f"LDLP was trained for a vocabulary of {self.config['vocab_size']}, the target has "
                               f"{vocab_size}")
        trained_for = self.config.get("draft_head_fingerprint")
        if head_fingerprint and trained_for and trained_for != head_fingerprint:
            raise SpeculaError("the LDLP was trained against another EAGLE head (its labels are that head's "
                               "acceptance lengths); train one for this head with `specula train ldlp`")


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def head_fingerprint(directory: str | Path) -> str:
    """sha256 over the stored tensors of an EAGLE head directory (names, dtypes, shapes and bytes), 16 hex digits.

    The target's embedding or LM head, which some releases ship beside the head, are left out.
    """
    state = load_state_dict(Path(directory))
    digest = hashlib.sha256()
    for name in sorted(state):
        if name.startswith(("embed_tokens.", "lm_head.")):
            continue
        tensor = state[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
