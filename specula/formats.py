"""Converting EAGLE-3 draft heads between checkpoint layouts, for users who serve with vLLM or SGLang.

- ``eagle3``: the official EAGLE-3 layout, which is also what SGLang loads as
  `LlamaForCausalLMEagle3` and what `Eagle3Head.save_pretrained` writes: Llama
  config keys plus `draft_vocab_size`, tensors `fc.weight`, `midlayer.*`,
  `norm.weight`, `lm_head.weight`, `d2t`, `t2d`; no embedding (the target's).
- ``speculators``: the vLLM speculators layout (`speculators_model_type: "eagle3"`,
  `architectures: ["Eagle3Speculator"]`): the decoder layer's Llama config nested
  as `transformer_layer_config`, a `speculators_config` naming the algorithm, its
  greedy proposal method and the verifier, and tensors named `layers.0.*` instead
  of `midlayer.*`, `fc.bias`, and the target's `embed_tokens.weight`.

Field names follow vllm-project/speculators (`src/speculators/config.py`,
`src/speculators/proposals/greedy.py`, `src/speculators/models/eagle3/config.py`
and `eagle3.py`) as read in November 2026; docs/formats.md has the details.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.heads.checkpoint import load_checked, load_state_dict, save_checkpoint
from specula.heads.eagle3_head import ARCHITECTURE, Eagle3Head
from specula.heads.eagle_head import CONFIG_KEYS

FORMATS = ("eagle3", "speculators")
SPECULATORS_VERSION = "0.3.0"  # the speculators release whose config fields this writes
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"


def read_format(directory: Path) -> str:
    """Which layout a checkpoint directory holds (by its config.json)."""
    config_file = directory / "config.json"
    if not directory.is_dir() or not config_file.is_file():
        raise SpeculaError(f"draft head directory {directory} has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise SpeculaError(f"{config_file} is not valid JSON: {err}") from err
    if config.get("speculators_model_type") is not None:
        if config["speculators_model_type"] != "eagle3":
            raise SpeculaError(f"{directory} is a speculators '{config['speculators_model_type']}' checkpoint; "
                               "only eagle3 converts")
        return "speculators"
    return "eagle3"


def load_head(directory: str | Path, num_target_layers: int | None = None) -> Eagle3Head:
    """An EAGLE-3 head from either layout."""
    directory = Path(directory)
    if read_format(directory) == "speculators":
        return _from_speculators(directory)
    return Eagle3Head.from_pretrained(directory, num_target_layers=num_target_layers)


def _target_info(target_dir: Path | None) -> tuple[dict, torch.Tensor | None]:
    """(config, input embedding [V, H]) of the target model directory, read from its files only."""
    if target_dir is None:
        return {}, None
    from specula.target import check_model_dir

    check_model_dir(target_dir, "target")
    config = json.loads((target_dir / "config.json").read_text())
    state = load_state_dict(target_dir)
    embedding = next((v for k, v in state.items() if k.endswith("embed_tokens.weight")), None)
    if embedding is None:
        raise SpeculaError(f"no embed_tokens.weight in the target model {target_dir}")
    return config, embedding


def save_speculators(head: Eagle3Head, out: str | Path, target_dir: str | Path,
                     speculative_tokens: int = 3) -> None:
    """Write ``head`` in the speculators layout; the target supplies the embedding and the verifier fields."""
    target_dir = Path(target_dir)
    target_config, embedding = _target_info(target_dir)
    if embedding.shape != (head.vocab_size, head.hidden_size):
        raise SpeculaError(f"target embedding {tuple(embedding.shape)} does not fit the head "
                           f"({head.vocab_size} tokens, hidden {head.hidden_size})")
    layer = {k: head.config[k] for k in CONFIG_KEYS if k in head.config}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1)
    config = {
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": [SPECULATORS_ARCHITECTURE],
        "transformer_layer_config": layer,
        "draft_vocab_size": head.draft_vocab_size,
        "target_hidden_size": int(head.config.get("target_hidden_size") or head.hidden_size),
        "eagle_aux_hidden_state_layer_ids": head.feature_layers,
        "norm_before_residual": False,
        "embed_requires_grad": False,
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_dir), "architectures": target_config.get("architectures", [])},
        },
    }
    state = {}
    for name, tensor in head.state_dict().items():
        if "rotary_emb" in name:
            continue
        state[name.replace("midlayer.", "layers.0.", 1)] = tensor.detach().contiguous().cpu()
    state["fc.bias"] = torch.zeros(head.hidden_size, dtype=head.fc.weight.dtype)  # speculators' fc has a bias
    state["embed_tokens.weight"] = embedding.to(head.fc.weight.dtype).contiguous()
    if head.d2t is None:  # speculators always carries the maps; the identity for a full vocabulary
        state["d2t"] = torch.zeros(head.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(head.vocab_size, dtype=torch.bool)
    save_checkpoint(out, state, config)


def _from_speculators(directory: Path) -> Eagle3Head:
    config = json.loads((directory / "config.json").read_text())
    for key in ("transformer_layer_config", "draft_vocab_size"):
        if key not in config:
            raise SpeculaError(f"speculators config in {directory} lacks '{key}'")
    state = load_state_dict(directory)
    bias = state.pop("fc.bias", None)
    if bias is not None and bool(bias.abs().gt(0).any()):
        raise SpeculaError(f"{directory}: its fc layer has a non-zero bias, which the EAGLE-3 layout has no place for")
    state.pop("embed_tokens.weight", None)  # the target's own embedding is used
    head_config = {k: v for k, v in config["transformer_layer_config"].items() if k in CONFIG_KEYS}
    head_config.update(num_hidden_layers=1, draft_vocab_size=config["draft_vocab_size"],
                       architectures=[ARCHITECTURE], model_type="llama")
    if config.get("target_hidden_size") and config["target_hidden_size"] != head_config.get("hidden_size"):
        head_config["target_hidden_size"] = config["target_hidden_size"]
    layers = config.get("eagle_aux_hidden_state_layer_ids")
    if not layers:
        raise SpeculaError(f"speculators config in {directory} does not name its fused layers "
                           "(eagle_aux_hidden_state_layer_ids)")
    head_config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers)}
    renamed = {name.replace("layers.0.", "midlayer.", 1): tensor for name, tensor in state.items()}
    if head_config["draft_vocab_size"] == head_config.get("vocab_size"):
        renamed.pop("d2t", None)
        renamed.pop("t2d", None)
    head = Eagle3Head(head_config)
    load_checked(head, renamed, f"speculators checkpoint {directory}")
    return head.to(dtype=renamed["fc.weight"].dtype).eval()


def convert(draft: str | Path, to: str, out: str | Path, target: str | Path | None = None,
            speculative_tokens: int = 3) -> str:
    """Convert the head in ``draft`` (either layout) to layout ``to`` in ``out``; returns the source layout."""
    if to not in FORMATS:
        raise SpeculaError(f"unknown format '{to}'; choose one of {', '.join(FORMATS)}")
    draft, out = Path(draft), Path(out)
    if out.resolve() == draft.resolve():
        raise SpeculaError("--out must differ from --draft")
    source = read_format(draft)
    target_layers = None
    if target is not None:
        target_layers = json.loads((Path(target) / "config.json").read_text()).get("num_hidden_layers") \
            if (Path(target) / "config.json").is_file() else None
    head = load_head(draft, target_layers)
    if to == "speculators":
        if target is None:
            raise SpeculaError("--to speculators needs --target DIR: the format stores the target's embedding "
                               "and names its verifier")
        save_speculators(head, out, target, speculative_tokens)
    else:
        head.save_pretrained(out)
    return source


def add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    from specula.cli import positive_int

    p = subparsers.add_parser("convert", help="convert an EAGLE-3 head to the vLLM speculators or SGLang layout",
                              description="Convert an EAGLE-3 draft head between the official EAGLE-3 / SGLang "
                                          "layout and the vLLM speculators layout (docs/formats.md).")
    p.add_argument("--draft", type=Path, required=True, metavar="DIR", help="the head to convert (either layout)")
    p.add_argument("--to", required=True, choices=FORMATS, help="layout to write")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--target", type=Path, metavar="DIR",
                   help="target model directory (needed for --to speculators: embedding and verifier)")
    p.add_argument("--speculative-tokens", type=positive_int, default=3, metavar="N",
                   help="speculators: draft tokens of the greedy proposal method (default: %(default)s)")
    p.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    source = convert(args.draft, args.to, args.out, args.target, args.speculative_tokens)
    print(f"converted {args.draft} ({source}) to {args.to} in {args.out}", file=sys.stderr)
    return 0
