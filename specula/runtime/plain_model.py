"""A Llama-family causal LM as plain PyTorch modules, so that a converted target loads without `transformers`.

Importing `transformers`' Llama modelling code costs ~1.4 s and its config classes ~0.9 s on a 2-core CPU, more than
the rest of a warm start together (importing torch ~1.5 s, mapping the converted weights ~0.1 s): the converted
cache (`specula.runtime.converted_cache`) held `transformers` modules, and unpickling them imported all of that
before the first token. `PlainCausalLM` holds the same submodules under the same names (``model.layers[i]
.self_attn.q_proj``, ``model.norm``, ``lm_head``, ...), so `specula.runtime.forward.LlamaFamilyRuntime` and the
drafters read it as they read a `transformers` model, and its norms, rotary embedding and activation compute what
`transformers`' do, operation for operation (bit-equal outputs: `tests/test_plain_model.py`).

`from_transformers` builds one from a loaded `transformers` model, sharing its weights, the converted linears
included; it declines (None) a model it cannot mirror exactly (another architecture, a rotary embedding whose
frequencies change with the length, an activation other than SiLU). `to_transformers` goes back, for the few
callers that need `transformers`' own `generate` (the ``hf`` rows of a benchmark, batched regeneration).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from specula.runtime.forward import LLAMA_FAMILY
from specula.runtime.weights import linear_names, replace_submodule

# Rotary embeddings whose frequencies are fixed once computed: the `transformers` forward of these is the one below.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


class PlainConfig(SimpleNamespace):
    """A model's `transformers` config as plain attributes (its ``to_dict()``): read like the config, pickled and
    unpickled without importing `transformers`."""

    def to_dict(self) -> dict:
        return dict(vars(self))


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as `transformers`' Llama, Mistral and Qwen norms compute it."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin [batch, n, head_dim] of positions [batch, n], from fixed inverse frequencies [head_dim / 2]."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [batch, heads, n, head_dim] rotated by cos, sin [batch, n, head_dim] (found by
    `specula.runtime.static_cache.rotary_function` beside `Attention`)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class Attention(nn.Module):
    """A layer's attention weights and sizes; the attention itself runs in `specula.runtime.static_cache`."""

    def __init__(self, q_proj: nn.Module, k_proj: nn.Module, v_proj: nn.Module, o_proj: nn.Module, head_dim: int,
                 scaling: float, sliding_window: int | None, q_norm: RMSNorm | None, k_norm: RMSNorm | None):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
        self.head_dim, self.scaling, self.sliding_window = head_dim, scaling, sliding_window
        if q_norm is not None:  # Qwen3 normalises each head before rotary
            self.q_norm, self.k_norm = q_norm, k_norm


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: Attention, mlp: GatedMLP, input_layernorm: RMSNorm,
                 post_attention_layernorm: RMSNorm):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm


class DecoderStack(nn.Module):
    def __init__(self, embed_tokens: nn.Module, layers: list[DecoderLayer], norm: RMSNorm,
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        self.embed_tokens, self.layers = embed_tokens, nn.ModuleList(layers)
        self.norm, self.rotary_emb = norm, rotary_emb


class PlainCausalLM(nn.Module):
    """``model`` (embedding, decoder layers, final norm, rotary embedding) and ``lm_head``, with the config and the
    generation config's end-of-sequence ids as plain attributes."""

    base_model_prefix = "model"  # where the decoder stack is, as `transformers` models say it

    def __init__(self, model: DecoderStack, lm_head: nn.Module, config: PlainConfig, generation_config: PlainConfig):
        super().__init__()
        self.model, self.lm_head = model, lm_head
        self.config, self.generation_config = config, generation_config
        self._twin: dict = {}  # the `transformers` twin, once built (a dict: a module attribute would be a submodule)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_twin": {}}  # rebuilt when asked for: pickling it would import transformers

    def to_transformers(self) -> nn.Module:
        """The same model as a `transformers` model sharing these weights (built once), for its ``generate``."""
        if "model" not in self._twin:
            self._twin["model"] = _transformers_twin(self)
        return self._twin["model"]


def transformers_model(model: nn.Module) -> nn.Module:
    """``model`` as a `transformers` model: itself, or a plain model's twin (`PlainCausalLM.to_transformers`)."""
    return model.to_transformers() if isinstance(model, PlainCausalLM) else model


def _norm(module: nn.Module) -> RMSNorm | None:
    names = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
    if type(module).__name__ not in names or not hasattr(module, "variance_epsilon"):
        return None
    return RMSNorm(module.weight, module.variance_epsilon)


def from_transformers(model: nn.Module) -> PlainCausalLM | None:
    """A plain model sharing ``model``'s weights (see the module docstring), or None if it cannot mirror it."""
    config = model.config
    base = getattr(model, "model", None)
    rotary = getattr(base, "rotary_emb", None)
    if (config.model_type not in LLAMA_FAMILY or rotary is None
            or getattr(rotary, "rope_type", None) not in STATIC_ROPE_TYPES
            or getattr(config, "hidden_act", None) not in ("silu", "swish")):
        return None
    layers = []
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = [_norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)]
        q_norm = k_norm = None
        if hasattr(attn, "q_norm"):
            q_norm, k_norm = _norm(attn.q_norm), _norm(attn.k_norm)
            norms += [q_norm, k_norm]
        if None in norms or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return None
        plain_attn = Attention(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, attn.head_dim, attn.scaling,
                               getattr(attn, "sliding_window", None), q_norm, k_norm)
        layers.append(DecoderLayer(plain_attn, GatedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj), *norms[:2]))
    norm = _norm(base.norm)
    if norm is None:
        return None
    stack = DecoderStack(base.embed_tokens, layers, norm,
                         RotaryEmbedding(rotary.inv_freq.clone(), float(rotary.attention_scaling)))
    generation = getattr(model, "generation_config", None)
    generation_config = PlainConfig(**(generation.to_dict() if generation is not None else {}))
    plain = PlainCausalLM(stack, model.lm_head, PlainConfig(**config.to_dict()), generation_config)
    return plain.train(model.training).requires_grad_(False)


def _transformers_twin(plain: PlainCausalLM) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    values = {k: v for k, v in plain.config.to_dict().items() if k != "transformers_version"}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with init_empty_weights(include_buffers=False):  # the rotary frequencies are computed, the rest is shared
        twin = AutoModelForCausalLM.from_config(config, dtype=plain.model.norm.weight.dtype,
                                                attn_implementation="sdpa")
    for name in ("model.embed_tokens", *linear_names(len(plain.model.layers), lm_head=True)):
        replace_submodule(twin, name, plain.get_submodule(name))
    for name, module in plain.named_modules():
        if isinstance(module, RMSNorm):
            twin.get_submodule(name).weight = module.weight
    if plain.generation_config.to_dict():
        twin.generation_config = GenerationConfig(**plain.generation_config.to_dict())
    return twin.train(plain.training).requires_grad_(False)
