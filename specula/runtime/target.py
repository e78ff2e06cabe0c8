"""The target model: a local Hugging Face causal LM run over token trees with a preallocated KV cache.

`Target.forward` appends a block of n tokens after the committed prefix (`specula.runtime.forward`: the
block mask, positions and the two runtimes); `commit` keeps the chosen entries, moving them next to the
prefix (cost proportional to the kept count, not the cache length). Loading and its checks live in
`specula.runtime.loading`; the weight format arrives resolved (`specula.methods.build_speculator`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path

import torch

from specula.chat.template import end_of_turn_ids
from specula.errors import SpeculaError
from specula.kernels import has_cpp_compiler
from specula.runtime.compiled_step import CompiledStep, warm_up_blocks
from specula.runtime.decode_threads import decode_threads, spare_cpus
from specula.runtime.forward import (
    LLAMA_FAMILY,
    FeatureRequest,
    ForwardOutput,
    GenericRuntime,
    LlamaFamilyRuntime,
    hidden_dtype,
)
from specula.runtime.loading import load_converted_lm
from specula.runtime.model_source import gguf_source, model_name
from specula.runtime.weights import WEIGHT_FORMATS

DEFAULT_MAX_CACHE = 8192
# A prompt of at least this many tokens runs on every CPU of a small machine (`prompt_threads`). SmolLM2 q4_1 eager
# prompts of 8 / 16 / 32 / 64 / 128 tokens, best of 3 in 3 rounds: 20-25 / 27-28 / 42-43 / 72-73 / 141-151 ms on one
# thread, 16 / 20-22 / 30-31 / 47-57 / 87-88 ms on two (2-core AMD EPYC, passive waiting).
PROMPT_THREADS_FROM = 8
# Blocks of at most this many rows (decode and verify steps) run on the threads `decode_threads` times.
DECODE_ROWS = 64

__all__ = ["FeatureRequest", "ForwardOutput", "Target"]  # the forward's types, as Target's signatures use them


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
        runtime = LlamaFamilyRuntime if self.config.model_type in LLAMA_FAMILY else GenericRuntime
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
        if weights not in WEIGHT_FORMATS[1:]:  # resolved once, at the edge (`specula.methods.build_speculator`)
            raise SpeculaError(f"a target loads in a concrete weights format ({', '.join(WEIGHT_FORMATS[1:])}), "
                               f"got {weights!r}: resolve auto with specula.runtime.weights.resolve_weights")
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
        if not isinstance(self.runtime, LlamaFamilyRuntime):
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
        features a drafter asks for (the compiled cache has one size: `compiled_step`).

        Nothing to do unless the target is `compile`d. For a benchmark or a server, so that no timed request
        pays for a compilation (~15 s for the first shape cold on a small CPU, seconds for each next one and
        from Inductor's on-disk cache).
        Leaves the cache empty.
        """
        if not self.compiled:
            return
        tokens = torch.zeros(max_block + 1, dtype=torch.long, device=self.device)
        self.reset()
        self.prefill(tokens[:1], features)
        for size in warm_up_blocks(self.device, min(max_block, self.max_length - 1)):
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
        with forward_threads(n, last_logits_only, self.device):
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


def forward_threads(rows: int, prompt: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """The threads a forward over ``rows`` rows runs on (``prompt``: it carries a prompt): a decode or verify step
    (at most `DECODE_ROWS` rows, no prompt) on those `decode_threads` times; a prompt, or any larger block, on a
    prompt's (`prompt_threads`). One rule for a sequence's forward and a packed one (`specula.runtime.packed`), whose
    steps ran on one thread whatever the machine until session 39."""
    if rows <= DECODE_ROWS and not prompt:
        return decode_threads(device)
    return prompt_threads(rows, device)


@contextlib.contextmanager
def prompt_threads(tokens: int, device: torch.device) -> Iterator[None]:
    """Run a prompt of ``tokens`` tokens on every CPU of a machine of at most two (`specula.openmp.few_cpus`) when
    ``device`` is that machine's CPU, where decoding runs on one thread: a prompt's matmuls are large enough for the
    second core to pay (SmolLM2 q4_1, an 800-token prompt: 1.38-1.42 s on one thread, 0.81-0.89 s on two, 2-core AMD
    EPYC). Every kernel a prompt runs computes each output on one thread in a fixed order, so the logits and the
    cache are the same bits either way (`tests/test_startup.py`). Shorter blocks, GPUs, larger machines, an
    ``OMP_NUM_THREADS`` of the user's and a thread count the user chose (``--threads N``, ``specula.load(threads=N)``,
    ``bench``'s threads: `spare_cpus`) are left as they are: a second thread the user did not
    ask for spins between the prompt's calls on the core another process (a bench's llama.cpp row, a test suite's
    other worker) was promised."""
    cpus, current = spare_cpus(device) if tokens >= PROMPT_THREADS_FROM else None, torch.get_num_threads()
    if cpus is None:
        yield
        return
    torch.set_num_threads(cpus)
    try:
        yield
    finally:
        torch.set_num_threads(current)
