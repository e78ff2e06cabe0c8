"""The plain Llama-family model (`specula.runtime.plain_model`): the numbers of the `transformers` model it mirrors,
bit for bit, and a warm load that imports no `transformers` modelling code."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import STORIES, random_tree, tiny_model

from specula.runtime.plain_model import PlainCausalLM, from_transformers, transformers_model
from specula.runtime.target import FeatureRequest, Target
from specula.runtime.weights import quantize_linear_weights
from specula.tree import DraftTree

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
ROPES = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64, "rope_theta": 10000.0}}


def _outputs(target: Target, prompt: torch.Tensor, tree: DraftTree):
    """Prefill logits and features, then a draft tree's logits and features, of ``target``."""
    features = FeatureRequest(final_hidden=True, layer_inputs=(0, 2))
    first = target.prefill(prompt, features)
    second = target.forward(tree.tokens, tree.ancestor_mask(), tree.depths, features=features)
    return [first.logits, first.hidden, *first.layer_inputs.values(), second.logits, second.hidden]


@pytest.mark.parametrize("weights", ["float32", "int8", "q4_1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_plain_model_computes_the_bits_of_the_transformers_model(family, weights):
    overrides = {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1} if family == "qwen2" else {}
    model = tiny_model(family, seed=5, **overrides)
    quantize_linear_weights(model, weights, lm_head=True)
    plain = from_transformers(model)
    assert isinstance(plain, PlainCausalLM)
    prompt = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(0))
    tree = random_tree(9, 97, seed=1)
    ours, theirs = _outputs(Target(plain), prompt, tree), _outputs(Target(model), prompt, tree)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_plain_model_mirrors_a_llama3_rotary_embedding_and_declines_a_length_dependent_one():
    model = tiny_model("llama", seed=6, rope_scaling=ROPES["llama3"])
    plain = from_transformers(model)
    positions = torch.arange(200)[None]
    x = torch.zeros(1, 1, 64)
    assert all(torch.equal(a, b) for a, b in zip(plain.model.rotary_emb(x, positions),
                                                 model.model.rotary_emb(x, positions), strict=True))
    dynamic = tiny_model("llama", seed=6, rope_scaling={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    assert from_transformers(dynamic) is None


def test_the_transformers_twin_of_a_plain_model_generates_what_the_plain_target_decodes():
    model = tiny_model("llama", seed=7)
    quantize_linear_weights(model, "int8", lm_head=True)
    plain = from_transformers(model)
    twin = transformers_model(plain)
    assert twin is plain.to_transformers() and transformers_model(model) is model
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(2))
    expected = twin.generate(prompt[None], max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, 9:].tolist()
    target = Target(plain)
    tokens = [int(target.prefill(prompt).logits[-1].argmax())]
    for _ in range(11):
        logits = target.forward(torch.tensor(tokens[-1:])).logits[-1]
        target.commit()
        tokens.append(int(logits.argmax()))
    assert tokens == expected


def test_a_warm_load_imports_no_transformers_modelling_code(tmp_path):
    # Two processes: the first converts stories260k to int8 and keeps it, the second maps it back and decodes.
    script = textwrap.dedent(f"""
        import sys
        import torch
        from specula.runtime.target import Target
        target = Target.load({str(STORIES)!r}, dtype="float32", weights="int8")
        target.prefill(torch.tensor(target.tokenizer("Once upon a time").input_ids))
        print(type(target.model).__name__, sorted(m for m in sys.modules if m.startswith("transformers.models.")
                                                  and ("modeling" in m or "configuration" in m)))
    """)
    session_kernels = Path(os.environ["SPECULA_CACHE_DIR"]) / "kernels"
    if session_kernels.is_dir():  # built once for the session (conftest)
        (tmp_path / "kernels").symlink_to(session_kernels, target_is_directory=True)
    env = {**os.environ, "SPECULA_CACHE_DIR": str(tmp_path), "SPECULA_CONVERTED_CACHE": "1"}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env) for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[-1].stderr
    assert runs[0].stdout.startswith("PlainCausalLM")
    assert runs[1].stdout.strip() == "PlainCausalLM []", runs[1].stdout
