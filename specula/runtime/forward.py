"""The target's forward over a block of tokens, in two runtimes that share one contract.

A block of n tokens runs after the committed prefix: each block token attends to the whole prefix and to
the block tokens its ``block_mask`` allows (its ancestors in a draft tree, or the causal triangle of a
chain), at position prefix length + depth. Keys and values of the block are written to cache slots
[length, length + n) and stay provisional until ``commit`` keeps the chosen ones.

- `LlamaFamilyRuntime` drives the decoder layers of Llama, Mistral, Qwen2 and Qwen3 checkpoints directly
  with a static cache (`specula.runtime.static_cache`) and one attention call per layer (the gpt-fast
  recipe), reusing the model's weights, rotary embedding and norms (a `transformers` model's, or the plain mirror
  `specula.runtime.plain_model` that computes the same bits) so the numbers match `transformers`;
  `specula.runtime.compiled_step` compiles its steps.
- `GenericRuntime` calls the `transformers` model itself with a 4-D mask and a `DynamicCache`, for any
  other causal LM that accepts 4-D attention masks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from specula.errors import SpeculaError
from specula.runtime.compiled_step import CompiledStep, pads_eager_blocks
from specula.runtime.native_decoder import NativeDecoder
from specula.runtime.static_cache import (
    FusedProjections,
    SlotBlock,
    StaticKVCache,
    block_attention_mask,
    decoder_layer_step,
    rotary_function,
)

LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3"}


def hidden_dtype(model) -> torch.dtype:
    """The dtype of the model's hidden states (and KV cache): what its embedding outputs. Not its first
    parameter's: with a block embedding (`specula.gguf.block_embedding`, buffers only) the first parameter can be a
    bfloat16 linear's weight while the states stay float32."""
    embedding = model.get_input_embeddings()
    return getattr(embedding, "dtype", None) or embedding.weight.dtype


@dataclass
class ForwardOutput:
    """What one forward over a block of n tokens returns.

    logits:       [n, V], in the model dtype.
    hidden:       [n, H] final post-norm hidden states, when requested.
    layer_inputs: {layer index: [n, H]} inputs of the requested decoder layers.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)

    def select(self, rows: list[int] | torch.Tensor | slice) -> ForwardOutput:
        """The same output restricted to ``rows`` of the block."""
        return ForwardOutput(
            self.logits[rows],
            None if self.hidden is None else self.hidden[rows],
            {k: v[rows] for k, v in self.layer_inputs.items()},
        )


@dataclass(frozen=True)
class FeatureRequest:
    """Which hidden states a drafter needs from the target on every forward."""

    final_hidden: bool = False
    layer_inputs: tuple[int, ...] = ()


class LlamaFamilyRuntime:
    """Static-cache forward over the `transformers` decoder layers of Llama-like models."""

    def __init__(self, model, capacity: int):
        config = model.config
        self.model = model
        self.layers = list(model.model.layers)
        param = next(model.parameters())
        self.cache = StaticKVCache(len(self.layers), config.num_key_value_heads, self.layers[0].self_attn.head_dim,
                                   capacity, hidden_dtype(model), param.device)
        self.apply_rope = rotary_function(self.layers[0])
        mistral_window = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        self.windows = [getattr(layer.self_attn, "sliding_window", None) or mistral_window for layer in self.layers]
        self.fused = [FusedProjections(layer) for layer in self.layers]
        self.compiled: CompiledStep | None = None  # set by Target.compile
        # Off a CPU, eager blocks run at the compiled step's one shape (row invariance there: `pads_eager_blocks`).
        self.padded = CompiledStep(self, compile=False) if pads_eager_blocks(param.device) else None
        self._native: NativeDecoder | None | bool = False  # False: not built yet (`native`)

    def fork(self) -> LlamaFamilyRuntime:
        """The same layers and stacked projections (shared, not copied), a new empty cache, no compiled step."""
        other = copy.copy(self)
        other.cache = self.cache.empty_like()
        other.compiled = None
        other.padded = None if self.padded is None else CompiledStep(other, compile=False)
        return other

    def release(self) -> None:
        # A compiled step was traced over this cache's tensors: it keeps them (emptied) rather than recompile.
        if self.compiled is None:
            self.cache = self.cache.empty_like()
        else:
            self.cache.truncate(0)

    def refresh_fused(self) -> None:
        """Rebuild the stacked projections of any layer whose linears were replaced (a later requantization), and
        the native stack over them."""
        for i, layer in enumerate(self.layers):
            if not self.fused[i].built_from(layer):
                self.fused[i] = FusedProjections(layer)
                self._native = False

    def native(self) -> NativeDecoder | None:
        """The native stack over these layers (`specula.runtime.native_decoder`), built on first use; None where
        they run from Python."""
        if self._native is False:
            self._native = NativeDecoder.build(self.layers, self.fused, self.windows, self.apply_rope, self.cache)
        return self._native

    @property
    def length(self) -> int:
        return self.cache.length

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def reserve(self, tokens: int) -> None:
        self.cache.reserve(tokens)

    def commit(self, keep: list[int] | None) -> None:
        self.cache.commit(keep)

    def forward(self, tokens, positions, block_mask, features: FeatureRequest,
                last_logits_only: bool = False) -> ForwardOutput:
        padded = self.compiled or self.padded
        if padded is not None and padded.accepts(tokens.shape[0]) and not last_logits_only:
            return padded(tokens, positions, block_mask, features)
        prefix = self.cache.length
        masks = {w: block_attention_mask(prefix, positions, block_mask, w) for w in set(self.windows)}
        causal = block_mask is None and prefix == 0
        self.refresh_fused()
        last = tokens.new_full((1,), tokens.shape[0] - 1) if last_logits_only else None
        native = self.native()
        if native is not None and not native.takes(tokens.shape[0], masks[self.windows[0]], causal):
            native = None
        return self.run(tokens, positions, masks, causal, features, logit_rows=last, native=native)

    def run(self, tokens, positions, masks: dict, causal: bool, features: FeatureRequest,
            slots: SlotBlock | None = None, segments: dict | None = None,
            logit_rows: torch.Tensor | None = None, layer_step=None,
            native: NativeDecoder | None = None) -> ForwardOutput:
        """The decoder over a block: ``masks`` per attention window (`block_attention_mask`), ``slots`` as in
        `decoder_layer_step`, or ``segments`` (per attention window, a list of `Segment`) for a block that packs
        several sequences; the stacked projections as `refresh_fused` left them; ``logit_rows`` [r]: the only
        block rows whose logits are wanted (None: all); ``layer_step``: a compiled decoder layer
        (`compiled_step.slot_layer_step`) run for every layer of a ``slots`` block instead of `decoder_layer_step`;
        ``native``: the native stack (`native`), which takes this block (every packed one of ``segments``),
        instead of either."""
        base = self.model.model
        x = base.embed_tokens(tokens[None])
        cos, sin = base.rotary_emb(x, positions[None])
        if native is not None and segments is not None:
            x, layer_inputs = native.run_packed(x, cos, sin, segments[None], features.layer_inputs)
        elif native is not None:
            x, layer_inputs = native.run(x, cos, sin, self.cache, masks[None], features.layer_inputs)
        else:
            layer_inputs = {}
            for i, layer in enumerate(self.layers):
                if i in features.layer_inputs:
                    layer_inputs[i] = x[0]
                if layer_step is not None:
                    x = layer_step(layer, self.fused[i], x, cos, sin, self.cache.keys[i], self.cache.values[i],
                                   masks[None], slots, self.apply_rope)
                    continue
                window = self.windows[i]
                x = decoder_layer_step(layer, x, cos, sin, self.cache, i, masks.get(window), causal, self.apply_rope,
                                       fused=self.fused[i], slots=slots, segments=segments and segments[window])
        hidden = base.norm(x)[0]
        logits = self.model.lm_head(hidden if logit_rows is None else hidden[logit_rows])
        return ForwardOutput(logits, hidden if features.final_hidden else None, layer_inputs)


class GenericRuntime:
    """Any `transformers` causal LM that accepts a 4-D attention mask, through its own forward."""

    def __init__(self, model, capacity: int):
        from transformers import DynamicCache  # only here: a Llama-family target runs without transformers' modules

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.block = 0

    def fork(self) -> GenericRuntime:
        return GenericRuntime(self.model, 0)

    def release(self) -> None:
        self.truncate(0)  # a new, empty DynamicCache

    def truncate(self, length: int) -> None:
        if length == 0:
            self.cache = type(self.cache)(config=self.model.config)
        else:
            self._crop(length)
        self.length = length
        self.block = 0

    def reserve(self, tokens: int) -> None:
        """A `DynamicCache` grows by itself."""

    def commit(self, keep: list[int] | None) -> None:
        start = self.length
        if keep is None:
            keep = list(range(self.block))
        if keep != list(range(len(keep))):
            source = torch.tensor(keep, device=self.model.device) + start
            for layer in self.cache.layers:
                layer.keys[:, :, start:start + len(keep)] = layer.keys[:, :, source]
                layer.values[:, :, start:start + len(keep)] = layer.values[:, :, source]
        self._crop(start + len(keep))
        self.length = start + len(keep)
        self.block = 0

    def _crop(self, length: int) -> None:
        # Slicing directly: DynamicCache.crop changed meaning between transformers releases.
        for layer in self.cache.layers:
            if layer.keys is not None:
                layer.keys = layer.keys[:, :, :length]
                layer.values = layer.values[:, :, :length]

    def forward(self, tokens, positions, block_mask, features: FeatureRequest,
                last_logits_only: bool = False) -> ForwardOutput:
        n, start = tokens.shape[0], self.length
        mask = torch.ones(n, start + n, dtype=torch.bool, device=tokens.device)
        if block_mask is None:
            block_mask = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
        mask[:, start:] = block_mask
        want_hidden = features.final_hidden or bool(features.layer_inputs)
        out = self.model(
            input_ids=tokens[None], attention_mask=mask[None, None], position_ids=positions[None],
            past_key_values=self.cache, use_cache=True, output_hidden_states=want_hidden,
        )
        self.block = n
        layer_inputs = {i: out.hidden_states[i][0] for i in features.layer_inputs} if want_hidden else {}
        hidden = None
        if features.final_hidden:
            # hidden_states[-1] is the last layer's output before the final norm in most models.
            hidden = final_norm(self.model)(out.hidden_states[-1])[0]
        return ForwardOutput(out.logits[0, -1:] if last_logits_only else out.logits[0], hidden, layer_inputs)


def final_norm(model):
    base = getattr(model, model.base_model_prefix, model)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        module = getattr(base, name, None)
        if module is not None:
            return module
    raise SpeculaError(f"cannot find the final norm of {type(model).__name__} to expose its features")
