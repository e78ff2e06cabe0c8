"""Loading with the linears converted as they are read gives the model that loading whole and converting gives."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import STORIES, tiny_model
from safetensors.torch import load_file, save_file

from specula.errors import SpeculaError
from specula.runtime.loading import load_causal_lm
from specula.runtime.plain_model import PlainCausalLM, from_transformers
from specula.runtime.streamed_load import load_converted
from specula.runtime.target import Target
from specula.runtime.weights import quantize_linear_weights

FORMATS = ("bfloat16", "int8", "int4")


def loaded_whole_then_converted(model_dir: Path, fmt: str):
    model, _ = load_causal_lm(model_dir, "float32")
    report = quantize_linear_weights(model, fmt, lm_head=True)
    return model, report


def assert_same_model(streamed, whole) -> None:
    # `load_converted` gives the `transformers` model, a whole load its plain mirror (`specula.runtime.plain_model`)
    streamed, whole = (model if isinstance(model, PlainCausalLM) else from_transformers(model)
                       for model in (streamed, whole))
    ours, theirs = streamed.state_dict(), whole.state_dict()
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(ours[name], theirs[name]), name
    buffers = dict(whole.named_buffers())
    for name, buffer in streamed.named_buffers():  # non-persistent ones (rotary frequencies) included
        assert torch.equal(buffer, buffers[name]), name
    assert [type(m) for m in streamed.modules()] == [type(m) for m in whole.modules()]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tied_checkpoint_converted_while_read_equals_loading_it_whole_then_converting(fmt):
    from transformers import AutoConfig

    streamed, report = load_converted(STORIES, AutoConfig.from_pretrained(STORIES), torch.float32, fmt)
    whole, expected = loaded_whole_then_converted(STORIES, fmt)
    assert_same_model(streamed, whole)
    # The LM head is converted like the layers; the embedding it was tied to stays float32.
    assert report.converted[-1] == "lm_head" and streamed.get_input_embeddings().weight.dtype == torch.float32
    assert report.converted == expected.converted and report.bytes_after == expected.bytes_after
    assert streamed.generation_config.eos_token_id == whole.generation_config.eos_token_id


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_untied_checkpoint_with_biases_converted_while_read_equals_loading_it_whole(tmp_path, family):
    overrides = {"tie_word_embeddings": False, **({"attention_bias": True} if family == "llama" else {})}
    tiny_model(family, seed=5, **overrides).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # loading whole reads a tokenizer too
        shutil.copy(STORIES / name, tmp_path)
    model = load_converted(tmp_path, tiny_model(family, **overrides).config, torch.float32, "int8")[0]
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # qwen2 has q/k/v biases of its own
    assert_same_model(model, loaded_whole_then_converted(tmp_path, "int8")[0])


def test_target_load_converts_while_reading_and_decodes_like_before():
    target = Target.load(STORIES, dtype="float32", weights="int4")
    whole, _ = loaded_whole_then_converted(STORIES, "int4")
    assert_same_model(target.model, whole)
    assert target.weights == "int4" and len(target.weights_report.converted) == 5 * 7 + 1  # and the LM head


def test_a_checkpoint_it_cannot_stream_is_loaded_whole_and_still_refused_by_name(tmp_path):
    from transformers import AutoConfig

    model_dir = tmp_path / "extra"
    shutil.copytree(STORIES, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.mlp.surplus.weight"] = torch.zeros(2, 2)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert load_converted(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "int8") is None
    with pytest.raises(SpeculaError, match="1 unexpected tensor"):
        Target.load(model_dir, weights="int8")
