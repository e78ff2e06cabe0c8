"""The EAGLE-3 draft head: fused multi-layer target features, direct token prediction, reduced vocabulary.

Input at position i is the fused target feature g_i = fc(cat(l_i, m_i, h_i)),
where l, m, h are the inputs of three decoder layers of the target (by default
2, N//2 and N-3 of an N-layer target), and the embedding of the next token
t_{i+1}. One decoder layer ("midlayer") attends over cat(input_layernorm(e),
hidden_norm(g)) (2H wide) with g itself as the residual, then its MLP; its
output a_i (after ``num_hidden_layers`` - 1 further ordinary decoder layers, ``layers.{i}``, when the config
asks for more than one; one is the paper's and the default) goes through `norm` and the head's own `lm_head`
over a draft vocabulary of `draft_vocab_size` frequent target tokens. When drafting deeper,
a_i stands in for the fused feature of the token it predicted (paper, Fig. 5).

Draft ids map to target ids through the buffer ``d2t`` (int64 [Vd], target id =
draft id + d2t[draft id]); ``t2d`` (bool [V]) marks target tokens in the draft
vocabulary. With a full vocabulary neither buffer exists.

Checkpoints use the official EAGLE-3 layout (which SGLang loads as
`LlamaForCausalLMEagle3`): `config.json` with Llama keys plus `draft_vocab_size`
(and `target_hidden_size` when it differs), tensors `fc.weight` [H, 3H],
`midlayer.self_attn.{q,k,v}_proj.weight` [., 2H], `midlayer.self_attn.o_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{hidden_norm,input_layernorm,
post_attention_layernorm}.weight`, `norm.weight`, `lm_head.weight` [Vd, H], `d2t`, `t2d`.
The embedding comes from the target. ``feature_layers`` i means the input of
decoder layer i (HF ``hidden_states[i]``); i equal to the target's layer count
means its final post-norm hidden state (only for the ablation of the paper's
Table 2). On disk they are stored twice, once per server's convention: top-level
``eagle_aux_hidden_state_layer_ids`` as is (vLLM reads it so), and
``eagle_config.eagle_aux_hidden_state_layer_ids`` as i - 1 (SGLang reads it as
the output of layer i - 1). Checkpoints written before this (``eagle_config``
with ``target_num_hidden_layers`` and no top-level ids) stored i itself there.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specula.errors import SpeculaError
from specula.heads.base import top_of
from specula.heads.checkpoint import build_module, load_checked, load_state_dict, read_config, save_module
from specula.heads.eagle_head import CONFIG_KEYS, llama_config
from specula.runtime.linear_gradient import dequantized_weight
from specula.runtime.static_cache import (
    SlotBlock,
    StaticKVCache,
    block_attention_mask,
    decoder_layer_step,
    rotary_function,
)
from specula.runtime.target import FeatureRequest, ForwardOutput, Target

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_feature_layers(num_target_layers: int) -> list[int]:
    """Low, middle and high layers: inputs of decoder layers 2, N//2 and N-3 (clamped for tiny targets)."""
    n = num_target_layers
    return [min(2, n - 1), n // 2, max(n - 3, 0)]


def fused_feature_request(layers: list[int], num_target_layers: int | None) -> FeatureRequest:
    """The target features a head fusing ``layers`` reads (each layer once; N is the final hidden)."""
    inner = tuple(dict.fromkeys(i for i in layers if i != num_target_layers))
    return FeatureRequest(final_hidden=num_target_layers in layers, layer_inputs=inner)


class Eagle3Head(nn.Module):
    """fc(fused features) → one 2H-input decoder layer → norm → lm_head over the draft vocabulary."""

    def __init__(self, config: dict):
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRMSNorm,
            LlamaRotaryEmbedding,
        )

        self.config = dict(config)
        llama = llama_config(self.config)
        hidden = llama.hidden_size
        self.feature_layers = [int(i) for i in self.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
        self.num_target_layers = int(self.config["eagle_config"].get("target_num_hidden_layers", 0)) or None
        target_hidden = int(self.config.get("target_hidden_size") or hidden)
        self.vocab_size = int(llama.vocab_size)
        self.draft_vocab_size = int(self.config.get("draft_vocab_size") or self.vocab_size)
        self.fc = nn.Linear(len(self.feature_layers) * target_hidden, hidden, bias=False)
        self.midlayer = LlamaDecoderLayer(llama, 0)
        attn = self.midlayer.self_attn
        # The attention reads cat(normed embedding, normed hidden): 2H wide.
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        self.midlayer.hidden_norm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        # Further layers read the first one's output as ordinary decoder layers do (H wide); named by their index
        # in the head (`layers.1.*`, ...), the first being `midlayer`.
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(llama, i) for i in range(1, llama.num_hidden_layers)})
        self.norm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        if self.draft_vocab_size != self.vocab_size:
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        self.apply_rope = rotary_function(self.midlayer)
        self.hidden_size = hidden

    @classmethod
    def for_target(cls, target_config, draft_vocab: torch.Tensor | None = None,
                   feature_layers: list[int] | None = None, num_layers: int = 1) -> Eagle3Head:
        """A fresh head of ``num_layers`` decoder layers shaped like ``target_config``'s.

        draft_vocab: int64 [Vd] target ids of the draft vocabulary (None: the full vocabulary).
        """
        values = {k: getattr(target_config, k, None) for k in CONFIG_KEYS}
        rope = getattr(target_config, "rope_parameters", None) or {}
        values["rope_theta"] = values.get("rope_theta") or rope.get("rope_theta", 10000.0)
        values["num_hidden_layers"] = num_layers
        layers = target_config.num_hidden_layers
        values["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(feature_layers or
                                                                          default_feature_layers(layers)),
                                  "target_num_hidden_layers": layers}
        values["draft_vocab_size"] = int(draft_vocab.numel()) if draft_vocab is not None else values["vocab_size"]
        values["architectures"] = [ARCHITECTURE]
        values["model_type"] = "llama"
        head = cls({k: v for k, v in values.items() if v is not None})
        if draft_vocab is not None and head.d2t is not None:
            head.set_draft_vocab(draft_vocab)
        return head

    def set_draft_vocab(self, draft_vocab: torch.Tensor) -> None:
        """Fill d2t/t2d from the sorted target ids [Vd] of the draft vocabulary."""
        ids = torch.sort(draft_vocab.long().cpu()).values
        if ids.numel() != self.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise SpeculaError(f"a draft vocabulary needs {self.draft_vocab_size} distinct token ids")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    @torch.no_grad()
    def start_from_target_output(self, lm_head: nn.Module, final_norm: nn.Module) -> None:
        """Set ``lm_head`` to the target LM head's rows of the draft vocabulary and ``norm`` to its final norm, so
        that a fresh head starts out predicting through the target's own output layer. A quantized layer's rows are
        read through its kernel (`dequantized_weight`), so any weights format gives the values it computes with."""
        rows = dequantized_weight(lm_head).to(self.lm_head.weight.device)  # [V, H]
        self.lm_head.weight.copy_(rows[self.target_vocab_ids()])
        self.norm.weight.copy_(final_norm.weight)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft-vocabulary ids (any shape)."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def target_vocab_ids(self) -> torch.Tensor:
        """int64 [Vd]: the target id of every draft id, in draft order."""
        return self.draft_to_target(torch.arange(self.draft_vocab_size, device=self.norm.weight.device))

    # ---------------------------------------------------------------- the layer

    def _attention_input(self, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        layer = self.midlayer
        return torch.cat([layer.input_layernorm(token_embeds), layer.hidden_norm(hidden)], dim=-1)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Fused features [.., H] from concatenated target features [.., L*H]."""
        return self.fc(features)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [.., Vd] from the layer's outputs a [.., H]."""
        return self.lm_head(self.norm(hidden))

    # ---------------------------------------------------------------- training: training-time test

    def forward(self, features: torch.Tensor, step_embeds: list[torch.Tensor]) -> list[torch.Tensor]:
        """Training-time test over a batch: outputs a [B, T, H] of each of K simulated draft steps.

        features [B, T, L*H] are the target's concatenated features; step_embeds[i] [B, T, H] holds at
        slot j the embedding of token t_{j+1+i}. Step 0 reads the fused target features; step i > 0
        reads step i-1's outputs at the same slot. A query of step i at slot j attends to the step-0
        keys at slots <= j and to the keys of steps 1..i at slot j only (the paper's Fig. 6), with
        position j + i, as it would have when drafting i tokens past slot j.
        """
        hidden = self.fuse(features)
        batch, length, _ = hidden.shape
        attn = self.midlayer.self_attn
        head_dim = attn.head_dim
        slots = torch.arange(length, device=hidden.device)
        causal = slots[None, :] <= slots[:, None]
        # Per layer, every step's keys and values so far (a later step attends to the earlier steps' at its slot).
        keys: list[list[torch.Tensor]] = [[] for _ in range(1 + len(self.layers))]
        values: list[list[torch.Tensor]] = [[] for _ in range(1 + len(self.layers))]
        outputs = []
        for step, embeds in enumerate(step_embeds):
            x = self._attention_input(hidden, embeds)
            cos, sin = self.rotary_emb(x, (slots + step)[None].expand(batch, -1))
            for index, layer in enumerate([self.midlayer, *self.layers.values()]):
                if index:
                    x = layer.input_layernorm(hidden)
                attn = layer.self_attn
                q = attn.q_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
                k = attn.k_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
                v = attn.v_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
                q, k = self.apply_rope(q, k, cos, sin)
                repeat = q.shape[1] // k.shape[1]
                keys[index].append(k.repeat_interleave(repeat, dim=1))
                values[index].append(v.repeat_interleave(repeat, dim=1))
                out = ttt_attention(q, keys[index], values[index], causal, attn.scaling)
                hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            outputs.append(hidden)
        return outputs

    # ---------------------------------------------------------------- the DraftHead interface (heads/base.py)

    def attach(self, target: Target) -> Eagle3Head:
        """EAGLE-3 drafts through its own LM head; only the vocabulary it maps into must be the target's."""
        if self.vocab_size != target.vocab_size:
            raise SpeculaError(f"EAGLE-3 head vocabulary {self.vocab_size} does not fit the target's "
                               f"{target.vocab_size}")
        return self

    def new_cache(self, capacity: int) -> StaticKVCache:
        attn = self.midlayer.self_attn
        param = self.norm.weight  # the linears may be in a quantized format (specula.runtime.weights)
        kv_heads = attn.k_proj.out_features // attn.head_dim
        return StaticKVCache(1 + len(self.layers), kv_heads, attn.head_dim, capacity, param.dtype, param.device)

    def feature_request(self) -> FeatureRequest:
        return fused_feature_request(self.feature_layers, self.num_target_layers)

    def target_features(self, out: ForwardOutput) -> torch.Tensor:
        """Concatenated target features [n, L*H] of a forward's output rows."""
        return self._concat(out.hidden, out.layer_inputs)

    def sample_features(self, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenated target features [.., T, L*H] of a cached training sample or batch.

        It holds ``layer_inputs`` [.., T, L', H] stacked in `feature_request` order, and ``hidden``.
        """
        stacked = sample.get("layer_inputs")
        layers = {} if stacked is None else dict(zip(self.feature_request().layer_inputs, stacked.unbind(-2),
                                                      strict=True))
        return self._concat(sample.get("hidden"), layers)

    def _concat(self, hidden: torch.Tensor | None, layers: dict[int, torch.Tensor]) -> torch.Tensor:
        return torch.cat([hidden if i == self.num_target_layers else layers[i] for i in self.feature_layers], dim=-1)

    @torch.no_grad()  # drafting only; training reads draft_logits
    def token_log_probs(self, predicted: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [n, V] over the target vocabulary (-inf outside the draft vocabulary)."""
        logits, ids = self.drafted_logits(predicted)
        draft = torch.log_softmax(logits.float(), dim=-1)
        if ids is None:
            return draft
        full = draft.new_full((draft.shape[0], self.vocab_size), -math.inf)
        full[:, ids] = draft
        return full

    @torch.no_grad()
    def drafted_logits(self, predicted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [n, Vd] over the draft vocabulary, its target ids [Vd], or None without a mapping)."""
        return self.draft_logits(predicted), None if self.d2t is None else self._drafting_vocab_ids()

    def _drafting_vocab_ids(self) -> torch.Tensor:
        """`target_vocab_ids`, computed once per state of ``d2t`` (a sampled draft asks every cycle: ~50 us)."""
        key = (self.d2t.data_ptr(), self.d2t._version)
        if getattr(self, "_vocab_ids_key", None) != key:
            self._vocab_ids, self._vocab_ids_key = self.target_vocab_ids(), key
        return self._vocab_ids

    @torch.no_grad()
    def top_tokens(self, predicted: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``count`` likeliest draft tokens per row as target ids [n, count], with their log-probabilities
        [n, count]: from the draft vocabulary's logits alone, never widened to the target's vocabulary."""
        draft_ids, log_probs = top_of(self.draft_logits(predicted), count)
        return self.draft_to_target(draft_ids), log_probs

    @torch.no_grad()
    def step(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
             cache: StaticKVCache, mask: torch.Tensor | None, own_features: bool = False,
             slots: SlotBlock | None = None) -> torch.Tensor:
        """Layer outputs a [n, H] for n (feature, next-token embedding) pairs after the cache.

        features [n, L*H] from the target, or the head's own outputs [n, H] when ``own_features``.
        positions [n]; mask bool [1, 1, n, cache.length + n] or None for a causal chain; with ``slots`` (a
        compiled step, `specula.runtime.compiled_step`) the mask covers the whole allocation [1, 1, n, allocated].
        """
        hidden = (features if own_features else self.fuse(features))[None]
        x = self._attention_input(hidden, token_embeds[None])
        cos, sin = self.rotary_emb(x, positions[None])
        if mask is None:  # a causal chain: after a cached prefix, SDPA's own causal flag would misalign it
            mask = block_attention_mask(cache.length, positions, None)
        causal = mask is None and cache.length == 0
        hidden = decoder_layer_step(self.midlayer, hidden, cos, sin, cache, 0, mask, causal, self.apply_rope,
                                    attention_input=x, slots=slots)
        for index, layer in enumerate(self.layers.values(), start=1):
            hidden = decoder_layer_step(layer, hidden, cos, sin, cache, index, mask, causal, self.apply_rope,
                                        slots=slots)
        return hidden[0]

    # ---------------------------------------------------------------- checkpoints (official layout)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json and model.safetensors atomically."""
        eagle_config = dict(self.config["eagle_config"],
                            eagle_aux_hidden_state_layer_ids=[i - 1 for i in self.feature_layers])
        config = dict(self.config, eagle_aux_hidden_state_layer_ids=self.feature_layers, eagle_config=eagle_config)
        save_module(self, directory, config, self.fc.weight.dtype)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu", num_target_layers: int | None = None) -> Eagle3Head:
        """Load an official-layout EAGLE-3 head; ``num_target_layers`` fills in the default fused layers."""
        directory = Path(directory)
        config = read_config(directory, "EAGLE-3 head")
        state = load_state_dict(directory)
        state = {k: v for k, v in state.items() if not k.startswith("embed_tokens.")}
        if "fc.weight" not in state or "midlayer.self_attn.q_proj.weight" not in state:
            raise SpeculaError(f"{directory} is not an EAGLE-3 head (no fc.weight / midlayer.* tensors)")
        eagle_config = dict(config.get("eagle_config") or {})
        top_level = config.pop("eagle_aux_hidden_state_layer_ids", None)
        if top_level:  # vLLM's convention, ours
            eagle_config["eagle_aux_hidden_state_layer_ids"] = list(top_level)
        elif eagle_config.get("eagle_aux_hidden_state_layer_ids") and "target_num_hidden_layers" not in eagle_config:
            # SGLang's convention (output of layer i); older Specula checkpoints name target_num_hidden_layers
            eagle_config["eagle_aux_hidden_state_layer_ids"] = [
                int(i) + 1 for i in eagle_config["eagle_aux_hidden_state_layer_ids"]]
        if not eagle_config.get("eagle_aux_hidden_state_layer_ids"):
            layers = num_target_layers or eagle_config.get("target_num_hidden_layers")
            if not layers:
                raise SpeculaError(f"EAGLE-3 head in {directory} does not name its fused target layers; "
                                   "load it for a target so the default layers (2, N//2, N-3) can be used")
            eagle_config["eagle_aux_hidden_state_layer_ids"] = default_feature_layers(layers)
        if num_target_layers and not eagle_config.get("target_num_hidden_layers"):
            eagle_config["target_num_hidden_layers"] = num_target_layers
        config["eagle_config"] = eagle_config
        if "lm_head.weight" in state:
            config.setdefault("draft_vocab_size", state["lm_head.weight"].shape[0])
        head = build_module(cls, config, f"EAGLE-3 head in {directory}")
        load_checked(head, state, f"EAGLE-3 head in {directory}")
        if head.d2t is not None:
            mapped = torch.arange(head.draft_vocab_size) + head.d2t
            if (mapped.min() < 0 or mapped.max() >= head.vocab_size
                    or not torch.equal(head.t2d.nonzero().flatten().sort().values, mapped.sort().values)):
                raise SpeculaError(f"EAGLE-3 head in {directory}: d2t and t2d do not describe the same vocabulary")
        return head.to(device=device, dtype=dtype or state["fc.weight"].dtype).eval()


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], causal: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Attention of step i = len(keys) - 1 of the training-time test, without dense masks over all steps.

    q [B, h, T, d]; keys/values: one [B, h, T, d] per step 0..i; causal bool [T, T].
    Step-0 keys are attended causally (a matrix product); each later step's key only at the
    query's own slot (a dot product per slot), so the cost stays that of ordinary attention.
    Returns [B, h, T, d].
    """
    scores = [torch.matmul(q, keys[0].transpose(-1, -2)).mul(scale).masked_fill(~causal, -math.inf)]
    scores += [(q * k).sum(-1, keepdim=True).mul(scale) for k in keys[1:]]
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    length = q.shape[2]
    out = torch.matmul(weights[..., :length], values[0])
    for offset, v in enumerate(values[1:]):
        out = out + weights[..., length + offset: length + offset + 1] * v
    return out


def dense_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        causal: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference for `ttt_attention`: SDPA over all steps' keys with the full Fig. 6 mask [T, (i+1)T]."""
    length = q.shape[2]
    eye = torch.eye(length, dtype=torch.bool, device=q.device)
    mask = torch.cat([causal] + [eye] * (len(keys) - 1), dim=-1)
    return F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask,
                                          scale=scale)
