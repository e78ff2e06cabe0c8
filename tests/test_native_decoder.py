"""The native decoder stack computes exactly what the layers compute from Python, and takes only what it can.

Two loads of one target, one with the native stack and one without (``SPECULA_NATIVE_DECODER=0``), run the same
blocks (chains, a tree, a prompt after a prefix) after the same prompt: logits, final hidden states, the captured
layer inputs and the keys and values left in the cache must be `torch.equal`, on llama2xs and on the default model
in q4_1; so must the server's packed steps. Formats and layers it does not compute bit for bit keep the Python path.
"""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA2XS, STORIES

from specula.kernels import attention, float32, q4_1
from specula.runtime import native_decoder
from specula.runtime.forward import FeatureRequest
from specula.runtime.invariance import tree_block
from specula.runtime.packed import Block, forward_packed
from specula.runtime.quantized_linear import Q4_1Linear
from specula.runtime.target import Target

pytestmark = pytest.mark.skipif(q4_1.unavailable_reason() is not None or attention.unavailable_reason() is not None,
                                reason="the q4_1 and attention kernels are needed")

TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 3]


def load_pair(path, monkeypatch, weights: str = "q4_1") -> tuple[Target, Target]:
    native = Target.load(path, dtype="float32", weights=weights)
    with monkeypatch.context() as patch:
        patch.setenv("SPECULA_NATIVE_DECODER", "0")
        python = Target.load(path, dtype="float32", weights=weights)
        assert python.runtime.native() is None
    assert native.runtime.native() is not None
    return native, python


def blocks(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor | None, list[int] | None]]:
    generator = torch.Generator().manual_seed(0)
    mask, depths = tree_block(TREE_PARENTS)
    sizes = [1, 2, 4, 11, 22, 23, 64]  # 22+ rows: SiLU in row chunks (`rowwise`) on SmolLM2's 1,536 wide MLP
    chains = [(torch.randint(3, vocab, (n,), generator=generator), None, None) for n in sizes]
    return [*chains, (torch.randint(3, vocab, (len(TREE_PARENTS),), generator=generator), mask, depths)]


def assert_same_forwards(native: Target, python: Target, capture: tuple[int, ...]) -> None:
    prompt = torch.randint(3, native.vocab_size, (37,), generator=torch.Generator().manual_seed(1))
    features = FeatureRequest(final_hidden=True, layer_inputs=capture)
    for target in (native, python):
        target.prefill(prompt)
    for tokens, mask, depths in blocks(native.vocab_size):
        a = native.forward(tokens, mask, depths, features=features)
        b = python.forward(tokens, mask, depths, features=features)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
        assert a.layer_inputs.keys() == b.layer_inputs.keys() == set(capture)
        assert all(torch.equal(a.layer_inputs[i], b.layer_inputs[i]) for i in capture)
        for cache_a, cache_b in zip(native.runtime.cache.keys + native.runtime.cache.values,
                                    python.runtime.cache.keys + python.runtime.cache.values, strict=True):
            end = native.length + len(tokens)
            assert torch.equal(cache_a[:, :, :end], cache_b[:, :, :end])
        # Keep the first block row, as a verify pass that accepted nothing keeps the target's own token.
        native.commit([0])
        python.commit([0])


def test_llama2xs_in_q4_1_gives_the_python_layers_bits(monkeypatch):
    native, python = load_pair(LLAMA2XS, monkeypatch)
    assert_same_forwards(native, python, capture=(0, 2, 4))


@pytest.mark.skipif(float32.kernel() is None, reason="the row-invariant float32 kernel is needed")
@pytest.mark.parametrize("path", [STORIES, LLAMA2XS], ids=["stories260k", "llama2xs"])
def test_a_float32_target_gives_the_python_layers_bits(path, monkeypatch):
    """Float32 linears through the row-invariant float32 kernel, as `Float32Linear` calls it (stories260k's 172-wide
    MLP included: unlike q4_1's, a float32 linear pads nothing)."""
    native, python = load_pair(path, monkeypatch, weights="float32")
    assert_same_forwards(native, python, capture=(0, 2, 4))
    assert_same_packed_steps(native, python)


def test_the_default_model_in_q4_1_gives_the_python_layers_bits(smollm2, monkeypatch):
    from specula.methods import DEFAULT_TARGET

    native, python = load_pair(DEFAULT_TARGET, monkeypatch)
    assert_same_forwards(native, python, capture=(1, 15, 28))  # the layers the bundled EAGLE-3 head reads


def test_formats_and_layers_it_cannot_reproduce_run_from_python(monkeypatch):
    assert Target.load(LLAMA2XS, dtype="float32", weights="int8").runtime.native() is None
    monkeypatch.setattr(native_decoder, "float32_kernel", lambda: None)  # float32 linears through the BLAS
    assert Target.load(LLAMA2XS, dtype="float32", weights="float32").runtime.native() is None
    # stories260k's MLP is 172 wide: its q4_1 down projection pads its inputs, which the stack does not.
    assert Target.load(STORIES, dtype="float32", weights="q4_1").runtime.native() is None


def packed_outputs(base: Target, seed: int):
    """forward_packed over forks of ``base``: chains of 1, 6 and 3 tokens and a tree, after prompts of several
    lengths → (outputs, the forks)."""
    generator = torch.Generator().manual_seed(seed)
    mask, depths = tree_block(TREE_PARENTS)
    plans = [(17, 1, None, None), (40, 6, None, None), (30, len(TREE_PARENTS), mask, depths), (9, 3, None, None)]
    targets, blocks_ = [], []
    for prefix, n, block_mask, block_depths in plans:
        target = base.fork()
        target.prefill(torch.randint(3, base.vocab_size, (prefix,), generator=generator))
        targets.append(target)
        blocks_.append(Block(torch.randint(3, base.vocab_size, (n,), generator=generator), block_mask, block_depths,
                             FeatureRequest(final_hidden=True, layer_inputs=(1,))))
    return forward_packed(targets, blocks_), targets


@pytest.mark.parametrize("model", ["llama2xs", "smollm2"])
def test_a_packed_step_gives_the_python_layers_bits(model, request, monkeypatch):
    """The server's packed step (chains in one packed attention call, a tree alone) through the native stack."""
    if model == "smollm2":
        from specula.methods import DEFAULT_TARGET

        request.getfixturevalue("smollm2")
        path = DEFAULT_TARGET
    else:
        path = LLAMA2XS
    assert_same_packed_steps(*load_pair(path, monkeypatch))


def assert_same_packed_steps(native: Target, python: Target) -> None:
    (a, forks_a), (b, forks_b) = packed_outputs(native, 3), packed_outputs(python, 3)
    for out_a, out_b, fork_a, fork_b in zip(a, b, forks_a, forks_b, strict=True):
        assert torch.equal(out_a.logits, out_b.logits) and torch.equal(out_a.hidden, out_b.hidden)
        assert torch.equal(out_a.layer_inputs[1], out_b.layer_inputs[1])
        end = fork_a.length + len(out_a.logits)
        assert all(torch.equal(x[:, :, :end], y[:, :, :end]) for x, y in
                   zip(fork_a.runtime.cache.keys + fork_a.runtime.cache.values,
                       fork_b.runtime.cache.keys + fork_b.runtime.cache.values, strict=True))


def test_a_layer_whose_linear_is_replaced_is_run_with_the_new_one(monkeypatch):
    """The stack holds the linears it was built from: a replaced one (any of the seven) rebuilds it."""
    native, python = load_pair(LLAMA2XS, monkeypatch)
    before = native.runtime.native()
    torch.manual_seed(0)
    replacement = torch.nn.Linear(64, 64, bias=False)
    for target in (native, python):
        target.model.model.layers[2].self_attn.o_proj = Q4_1Linear.from_linear(replacement)
    assert_same_forwards(native, python, capture=())
    assert native.runtime.native() not in (None, before)
