"""Converting EAGLE-3 draft heads between checkpoint layouts, for users who serve with vLLM or SGLang.

- ``eagle3``: the official EAGLE-3 layout, which SGLang loads as `LlamaForCausalLMEagle3`
  and vLLM as `Eagle3LlamaForCausalLM`; `Eagle3Head.save_pretrained` writes it. Llama
  config keys plus `draft_vocab_size`, the fused layers in both servers' conventions,
  tensors `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`.
- ``speculators``: the layout of vLLM's speculators library (`speculators_model_type:
  "eagle3"`, `architectures: ["Eagle3Speculator"]`): the layer's Llama config nested as
  `transformer_layer_config`, a `speculators_config` naming the algorithm, its greedy
  proposal method and the verifier, and tensors named `layers.0.*` instead of `midlayer.*`,
  plus the target's `embed_tokens.weight`.

docs/formats.md lists the sources (repository, path, commit) each name was checked against.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.files.outputs import prepare_output_dir
from specula.files.readers import open_safetensors, read_json_object
from specula.heads.checkpoint import load_checked, load_state_dict, read_config, save_checkpoint
from specula.heads.eagle3_head import ARCHITECTURE, Eagle3Head, default_feature_layers
from specula.heads.eagle_head import CONFIG_KEYS
from specula.runtime.loading import check_model_dir

FORMATS = ("eagle3", "speculators")
SPECULATORS_VERSION = "0.8.1"  # the latest speculators release on PyPI when these field names were checked
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
EMBEDDING = "embed_tokens.weight"


def read_format(directory: Path) -> str:
    """Which layout the checkpoint in ``directory`` holds, judged by its config.json."""
    if not directory.is_dir():
        raise SpeculaError(f"draft head directory {directory} does not exist")
    config = read_config(directory, "draft head")
    kind = config.get("speculators_model_type")
    if kind is None:
        return "eagle3"
    if kind != "eagle3":
        raise SpeculaError(f"{directory} is a speculators '{kind}' checkpoint; only eagle3 heads convert")
    return "speculators"


def load_head(directory: str | Path, num_target_layers: int | None = None,
              dtype: torch.dtype | None = None) -> Eagle3Head:
    """An EAGLE-3 head from a checkpoint in either layout (``num_target_layers`` fills in default layers).

    ``dtype``: the head's (default: the checkpoint's). Give the dtype it will run or train in rather than
    casting afterwards: a cast also rounds the rotary frequencies, which a bfloat16 checkpoint does not store.
    """
    directory = Path(directory)
    if read_format(directory) == "speculators":
        return load_speculators(directory, num_target_layers, dtype)
    return Eagle3Head.from_pretrained(directory, dtype=dtype, num_target_layers=num_target_layers)


def target_embedding(target_dir: Path) -> torch.Tensor:
    """The input embedding [V, H] of a local HF model, read without loading its other tensors when possible."""
    index = target_dir / "model.safetensors.index.json"
    files = [target_dir / "model.safetensors"]
    if index.is_file():
        weight_map = read_json_object(index, "safetensors index").get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise SpeculaError(f"safetensors index {index}: 'weight_map' must be a JSON object")
        files = [target_dir / str(f) for name, f in weight_map.items() if name.endswith(EMBEDDING)]
    for file in files:
        if file.is_file():
            with open_safetensors(file, "target weights file") as handle:
                name = next((n for n in handle.keys() if n.endswith(EMBEDDING)), None)
                if name is not None:
                    return handle.get_tensor(name)
    if (target_dir / "pytorch_model.bin").is_file():
        state = load_state_dict(target_dir)
        name = next((n for n in state if n.endswith(EMBEDDING)), None)
        if name is not None:
            return state[name]
    raise SpeculaError(f"no {EMBEDDING} found in the target model {target_dir}")


def speculators_config(head: Eagle3Head, target_dir: Path, speculative_tokens: int) -> dict:
    """config.json of ``head`` in the speculators layout, naming the target in ``target_dir`` as verifier."""
    target_config = read_config(target_dir, "target model")
    layer = {k: head.config[k] for k in CONFIG_KEYS if k in head.config}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                 tie_word_embeddings=False)
    return {
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [SPECULATORS_ARCHITECTURE],
        "transformer_layer_config": layer,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": int(head.config.get("target_hidden_size") or head.hidden_size),
        "eagle_aux_hidden_state_layer_ids": list(head.feature_layers),
        # vLLM assumes True when this is absent; our layer keeps the un-normalised hidden as residual.
        "norm_before_residual": False,
        "embed_requires_grad": False,
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_dir.resolve()),
                         "architectures": list(target_config.get("architectures") or [])},
        },
    }


def save_speculators(head: Eagle3Head, out: str | Path, target_dir: str | Path,
                     speculative_tokens: int = 3) -> None:
    """Write ``head`` in the speculators layout; the target supplies the embedding and the verifier fields."""
    if len(head.layers):
        raise SpeculaError(f"the head has {1 + len(head.layers)} decoder layers; the speculators layout written here "
                           "holds one")
    target_dir = check_model_dir(Path(target_dir), "target")
    embedding = target_embedding(target_dir)
    if tuple(embedding.shape) != (head.vocab_size, head.hidden_size):
        raise SpeculaError(f"the target's embedding {tuple(embedding.shape)} does not fit the head "
                           f"({head.vocab_size} tokens, hidden size {head.hidden_size})")
    state = {name.replace("midlayer.", "layers.0.", 1): tensor
             for name, tensor in head.state_dict().items() if "rotary_emb" not in name}
    state[EMBEDDING] = embedding.to(head.fc.weight.dtype)
    save_checkpoint(out, state, speculators_config(head, target_dir, speculative_tokens))


def load_speculators(directory: Path, num_target_layers: int | None = None,
                     dtype: torch.dtype | None = None) -> Eagle3Head:
    """An EAGLE-3 head from a speculators checkpoint (its stored embedding is dropped: the target's is used)."""
    config = read_config(directory, "speculators checkpoint")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict) or "draft_vocab_size" not in config:
        raise SpeculaError(f"speculators config in {directory} lacks transformer_layer_config or draft_vocab_size")
    for flag in ("norm_before_residual", "norm_before_fc"):
        if config.get(flag):
            raise SpeculaError(f"{directory} sets {flag}, a variant of the EAGLE-3 layer this head does not implement")
    if not num_target_layers:  # as speculators does: the verifier it names, when that is a local directory
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if verifier and (Path(verifier) / "config.json").is_file():
            num_target_layers = target_layer_count(Path(verifier))
    head_config = {k: v for k, v in layer.items() if k in CONFIG_KEYS}
    head_config.update(num_hidden_layers=1, draft_vocab_size=config["draft_vocab_size"],
                       architectures=[ARCHITECTURE], model_type="llama")
    if config.get("target_hidden_size") and config["target_hidden_size"] != head_config.get("hidden_size"):
        head_config["target_hidden_size"] = config["target_hidden_size"]
    layers = config.get("eagle_aux_hidden_state_layer_ids")
    if not layers:  # speculators then takes 2, N//2, N-3 of the verifier, as we do
        if not num_target_layers:
            raise SpeculaError(f"speculators config in {directory} does not name its fused layers "
                               "(eagle_aux_hidden_state_layer_ids); give --target so the defaults can be used")
        layers = default_feature_layers(num_target_layers)
    head_config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) for i in layers]}
    if num_target_layers:
        head_config["eagle_config"]["target_num_hidden_layers"] = num_target_layers

    state = load_state_dict(directory)
    state.pop(EMBEDDING, None)
    bias = state.pop("fc.bias", None)  # early speculators releases gave fc a bias; harmless only if zero
    if bias is not None and bool(bias.ne(0).any()):
        raise SpeculaError(f"{directory}: its fc layer has a non-zero bias, which the EAGLE-3 layout has no place for")
    state = {name.replace("layers.0.", "midlayer.", 1): tensor for name, tensor in state.items()}
    if head_config["draft_vocab_size"] == head_config.get("vocab_size"):
        state.pop("d2t", None)  # the identity map of a full vocabulary
        state.pop("t2d", None)
    head = Eagle3Head(head_config)
    load_checked(head, state, f"speculators checkpoint {directory}")
    return head.to(dtype=dtype or state["fc.weight"].dtype).eval()


def target_layer_count(target: Path | None) -> int | None:
    """num_hidden_layers of the target model directory, if one is given."""
    if target is None:
        return None

    config = read_config(check_model_dir(target, "target"), "target model")
    return config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")


def convert(draft: str | Path, to: str, out: str | Path, target: str | Path | None = None,
            speculative_tokens: int = 3) -> str:
    """Convert the head in ``draft`` (either layout) to layout ``to`` in ``out``; returns the source layout."""
    if to not in FORMATS:
        raise SpeculaError(f"unknown format '{to}'; choose one of {', '.join(FORMATS)}")
    draft, out = Path(draft), Path(out)
    target = Path(target) if target is not None else None
    if out.resolve() == draft.resolve():
        raise SpeculaError("--out must differ from --draft")
    source = read_format(draft)
    if to == "speculators" and target is None:
        raise SpeculaError("--to speculators needs --target DIR: the layout stores the target's embedding "
                           "and names it as verifier")
    head = load_head(draft, target_layer_count(target))
    prepare_output_dir(out, "convert")  # after the cheap checks of the inputs, so that bad input leaves nothing
    if to == "speculators":
        save_speculators(head, out, target, speculative_tokens)
    else:
        head.save_pretrained(out)
    return source
