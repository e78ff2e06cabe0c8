"""EAGLE-3 checkpoint interop: the official / SGLang layout and the vLLM speculators layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import STORIES

from specula.cli import main
from specula.errors import SpeculaError
from specula.heads.eagle3_head import Eagle3Head
from specula.heads.formats import SPECULATORS_VERSION, convert, load_head

LAYERS = [1, 2, 4]  # inputs of decoder layers 1, 2 and 4 of stories260k's 5


def make_head(stories_target, draft_vocab: torch.Tensor | None = None) -> Eagle3Head:
    torch.manual_seed(0)
    return Eagle3Head.for_target(stories_target.config, draft_vocab=draft_vocab, feature_layers=LAYERS)


@pytest.fixture()
def head_dir(stories_target, tmp_path) -> Path:
    make_head(stories_target, torch.arange(1, 512, 3)).save_pretrained(tmp_path / "ours")
    return tmp_path / "ours"


def assert_same_head(a: Eagle3Head, b: Eagle3Head) -> None:
    assert a.feature_layers == b.feature_layers and a.draft_vocab_size == b.draft_vocab_size
    assert {k: v for k, v in a.config.items() if k != "torch_dtype"} == \
        {k: v for k, v in b.config.items() if k != "torch_dtype"}
    assert a.state_dict().keys() == b.state_dict().keys()
    for name, tensor in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], tensor), name


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_speculators_round_trip_and_config_fields(head_dir, stories_target, tmp_path):
    from safetensors.torch import load_file

    assert convert(head_dir, "speculators", tmp_path / "spec", target=STORIES, speculative_tokens=4) == "eagle3"
    config = read_json(tmp_path / "spec" / "config.json")
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_version"] == SPECULATORS_VERSION
    assert config["draft_vocab_size"] == 171 and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert config["norm_before_residual"] is False and config["embed_requires_grad"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["tie_word_embeddings"] is False
    assert (layer["hidden_size"], layer["vocab_size"], layer["num_attention_heads"], layer["num_key_value_heads"]) \
        == (64, 512, 8, 4)
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": str(STORIES.resolve()), "architectures": ["LlamaForCausalLM"]}

    tensors = load_file(str(tmp_path / "spec" / "model.safetensors"))
    assert set(tensors) == {
        "embed_tokens.weight", "fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight", "layers.0.hidden_norm.weight",
        "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight", "norm.weight",
        "lm_head.weight", "d2t", "t2d"}
    assert tensors["fc.weight"].shape == (64, 192) and tensors["layers.0.self_attn.q_proj.weight"].shape == (64, 128)
    assert tensors["lm_head.weight"].shape == (171, 64)
    assert torch.equal(tensors["embed_tokens.weight"], stories_target.model.get_input_embeddings().weight)
    d2t = tensors["d2t"]  # target id = draft id + d2t[draft id]
    assert torch.equal(torch.arange(171) + d2t, torch.arange(1, 512, 3))
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].sum() == 171

    assert convert(tmp_path / "spec", "eagle3", tmp_path / "back") == "speculators"
    assert_same_head(Eagle3Head.from_pretrained(head_dir), Eagle3Head.from_pretrained(tmp_path / "back"))


def test_full_vocabulary_head_round_trips_without_vocabulary_maps(stories_target, tmp_path):
    from safetensors.torch import load_file

    make_head(stories_target).save_pretrained(tmp_path / "ours")
    convert(tmp_path / "ours", "speculators", tmp_path / "spec", target=STORIES)
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "spec" / "model.safetensors")))
    assert read_json(tmp_path / "spec" / "config.json")["draft_vocab_size"] == 512
    assert_same_head(load_head(tmp_path / "ours"), load_head(tmp_path / "spec"))


def test_official_layout_names_the_fused_layers_in_each_servers_convention(head_dir, tmp_path):
    from safetensors.torch import load_file

    convert(head_dir, "eagle3", tmp_path / "official")
    config = read_json(tmp_path / "official" / "config.json")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 171
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYERS  # vLLM: the input of layer i
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]  # SGLang: the output of layer i
    assert "fc.weight" in load_file(str(tmp_path / "official" / "model.safetensors"))
    assert_same_head(load_head(head_dir), load_head(tmp_path / "official"))


def test_sglang_and_older_specula_configs_read_with_their_own_layer_convention(head_dir):
    config_file = head_dir / "config.json"
    config = read_json(config_file)
    del config["eagle_aux_hidden_state_layer_ids"]
    eagle_config = config.pop("eagle_config")
    # As SGLang / SpecForge write it: outputs of layers 0, 1, 3, no target_num_hidden_layers.
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": eagle_config["eagle_aux_hidden_state_layer_ids"]}
    config_file.write_text(json.dumps(config))
    assert Eagle3Head.from_pretrained(head_dir).feature_layers == LAYERS
    # As Specula wrote it before: the layer inputs themselves, beside target_num_hidden_layers.
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": LAYERS, "target_num_hidden_layers": 5}
    config_file.write_text(json.dumps(config))
    assert Eagle3Head.from_pretrained(head_dir).feature_layers == LAYERS
    # As the official EAGLE repository publishes it: no layers at all, so 2, N//2, N-3 of the target.
    del config["eagle_config"]
    config_file.write_text(json.dumps(config))
    assert Eagle3Head.from_pretrained(head_dir, num_target_layers=12).feature_layers == [2, 6, 9]


def test_official_checkpoint_with_its_own_embedding_loads(head_dir, stories_target):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(head_dir / "model.safetensors"))
    tensors["embed_tokens.weight"] = stories_target.model.get_input_embeddings().weight.detach().clone()
    save_file(tensors, str(head_dir / "model.safetensors"))
    assert Eagle3Head.from_pretrained(head_dir).fc.weight.shape == (64, 192)


def test_speculators_checkpoints_this_head_cannot_represent_are_refused(head_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    convert(head_dir, "speculators", tmp_path / "spec", target=STORIES)
    config_file, weights = tmp_path / "spec" / "config.json", tmp_path / "spec" / "model.safetensors"
    config = read_json(config_file)

    config_file.write_text(json.dumps(dict(config, draft_vocab_size=200)))
    with pytest.raises(SpeculaError, match="shape"):
        load_head(tmp_path / "spec")
    config_file.write_text(json.dumps(dict(config, norm_before_residual=True)))
    with pytest.raises(SpeculaError, match="norm_before_residual"):
        load_head(tmp_path / "spec")

    config_file.write_text(json.dumps(config))
    tensors = load_file(str(weights))
    save_file(dict(tensors, **{"fc.bias": torch.zeros(64)}), str(weights))
    assert load_head(tmp_path / "spec").draft_vocab_size == 171  # a zero bias (early releases) is harmless
    save_file(dict(tensors, **{"fc.bias": torch.ones(64)}), str(weights))
    with pytest.raises(SpeculaError, match="non-zero bias"):
        load_head(tmp_path / "spec")
    save_file(dict(tensors, **{"layers.1.mlp.up_proj.weight": torch.zeros(4, 4)}), str(weights))
    with pytest.raises(SpeculaError, match="does not match its config"):
        load_head(tmp_path / "spec")


def test_convert_cli_and_its_errors(head_dir, tmp_path, capsys):
    assert main(["convert", "--draft", str(head_dir), "--to", "speculators", "--target", str(STORIES),
                 "--out", str(tmp_path / "spec"), "--speculative-tokens", "5"]) == 0
    assert read_json(tmp_path / "spec" / "config.json")["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 5
    assert main(["convert", "--draft", str(tmp_path / "spec"), "--to", "eagle3", "--out", str(tmp_path / "back")]) == 0
    assert_same_head(load_head(head_dir), load_head(tmp_path / "back"))
    capsys.readouterr()

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(dict(read_json(head_dir / "config.json"), hidden_size=32)))
    (broken / "model.safetensors").write_bytes((head_dir / "model.safetensors").read_bytes())
    cases = [
        (["--draft", str(tmp_path / "missing"), "--to", "eagle3"], "does not exist"),
        (["--draft", str(head_dir), "--to", "onnx"], "invalid choice"),
        (["--draft", str(head_dir), "--to", "gguf"], "needs --target"),
        (["--draft", str(head_dir), "--to", "speculators"], "needs --target"),
        (["--draft", str(head_dir), "--to", "speculators", "--target", str(tmp_path / "nowhere")], "not found"),
        (["--draft", str(broken), "--to", "eagle3"], "shape"),
        (["--draft", str(head_dir), "--to", "eagle3", "--speculative-tokens", "0"], "must be >= 1"),
    ]
    for arguments, fragment in cases:
        assert main(["convert", *arguments, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("specula: error:") and fragment in lines[0], err
    assert not (tmp_path / "x").exists()
