"""The EAGLE draft head (EAGLE-1 paper): feature-level autoregression with shifted tokens.

Input at position i is the target's feature f_i (final post-norm hidden state)
and the embedding of the token one step ahead, t_{i+1}; a linear layer reduces
cat(embedding, feature) from 2H to H, then N Llama decoder layers predict
f_{i+1}. The target's own (frozen) LM head turns a predicted feature into token
probabilities, and the target's embedding embeds the tokens: neither is stored
in the head's checkpoint.

Checkpoints use the official EAGLE layout: `config.json` with Llama keys (and
`bias` for the fc layer, true when absent) and `fc.weight` [H, 2H], `fc.bias`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.post_attention_layernorm.weight`, and `layers.{i}.input_layernorm.weight`
for i > 0 (layer 0 normalises nothing at its input), in `model.safetensors` or
`pytorch_model.bin`.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch import nn

from specula.heads.base import top_of
from specula.heads.checkpoint import build_module, load_checked, load_state_dict, read_config, save_module
from specula.runtime.static_cache import (
    SlotBlock,
    StaticKVCache,
    block_attention_mask,
    decoder_layer_step,
    rotary_function,
)
from specula.runtime.target import FeatureRequest, ForwardOutput, Target

CONFIG_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "num_hidden_layers", "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings",
               "hidden_act", "head_dim")


def llama_config(values: dict):
    """A `transformers` LlamaConfig from the Llama keys of a head config (others ignored)."""
    from transformers import LlamaConfig

    known = {k: values[k] for k in CONFIG_KEYS if values.get(k) is not None}
    if "rope_parameters" in values and "rope_theta" not in known:
        known["rope_theta"] = values["rope_parameters"].get("rope_theta", 10000.0)
    config = LlamaConfig(**known)
    config._attn_implementation = "sdpa"  # the head's layers run standalone, outside a PreTrainedModel
    return config


class EagleHead(nn.Module):
    """fc(cat(embed(t_{i+1}), f_i)) → N decoder layers → predicted f_{i+1}, all [.., H]."""

    def __init__(self, config: dict):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = dict(config)
        self.config.setdefault("bias", True)
        llama = llama_config(self.config)
        hidden = llama.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(self.config["bias"]))
        self.layers = nn.ModuleList(LlamaDecoderLayer(llama, i) for i in range(llama.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        self.apply_rope = rotary_function(self.layers[0])
        self.hidden_size = hidden

    @classmethod
    def for_target(cls, target_config, num_layers: int = 1, bias: bool = True) -> EagleHead:
        """A fresh head shaped like one decoder layer of ``target_config``."""
        values = {k: getattr(target_config, k, None) for k in CONFIG_KEYS}
        rope = getattr(target_config, "rope_parameters", None) or {}
        values["rope_theta"] = values.get("rope_theta") or rope.get("rope_theta", 10000.0)
        values["num_hidden_layers"] = num_layers
        values["bias"] = bias
        values["architectures"] = ["LlamaForCausalLM"]
        values["model_type"] = "llama"
        return cls({k: v for k, v in values.items() if v is not None})

    # ---------------------------------------------------------------- training: whole sequences

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Predicted next features [B, T, H] from features f_i and embeddings of t_{i+1}, both [B, T, H].

        Causal over T; right padding is harmless because no real position attends to it.
        """
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        cos, sin = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_embeddings=(cos, sin))
        return x

    # ---------------------------------------------------------------- drafting: against a KV cache

    def new_cache(self, capacity: int) -> StaticKVCache:
        attn = self.layers[0].self_attn
        param = self.layers[0].post_attention_layernorm.weight  # the linears may be quantized (specula.runtime.weights)
        kv_heads = attn.k_proj.out_features // attn.head_dim
        return StaticKVCache(len(self.layers), kv_heads, attn.head_dim, capacity, param.dtype, param.device)

    # ---------------------------------------------------------------- the DraftHead interface (heads/base.py)

    def feature_request(self) -> FeatureRequest:
        """What the head reads from every target forward."""
        return FeatureRequest(final_hidden=True)

    def target_features(self, out: ForwardOutput) -> torch.Tensor:
        """The head's input features [n, H] from a target forward's output rows."""
        return out.hidden

    def sample_features(self, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """The head's input features [.., T, H] of a cached training sample or batch."""
        return sample["hidden"]

    def attach(self, target: Target) -> EagleHead:
        """Read tokens through the target's (frozen) LM head, which the head shares and does not store."""
        # A weak reference, not a submodule: never saved, moved, trained or deep-copied with the head.
        object.__setattr__(self, "_lm_head", weakref.ref(target.model.get_output_embeddings()))
        return self

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of the target's LM head over predicted features [n, H]."""
        lm_head = self.__dict__["_lm_head"]() if "_lm_head" in self.__dict__ else None
        if lm_head is None:
            raise RuntimeError("EagleHead.attach(target) must be called before drafting")
        # A quantized LM head (specula.runtime.weights) casts its input itself and has no float weight.
        dtype = lm_head.weight.dtype if isinstance(lm_head, nn.Linear) else predicted.dtype
        return lm_head(predicted.to(dtype))

    def token_log_probs(self, predicted: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [n, V] over the target vocabulary from predicted features [n, H]."""
        return torch.log_softmax(self.logits(predicted).float(), dim=-1)

    @torch.no_grad()
    def drafted_logits(self, predicted: torch.Tensor) -> tuple[torch.Tensor, None]:
        """(logits [n, V] over the target vocabulary, None): an EAGLE head drafts any token."""
        return self.logits(predicted), None

    def top_tokens(self, predicted: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``count`` likeliest tokens per row [n, count] and their log-probabilities [n, count]."""
        return top_of(self.logits(predicted), count)

    @torch.no_grad()
    def step(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
             cache: StaticKVCache, mask: torch.Tensor | None, own_features: bool = False,
             slots: SlotBlock | None = None) -> torch.Tensor:
        """Predicted features [n, H] for a block of n (feature, next-token embedding) pairs after the cache.

        positions [n]; mask bool [1, 1, n, cache.length + n] or None for a causal chain; with ``slots`` (a
        compiled step, `specula.runtime.compiled_step`) the mask covers the whole allocation [1, 1, n, allocated].
        ``own_features`` says the features are the head's own predictions (same input for EAGLE-1).
        """
        x = self.fc(torch.cat([token_embeds, features], dim=-1))[None]
        cos, sin = self.rotary_emb(x, positions[None])
        if mask is None:  # a causal chain: after a cached prefix, SDPA's own causal flag would misalign it
            mask = block_attention_mask(cache.length, positions, None)
        causal = mask is None and cache.length == 0
        for i, layer in enumerate(self.layers):
            x = decoder_layer_step(layer, x, cos, sin, cache, i, mask, causal, self.apply_rope, slots=slots)
        return x[0]

    # ---------------------------------------------------------------- checkpoints (official layout)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json and model.safetensors atomically (write, then rename)."""
        save_module(self, directory, self.config, self.fc.weight.dtype)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> EagleHead:
        directory = Path(directory)
        config = read_config(directory, "EAGLE head")
        state = load_state_dict(directory)
        state = {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}
        if "num_hidden_layers" not in config:
            config["num_hidden_layers"] = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("layers.")),
                                                  default=0)
        config.setdefault("bias", "fc.bias" in state)
        head = build_module(cls, config, f"EAGLE head in {directory}")
        load_checked(head, state, f"EAGLE head in {directory}")
        return head.to(device=device, dtype=dtype or state["fc.weight"].dtype).eval()

