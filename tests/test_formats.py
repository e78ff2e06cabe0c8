"""EAGLE-3 checkpoint interop: the official / SGLang layout and the vLLM speculators layout."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import STORIES

from specula.cli import main
from specula.errors import SpeculaError
from specula.formats import convert, load_head
from specula.heads.eagle3_head import Eagle3Head


@pytest.fixture()
def head_dir(stories_target, tmp_path):
    torch.manual_seed(0)
    head = Eagle3Head.for_target(stories_target.config, draft_vocab=torch.arange(1, 512, 3), feature_layers=[1, 2, 4])
    head.save_pretrained(tmp_path / "ours")
    return tmp_path / "ours"


def assert_same_head(a: Eagle3Head, b: Eagle3Head) -> None:
    assert a.feature_layers == b.feature_layers and a.draft_vocab_size == b.draft_vocab_size
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[name], tensor, msg=name)


def test_speculators_round_trip_and_config_fields(head_dir, tmp_path):
    from safetensors.torch import load_file

    assert convert(head_dir, "speculators", tmp_path / "spec", target=STORIES, speculative_tokens=4) == "eagle3"
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 171 and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert config["transformer_layer_config"]["hidden_size"] == 64
    assert config["transformer_layer_config"]["vocab_size"] == 512
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 4, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"] and spec["verifier"]["name_or_path"]
    tensors = load_file(str(tmp_path / "spec" / "model.safetensors"))
    assert {"embed_tokens.weight", "fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight",
            "layers.0.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(tensors)
    assert not any(name.startswith("midlayer.") for name in tensors)
    assert tensors["embed_tokens.weight"].shape == (512, 64)

    assert convert(tmp_path / "spec", "eagle3", tmp_path / "back") == "speculators"
    assert_same_head(Eagle3Head.from_pretrained(head_dir), Eagle3Head.from_pretrained(tmp_path / "back"))


def test_official_sglang_layout_round_trip(head_dir, tmp_path):
    convert(head_dir, "eagle3", tmp_path / "official")
    config = json.loads((tmp_path / "official" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 171
    assert_same_head(load_head(head_dir), load_head(tmp_path / "official"))


def test_speculators_checkpoint_whose_tensors_disagree_with_its_config_is_refused(head_dir, tmp_path):
    convert(head_dir, "speculators", tmp_path / "spec", target=STORIES)
    config_file = tmp_path / "spec" / "config.json"
    config = json.loads(config_file.read_text())
    config["draft_vocab_size"] = 200
    config_file.write_text(json.dumps(config))
    with pytest.raises(SpeculaError, match="shape"):
        load_head(tmp_path / "spec")


def test_convert_cli_and_its_errors(head_dir, tmp_path, capsys):
    assert main(["convert", "--draft", str(head_dir), "--to", "speculators", "--target", str(STORIES),
                 "--out", str(tmp_path / "spec")]) == 0
    assert (tmp_path / "spec" / "model.safetensors").is_file()
    capsys.readouterr()
    cases = [
        ["--draft", str(tmp_path / "missing"), "--to", "eagle3", "--out", str(tmp_path / "x")],
        ["--draft", str(head_dir), "--to", "gguf", "--out", str(tmp_path / "x")],
        ["--draft", str(head_dir), "--to", "speculators", "--out", str(tmp_path / "x")],
    ]
    for arguments in cases:
        assert main(["convert", *arguments]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specula: error:") and len(err.strip().splitlines()) == 1, err
