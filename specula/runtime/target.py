"""The target model: a local Hugging Face causal LM run over token trees with a preallocated KV cache.

`Target.forward` appends a block of n tokens after the committed prefix. Each
block token attends to the whole prefix and to the block tokens its
``block_mask`` allows (its ancestors in a draft tree, or the causal triangle of
a chain); its position id is prefix length + depth. Keys and values of the
block are written to cache slots [length, length + n) and stay provisional
until `commit` keeps the chosen ones (moving them next to the prefix: cost
proportional to the kept count, not the cache length).

Two runtimes share this contract:
- `_LlamaFamilyRuntime` drives the decoder layers of Llama, Mistral, Qwen2 and
  Qwen3 checkpoints directly with a static cache and one SDPA call per layer
  (the gpt-fast recipe), reusing the `transformers` modules' weights, rotary
  embedding and norms so the numbers match `transformers`.
- `_GenericRuntime` calls the `transformers` model itself with a 4-D mask and a
  `DynamicCache`, for any other causal LM that accepts 4-D attention masks.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specula.chat.template import end_of_turn_ids
from specula.errors import SpeculaError
from specula.files.readers import check_fields, check_safetensors, expect_object, open_safetensors
from specula.kernels import has_cpp_compiler
from specula.runtime.compiled_step import BLOCK_BUCKETS, CACHE_STEP, CompiledStep
from specula.runtime.model_source import gguf_source, model_name, resolve_model
from specula.runtime.profile import load_profile
from specula.runtime.static_cache import (
    FusedProjections,
    SlotBlock,
    StaticKVCache,
    block_attention_mask,
    decoder_layer_step,
    rotary_function,
)
from specula.runtime.streamed_load import load_converted
from specula.runtime.weights import quantize_linear_weights, resolve_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LLAMA_FAMILY = {"llama", "mistral", "qwen2", "qwen3"}
DEFAULT_MAX_CACHE = 8192


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


def resolve_dtype(name: str | torch.dtype, model_dir: Path) -> torch.dtype:
    """``auto`` means the dtype the weights are stored in; else one of DTYPES."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return _stored_dtype(model_dir)
    if name not in DTYPES:
        raise SpeculaError(f"unknown dtype '{name}'; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _stored_dtype(model_dir: Path) -> torch.dtype:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return torch.float32
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    with open_safetensors(files[0], "weights file") as weights:
        for key in weights.keys():
            stored = names.get(weights.get_slice(key).get_dtype())
            if stored is not None:
                return stored
    return torch.float32


def check_model_dir(path: str | Path, role: str = "model") -> Path:
    """A local directory holding a Hugging Face causal-LM config, or a SpeculaError.

    ``path`` may also be a GGUF file or a model id in the local Hugging Face cache
    (`specula.runtime.model_source.resolve_model`); the directory it stands for is returned.
    """
    model_dir = resolve_model(path, role)
    if not model_dir.is_dir():
        raise SpeculaError(f"{role} directory not found: {path}")
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise SpeculaError(f"{role} directory {path} has no config.json (not a Hugging Face model directory)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeculaError(f"{role} config {config_file} is not valid JSON: {err}") from err
    check_fields(expect_object(config, f"{role} config {config_file}"), f"{role} config {config_file}")
    return model_dir


def hidden_dtype(model) -> torch.dtype:
    """The dtype of the model's hidden states (and KV cache): what its embedding outputs. Not its first
    parameter's: with a block embedding (`specula.gguf.block_embedding`, buffers only) the first parameter can be a
    bfloat16 linear's weight while the states stay float32."""
    embedding = model.get_input_embeddings()
    return getattr(embedding, "dtype", None) or embedding.weight.dtype


def load_causal_lm(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                   role: str = "model"):
    """Load (model, tokenizer) from a local directory; never touches the network."""
    model, tokenizer, _ = load_converted_lm(path, dtype, device, role)
    return model, tokenizer


def load_converted_lm(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
                      role: str = "model", weights: str = "float32", gguf_file: str | Path | None = None):
    """Load (model, tokenizer, WeightsReport) with the linears (layers, LM head) in ``weights`` (`runtime.weights`).

    On a CPU, a Llama-family safetensors checkpoint is converted layer by layer as it is read
    (`specula.runtime.streamed_load`: peak memory near the converted model's, not the float model's); otherwise
    the float model is loaded whole and converted after. Never touches the network.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers import logging as hf_logging

    weights = resolve_weights(weights)
    model_dir = check_model_dir(path, role)
    for file in sorted(model_dir.glob("*.safetensors")):  # a truncated file is named, not a library traceback
        check_safetensors(file, f"{role} weights file")
    torch_dtype = resolve_dtype(dtype, model_dir)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise SpeculaError(f"{role} config in {path} cannot be read: {str(err).splitlines()[0]}") from err
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    # BERT-like encoders register an "LM head" causal class too, but attend both ways unless built as decoders.
    encoder = type(config) in MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING or encoder:
        raise SpeculaError(
            f"{role} in {path} is not a causal language model (model_type '{config.model_type}')"
        )
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # a per-tensor bar for a local load is noise
    converted = None
    try:
        if weights != "float32" and config.model_type in LLAMA_FAMILY and torch.device(device).type == "cpu":
            converted = load_converted(model_dir, config, torch_dtype, weights, gguf_file)
        if converted is None:
            # Mismatched shapes are loaded as reinitialised and reported, so that they are refused below by name.
            model, loading = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch_dtype, local_files_only=True, attn_implementation="sdpa",
                output_loading_info=True, ignore_mismatched_sizes=True,
            )
            check_loading(loading, role, path)
        else:
            model, report = converted
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except SpeculaError:
        raise
    except Exception as err:  # torch pickles, tokenizer files and loaders fail in many ways on damaged files
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpeculaError(f"cannot load {role} from {path}: {reason}") from err
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    try:
        model.to(device).eval()
    except (RuntimeError, AssertionError) as err:
        raise SpeculaError(f"device '{device}' is not usable: {str(err).splitlines()[0]}") from err
    model.requires_grad_(False)
    if converted is None:
        report = quantize_linear_weights(model, weights, lm_head=True, gguf_file=gguf_file)
    return model, tokenizer, report


def check_loading(loading: dict, role: str, path: str | Path) -> None:
    """Refuse weights that lack a tensor the architecture expects, hold one of another shape, or unknown ones.

    ``loading`` is the loading info of `from_pretrained(output_loading_info=True)`; transformers already
    leaves out tensors that are legitimately absent (tied weights, ignorable buffers).
    """
    problems = []
    missing = sorted(loading.get("missing_keys") or ())
    if missing:
        problems.append(f"{len(missing)} missing tensor{'s' * (len(missing) > 1)} ({', '.join(missing[:3])})")
    mismatched = sorted(loading.get("mismatched_keys") or (), key=lambda entry: str(entry[0]))
    if mismatched:
        name, stored, expected = mismatched[0]
        problems.append(f"{len(mismatched)} tensor{'s' * (len(mismatched) > 1)} of the wrong shape ({name} is "
                        f"{tuple(stored)}, the config implies {tuple(expected)})")
    unexpected = sorted(loading.get("unexpected_keys") or ())
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor{'s' * (len(unexpected) > 1)} "
                        f"({', '.join(unexpected[:3])})")
    if problems:
        raise SpeculaError(f"the weights of {role} {path} do not match its config.json: {'; '.join(problems)}")


class Target:
    """A causal LM with a tree-capable forward and a preallocated KV cache (batch size 1)."""

    def __init__(self, model, tokenizer=None, max_length: int | None = None, name: str = "model"):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = hidden_dtype(model)
        head = model.get_output_embeddings()  # a quantized head (specula.runtime.weights) has no float weight
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        self.weights = "float32"  # the format of the linear weights (decoder layers and LM head; runtime.weights)
        position_limit = getattr(self.config, "max_position_embeddings", None) or DEFAULT_MAX_CACHE
        self.max_length = int(min(position_limit, max_length or DEFAULT_MAX_CACHE))
        runtime = _LlamaFamilyRuntime if self.config.model_type in LLAMA_FAMILY else _GenericRuntime
        self.runtime = runtime(model, self.max_length)
        self.eos_token_ids = end_of_turn_ids(tokenizer, model)  # EOS, and a chat template's end-of-turn token

    @classmethod
    def load(cls, path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
             max_length: int | None = None, role: str = "target", weights: str = "float32",
             gguf_blocks: bool = True) -> Target:
        """Load a target; ``weights`` is the format of its linears, LM head included (`specula.runtime.weights`).

        gguf_blocks: when the target is a GGUF file, use its own blocks where they give the same model: Q4_0/Q4_1
        linears with int4 or q4_1 weights (rather than requantizing their dequantized values), and a Q8_0 embedding
        with any format but float32 (`specula.gguf.block_embedding`: a quarter of the memory, the same rows).
        """
        # An unknown format fails before the model loads; auto is the hardware profile's measured choice.
        weights = resolve_weights(weights, load_profile(model_name(path)) if weights == "auto" else None, device)
        source = gguf_source(path) if gguf_blocks and weights != "float32" else None
        model, tokenizer, report = load_converted_lm(path, dtype, device, role, weights, source)
        loaded = cls(model, tokenizer, max_length, name=model_name(path))
        loaded.path = Path(path)  # where it came from: bundled heads are found by it
        loaded.weights, loaded.weights_report = weights, report
        return loaded

    def compile(self) -> None:
        """Run blocks of up to 64 tokens (decode and verify steps) compiled by `torch.compile`, with static
        shapes (`specula.runtime.compiled_step`); longer blocks (prefills) stay eager. Each new shape compiles once.
        The weights must not change afterwards: the compiled steps do not check the model's modules again."""
        if not isinstance(self.runtime, _LlamaFamilyRuntime):
            raise SpeculaError(f"a compiled step needs a Llama-family target ({', '.join(sorted(LLAMA_FAMILY))}); "
                               f"{self.name} is {self.config.model_type}")
        if self.device.type == "cpu" and not has_cpp_compiler():
            # Inductor writes C++ for a CPU and would fail at the first step with a long traceback.
            raise SpeculaError("a compiled step on a CPU needs a C++ compiler on PATH (g++, clang++ or $CXX) for "
                               "torch.compile; install one or leave out --compile")
        if self.runtime.compiled is None:
            self.runtime.compiled = CompiledStep(self.runtime)

    def warm_up(self, max_block: int, features: FeatureRequest = FeatureRequest()) -> None:
        """Compile now the steps a run will meet: every padded block size up to ``max_block`` tokens, with the
        features a drafter asks for, at the cache size a generation of up to `CACHE_STEP` tokens allocates.

        Nothing to do unless the target is `compile`d. For a benchmark or a server, so that no timed request
        pays for a compilation (~2 min per shape cold on 2 cores, seconds from Inductor's on-disk cache).
        Leaves the cache empty.
        """
        if not self.compiled:
            return
        tokens = torch.zeros(max_block + 1, dtype=torch.long, device=self.device)
        self.reset()
        self.reserve(min(CACHE_STEP, self.max_length))
        self.prefill(tokens[:1], features)
        for size in (b for b in BLOCK_BUCKETS if b <= min(max_block, self.max_length - 1)):
            self.forward(tokens[1:size + 1], features=features)
            self.commit([])
        self.reset()

    def fork(self) -> Target:
        """Another target over the same model and weights with its own empty KV cache: one per sequence when
        several generate at once (`specula.runtime.packed`). Forks run eager (a compiled step belongs to one cache)."""
        other = copy.copy(self)
        other.runtime = self.runtime.fork()
        return other

    @property
    def compiled(self) -> bool:
        """Whether decode and verify steps run compiled (`compile`)."""
        return getattr(self.runtime, "compiled", None) is not None

    @property
    def length(self) -> int:
        """Number of committed tokens in the cache."""
        return self.runtime.length

    def reset(self) -> None:
        self.runtime.truncate(0)

    def release(self) -> None:
        """Forget every token and give back the KV memory a long sequence grew (the cache keeps its first
        allocation); for a slot that may sit idle, e.g. a server's between requests."""
        self.runtime.release()

    def reserve(self, tokens: int) -> None:
        """Allocate the KV cache for ``tokens`` entries now (capped at `max_length`); it also grows on demand."""
        self.runtime.reserve(min(tokens, self.max_length))

    def truncate(self, length: int) -> None:
        """Forget committed tokens beyond ``length``."""
        self.runtime.truncate(min(length, self.runtime.length))

    @torch.no_grad()  # not inference_mode: trainers feed these features to autograd
    def forward(self, tokens: torch.Tensor, block_mask: torch.Tensor | None = None,
                depths: list[int] | torch.Tensor | None = None,
                features: FeatureRequest = FeatureRequest(), last_logits_only: bool = False) -> ForwardOutput:
        """Run ``tokens`` [n] after the committed prefix.

        block_mask: bool [n, n], which block tokens each block token sees; None = causal chain.
        depths:     [n] offsets of the positions from the prefix length; None = 0..n-1.
        last_logits_only: logits [1, V] of the last token only (a prompt: the LM head is ~20 % of SmolLM2's
                    weights, and a 1,000-token prompt's logits are 200 MB).
        """
        n = int(tokens.shape[0])
        if self.length + n > self.max_length:
            raise SpeculaError(f"context of {self.length + n} tokens exceeds the limit of {self.max_length}")
        if depths is None:
            positions = torch.arange(self.length, self.length + n, device=self.device)
        else:
            positions = self.length + torch.as_tensor(depths, device=self.device)
        return self.runtime.forward(tokens.to(self.device), positions, block_mask, features, last_logits_only)

    @torch.no_grad()  # not inference_mode: trainers feed these features to autograd
    def commit(self, keep: list[int] | None = None) -> None:
        """Keep block entries ``keep`` (indices into the last block, in order); None keeps the whole block."""
        self.runtime.commit(keep)

    def prefill(self, tokens: torch.Tensor, features: FeatureRequest = FeatureRequest()) -> ForwardOutput:
        """Start over with ``tokens`` [P] as the whole context; all of it is committed."""
        self.reset()
        out = self.forward(tokens, features=features)
        self.commit()
        return out


class _LlamaFamilyRuntime:
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

    def fork(self) -> _LlamaFamilyRuntime:
        """The same layers and stacked projections (shared, not copied), a new empty cache, no compiled step."""
        other = copy.copy(self)
        other.cache = self.cache.empty_like()
        other.compiled = None
        return other

    def release(self) -> None:
        # A compiled step was traced over this cache's tensors: it keeps them (emptied) rather than recompile.
        if self.compiled is None:
            self.cache = self.cache.empty_like()
        else:
            self.cache.truncate(0)

    def refresh_fused(self) -> None:
        """Rebuild the stacked projections of any layer whose linears were replaced (a later requantization)."""
        for i, layer in enumerate(self.layers):
            if not self.fused[i].built_from(layer):
                self.fused[i] = FusedProjections(layer)

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
        if self.compiled is not None and self.compiled.accepts(tokens.shape[0]) and not last_logits_only:
            return self.compiled(tokens, positions, block_mask, features)
        prefix = self.cache.length
        masks = {w: block_attention_mask(prefix, positions, block_mask, w) for w in set(self.windows)}
        causal = block_mask is None and prefix == 0
        self.refresh_fused()
        last = tokens.new_full((1,), tokens.shape[0] - 1) if last_logits_only else None
        return self.run(tokens, positions, masks, causal, features, logit_rows=last)

    def run(self, tokens, positions, masks: dict, causal: bool, features: FeatureRequest,
            slots: SlotBlock | None = None, segments: dict | None = None,
            logit_rows: torch.Tensor | None = None) -> ForwardOutput:
        """The decoder over a block: ``masks`` per attention window (`block_attention_mask`), ``slots`` as in
        `decoder_layer_step`, or ``segments`` (per attention window, a list of `Segment`) for a block that packs
        several sequences; the stacked projections as `refresh_fused` left them; ``logit_rows`` [r]: the only
        block rows whose logits are wanted (None: all). Plain tensor code from embedding to logits, so that it
        compiles whole."""
        base = self.model.model
        x = base.embed_tokens(tokens[None])
        cos, sin = base.rotary_emb(x, positions[None])
        layer_inputs = {}
        for i, layer in enumerate(self.layers):
            if i in features.layer_inputs:
                layer_inputs[i] = x[0]
            window = self.windows[i]
            x = decoder_layer_step(layer, x, cos, sin, self.cache, i, masks.get(window), causal, self.apply_rope,
                                   fused=self.fused[i], slots=slots, segments=segments and segments[window])
        hidden = base.norm(x)[0]
        logits = self.model.lm_head(hidden if logit_rows is None else hidden[logit_rows])
        return ForwardOutput(logits, hidden if features.final_hidden else None, layer_inputs)


class _GenericRuntime:
    """Any `transformers` causal LM that accepts a 4-D attention mask, through its own forward."""

    def __init__(self, model, capacity: int):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.length = 0
        self.block = 0

    def fork(self) -> _GenericRuntime:
        return _GenericRuntime(self.model, 0)

    def release(self) -> None:
        self.truncate(0)  # a new, empty DynamicCache

    def truncate(self, length: int) -> None:
        from transformers import DynamicCache

        if length == 0:
            self.cache = DynamicCache(config=self.model.config)
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
            hidden = _final_norm(self.model)(out.hidden_states[-1])[0]
        return ForwardOutput(out.logits[0, -1:] if last_logits_only else out.logits[0], hidden, layer_inputs)


def _final_norm(model):
    base = getattr(model, model.base_model_prefix, model)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        module = getattr(base, name, None)
        if module is not None:
            return module
    raise SpeculaError(f"cannot find the final norm of {type(model).__name__} to expose its features")
