"""A Hugging Face Llama target as a GGUF file that llama.cpp runs (``llama-server -m FILE.gguf``).

`export_llama_gguf(model_dir, out_file)` writes the ``llama`` architecture as llama.cpp's own
converter does for a plain Llama (``convert_hf_to_gguf.py``, class ``LlamaModel``): the
hyper-parameters under ``llama.*``, the tensors under llama.cpp's names (``token_embd``,
``blk.N.attn_q`` ..., ``output_norm``, ``output`` unless the embedding is tied), Q and K rows
permuted from Hugging Face's half-split RoPE layout into llama.cpp's adjacent pairs
(`specula.gguf.heads.permute_rope_rows`), and the tokenizer by the converter's rules
(`specula.gguf.vocab.add_hf_vocab`: SentencePiece or Llama-style BPE; other tokenizers are
refused there). Weights stay F32 by default, so that llama.cpp computes with the very weights
our float32 target uses; 1-D tensors and norms are F32 at any type.

It exists so that `specula bench`'s llama.cpp rows can run targets that come as Hugging Face
directories (stories260k, llama2xs as a draft); a target that already is a GGUF is run as it is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_gguf
from specula.gguf.heads import permute_rope_rows
from specula.gguf.vocab import add_hf_vocab, copy_gguf_vocab
from specula.heads.checkpoint import read_config

ARCH = "llama"
OUTTYPES = ("f32", "f16")
# Hugging Face names inside one decoder layer -> llama.cpp's (src/llama-arch.cpp, LLM_ARCH_LLAMA).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def _config(model_dir: Path) -> dict:
    config = read_config(model_dir, "model")
    if config.get("model_type") != "llama":
        raise SpeculaError(f"{model_dir} is a '{config.get('model_type')}' model; only Llama models can be exported "
                           "to GGUF here (give llama.cpp a GGUF of the model instead)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise SpeculaError(f"{model_dir} has attention or MLP biases, which llama.cpp's llama architecture lacks")
    if config.get("hidden_act", "silu") != "silu":
        raise SpeculaError(f"{model_dir} uses the activation {config['hidden_act']!r}; llama.cpp's llama uses SiLU")
    rope = rope_parameters(config)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SpeculaError(f"{model_dir} uses RoPE scaling {rope}, which this export does not write")
    return config


def rope_parameters(config: dict) -> dict:
    """RoPE settings wherever the config keeps them: ``rope_parameters`` (transformers 5) or the older
    top-level ``rope_theta`` and ``rope_scaling``."""
    return {"rope_theta": config.get("rope_theta", 10000.0), **(config.get("rope_scaling") or {}),
            **(config.get("rope_parameters") or {})}


def _state_dict(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the model's safetensors files as float32 numpy arrays (HF names)."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SpeculaError(f"{model_dir} has no .safetensors weights")
    state = {}
    for file in files:
        state.update({name: t.float().numpy() for name, t in load_file(file).items()})
    return state


def llama_tensors(state: dict[str, np.ndarray], config: dict) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 data) of every tensor llama.cpp loads, Q/K rows permuted to its RoPE layout."""
    heads, kv_heads = int(config["num_attention_heads"]), int(config.get("num_key_value_heads") or
                                                             config["num_attention_heads"])
    out = []
    for name, gguf_name in GLOBAL_NAMES.items():
        if name == "lm_head.weight" and (config.get("tie_word_embeddings") or name not in state):
            continue  # llama.cpp uses token_embd as the output matrix when there is no output.weight
        if name not in state:
            raise SpeculaError(f"the model has no tensor {name}")
        out.append((gguf_name, state[name]))
    for layer in range(int(config["num_hidden_layers"])):
        for name, gguf_name in LAYER_NAMES.items():
            full = f"model.layers.{layer}.{name}"
            if full not in state:
                raise SpeculaError(f"the model has no tensor {full}")
            data = state[full]
            if name == "self_attn.q_proj.weight":
                data = permute_rope_rows(data, heads)
            elif name == "self_attn.k_proj.weight":
                data = permute_rope_rows(data, kv_heads)
            out.append((f"blk.{layer}.{gguf_name}", data))
    return out


def build_writer(model_dir: Path, outtype: str = "f32", vocab_gguf: Path | None = None):
    """A `gguf.GGUFWriter` holding every key and tensor of the target's GGUF (nothing written yet).

    The tokenizer is copied from ``vocab_gguf`` when given (e.g. the GGUF the directory was
    dequantized from, for tokenizers `add_hf_vocab` cannot write), else built from the directory.
    """
    import gguf

    if outtype not in OUTTYPES:
        raise SpeculaError(f"unknown GGUF output type '{outtype}'; choose one of {', '.join(OUTTYPES)}")
    config = _config(model_dir)
    wide = gguf.GGMLQuantizationType.F16 if outtype == "f16" else gguf.GGMLQuantizationType.F32
    writer = gguf.GGUFWriter(path=None, arch=ARCH)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(model_dir.resolve().name)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    writer.add_context_length(int(config.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.get("num_key_value_heads") or heads))
    writer.add_rope_freq_base(float(rope_parameters(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if outtype == "f16" else gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, data in llama_tensors(_state_dict(model_dir), config):
        qtype = gguf.GGMLQuantizationType.F32 if data.ndim <= 1 or name.endswith("norm.weight") else wide
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
    if vocab_gguf is not None:
        copy_gguf_vocab(writer, gguf.GGUFReader(vocab_gguf))
    else:
        add_hf_vocab(writer, model_dir, int(config["vocab_size"]))
    return writer


def export_llama_gguf(model_dir: str | Path, out_file: str | Path, outtype: str = "f32",
                      vocab_gguf: str | Path | None = None) -> Path:
    """Write the Hugging Face Llama model in ``model_dir`` as a llama.cpp GGUF ``out_file`` (atomically)."""
    model_dir, out = Path(model_dir), Path(out_file)
    if out.suffix.lower() != ".gguf":
        raise SpeculaError(f"{out} must name a .gguf file")
    writer = build_writer(model_dir, outtype, None if vocab_gguf is None else Path(vocab_gguf))
    out.parent.mkdir(parents=True, exist_ok=True)

    atomic_write_gguf(out, writer)
    return out
