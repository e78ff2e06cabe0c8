"""`specula.gguf.target`: a Hugging Face Llama directory as llama.cpp's ``llama`` GGUF, read back with `gguf`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import STORIES

from specula.errors import SpeculaError
from specula.gguf.target import export_llama_gguf


def read(path):
    from gguf import GGUFReader

    reader = GGUFReader(path)
    keys = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    return keys, tensors


def test_stories260k_is_written_with_llama_cpp_names_keys_and_rope_layout(tmp_path):
    from safetensors.torch import load_file

    keys, tensors = read(export_llama_gguf(STORIES, tmp_path / "stories.gguf"))
    assert keys["general.architecture"] == "llama"
    shape = keys["llama.block_count"], keys["llama.embedding_length"], keys["llama.feed_forward_length"]
    assert shape == (5, 64, 172)
    assert (keys["llama.attention.head_count"], keys["llama.attention.head_count_kv"]) == (8, 4)
    assert keys["llama.rope.freq_base"] == 10000.0 and keys["llama.context_length"] == 512
    assert keys["tokenizer.ggml.model"] == "llama" and len(keys["tokenizer.ggml.tokens"]) == 512
    per_layer = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down"}
    expected = {"token_embd.weight", "output_norm.weight"} | {f"blk.{i}.{n}.weight" for i in range(5)
                                                               for n in per_layer}
    assert set(tensors) == expected  # tied embedding: no output.weight, llama.cpp reuses token_embd
    assert all(t.tensor_type.name == "F32" for t in tensors.values())
    state = load_file(STORIES / "model.safetensors")
    q = state["model.layers.0.self_attn.q_proj.weight"].numpy()
    ours = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(q.shape)
    # llama.cpp's layout pairs (2i, 2i+1) of each head where Hugging Face pairs (i, i + d/2)
    heads, d = 8, 8
    back = ours.reshape(heads, d // 2, 2, 64).swapaxes(1, 2).reshape(q.shape)
    assert np.array_equal(back, q)
    assert np.array_equal(np.asarray(tensors["blk.0.attn_v.weight"].data).reshape(-1),
                          state["model.layers.0.self_attn.v_proj.weight"].numpy().reshape(-1))


def test_rope_base_is_read_from_transformers_5_rope_parameters(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(STORIES, model)
    config = json.loads((model / "config.json").read_text())
    config.pop("rope_theta")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0}
    (model / "config.json").write_text(json.dumps(config))
    keys, _ = read(export_llama_gguf(model, tmp_path / "m.gguf"))
    assert keys["llama.rope.freq_base"] == 100000.0


@pytest.mark.parametrize("change, fragment", [
    ({"model_type": "gpt2"}, "only Llama models"),
    ({"attention_bias": True}, "biases"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling"),
])
def test_models_llama_cpp_would_run_differently_are_refused(tmp_path, change, fragment):
    model = tmp_path / "model"
    shutil.copytree(STORIES, model)
    config = {**json.loads((model / "config.json").read_text()), **change}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpeculaError, match=fragment):
        export_llama_gguf(model, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()
