"""Bench configuration: a TOML (or JSON) file for repeatable runs, and per-method options.

    [bench]                      # defaults for any command-line option (the command line wins)
    target = "models/pycoder-25m"
    methods = ["vanilla", "pld", "sps", "eagle2", "hf", "hf_assisted", "hf_pld"]
    data = ["../shared/data/pycode/eval.jsonl"]
    temperature = [0.0, 1.0]
    max_new_tokens = 128
    limit = 10

    [methods.sps]                # options of the method labelled "sps"
    draft = "../shared/models/pycoder-draft"
    num_tokens = 4

    [methods.eagle2-wide]        # a second configuration of one method: `method` names the real one
    method = "eagle2"
    draft = "specula/heads/bundled/eagle-pycoder-25m"
    total_tokens = 16

    [methods.llamacpp-eagle3]    # llama.cpp's own drafting (needs llama-server: --llama-server PATH)
    method = "llamacpp-draft"
    spec_type = "draft-eagle3"   # or "draft-simple" with a draft model's GGUF or Llama directory
    draft = "runs/eagle3-smollm2"
    draft_max = 3

A method's table holds ``method`` (default: its label), ``draft`` (the draft
model or head directory) and any keyword options of its drafter; on the
command line ``--option LABEL.KEY=VALUE`` sets or overrides one of them
(VALUE is read as JSON when it parses, else as a string). Relative paths are
relative to the directory the command runs in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specula.bench.llamacpp_options import LLAMACPP_METHODS, check_llamacpp_options
from specula.draft_budget import check_draft_budget
from specula.errors import SpeculaError
from specula.methods import METHODS, check_options
from specula.options import AcceptanceOptions, OptionSpec

# Outside baselines run through `transformers` generate, each with the options it understands, checked as the
# registry checks ours (`OptionSpec.coerce`): a value transformers would reject, or silently misread, mid-run is
# refused before any model loads.
HF_METHODS: dict[str, dict[str, OptionSpec]] = {
    "hf": {},
    "hf_assisted": {
        "num_assistant_tokens": OptionSpec("num_assistant_tokens", "int", "num_assistant_tokens",
                                           "draft tokens per step", 1),
        "assistant_confidence_threshold": OptionSpec("assistant_confidence_threshold", "float",
                                                     "assistant_confidence_threshold", "stop drafting below", 0),
        "num_assistant_tokens_schedule": None,  # a name, checked against HF_SCHEDULES
    },
    "hf_pld": {
        "num_tokens": OptionSpec("num_tokens", "int", "num_tokens", "prompt lookup tokens per step", 1),
        "max_matching_ngram_size": OptionSpec("max_matching_ngram_size", "int", "max_matching_ngram_size",
                                              "longest n-gram matched", 1),
    },
}
HF_SCHEDULES = ("constant", "heuristic", "heuristic_transient")
BENCH_KEYS = {"target", "methods", "data", "category", "temperature", "max_new_tokens", "limit", "seed", "out",
              "dtype", "device", "threads", "top_p", "top_k", "max_prompt_tokens", "warmup_tokens", "llama_server",
              "weights", "compile"}


@dataclass
class MethodSpec:
    """One column of the benchmark: a label, the method it runs, its draft and its options."""

    label: str
    method: str
    draft: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_hf(self) -> bool:
        return self.method in HF_METHODS

    @property
    def is_llamacpp(self) -> bool:
        return self.method in LLAMACPP_METHODS

    def as_dict(self) -> dict:
        return {"method": self.method, "draft": self.draft, "options": dict(sorted(self.options.items()))}


def _toml_loads(text: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError as err:
            raise SpeculaError("reading TOML configs on Python 3.10 needs 'pip install tomli' "
                               "(or write the config as JSON)") from err
    return tomllib.loads(text)


def read_config(path: str | Path) -> dict:
    """A config file as {'bench': {...}, 'methods': {label: {...}}}; TOML, or JSON for a .json file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SpeculaError(f"cannot read config {path}: {err}") from err
    try:
        config = json.loads(text) if path.suffix == ".json" else _toml_loads(text)
    except ValueError as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        raise SpeculaError(f"config {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: "
                           f"{err}") from err
    if not isinstance(config, dict):
        raise SpeculaError(f"config {path} must be a table/object")
    unknown = set(config) - {"bench", "methods"}
    if unknown:
        raise SpeculaError(f"config {path}: unknown section(s) {', '.join(sorted(unknown))}; "
                           "expected [bench] and [methods.LABEL]")
    bench = config.get("bench", {})
    methods = config.get("methods", {})
    if not isinstance(bench, dict) or not isinstance(methods, dict):
        raise SpeculaError(f"config {path}: [bench] and [methods] must be tables")
    unknown = set(bench) - BENCH_KEYS
    if unknown:
        raise SpeculaError(f"config {path}: unknown [bench] key(s) {', '.join(sorted(unknown))}; "
                           f"known: {', '.join(sorted(BENCH_KEYS))}")
    for label, table in methods.items():
        if not isinstance(table, dict):
            raise SpeculaError(f"config {path}: [methods.{label}] must be a table of options")
    return {"bench": bench, "methods": methods}


def parse_option(text: str) -> tuple[str, str, Any]:
    """``LABEL.KEY=VALUE`` → (label, key, value); VALUE is JSON if it parses, else the raw string."""
    head, eq, raw = text.partition("=")
    label, dot, key = head.partition(".")
    if not (eq and dot and label and key):
        raise SpeculaError(f"--option expects LABEL.KEY=VALUE (e.g. sps.num_tokens=4), got '{text}'")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return label, key, value


def known_methods() -> tuple[str, ...]:
    """Our methods (the registry's) followed by the `transformers` and llama.cpp baselines."""
    return tuple(METHODS) + tuple(HF_METHODS) + tuple(LLAMACPP_METHODS)


def method_specs(labels: list[str], tables: dict[str, dict], overrides: list[str] | None = None,
                 defaults: dict[str, dict] | None = None) -> list[MethodSpec]:
    """Resolve method labels against config tables, ``--option`` overrides and (lowest) profile defaults."""
    if not labels:
        raise SpeculaError("no methods given (--methods vanilla,pld,...)")
    if len(set(labels)) != len(labels):
        raise SpeculaError(f"a method label is listed twice in --methods: {','.join(labels)}")
    tables = {label: dict(table) for label, table in tables.items()}
    for text in overrides or []:
        label, key, value = parse_option(text)
        if label not in labels:
            raise SpeculaError(f"--option {text}: '{label}' is not one of the methods ({', '.join(labels)})")
        tables.setdefault(label, {})[key] = value
    choices = known_methods()
    specs = []
    for label in labels:
        table = dict(tables.get(label, {}))
        method = table.pop("method", label)
        if method not in choices:
            hint = "" if label == method else f" (method of '{label}')"
            raise SpeculaError(f"unknown method '{method}'{hint}; choose from {', '.join(choices)}, or give "
                               f"[methods.{label}] a 'method' key in the config")
        draft = table.pop("draft", None)
        if draft is not None and not isinstance(draft, str):
            raise SpeculaError(f"method {label}: 'draft' must be a directory path")
        if method in HF_METHODS:
            unknown = set(table) - set(HF_METHODS[method])
            if unknown:
                raise SpeculaError(f"method {label} ({method}) does not take option(s) {', '.join(sorted(unknown))}; "
                                   f"it takes {', '.join(sorted(HF_METHODS[method])) or 'none'}")
            table = hf_options(label, method, table)
            if method == "hf_assisted" and not draft:
                raise SpeculaError(f"method {label} (hf_assisted) needs a draft model: set draft in "
                                   f"[methods.{label}] or --option {label}.draft=DIR")
        if method in LLAMACPP_METHODS:
            table = check_llamacpp_options(label, method, draft, table)
        elif method not in HF_METHODS:
            table = checked_options(label, method, table, (defaults or {}).get(method, {}))
        specs.append(MethodSpec(label, method, draft, table))
    return specs


def hf_options(label: str, method: str, table: dict) -> dict:
    """A `transformers` baseline's options with their types and ranges checked (``table``'s names are known)."""
    checked = {}
    for key, value in table.items():
        spec = HF_METHODS[method][key]
        where = f"method {label}: "
        if spec is None:
            if value not in HF_SCHEDULES:
                raise SpeculaError(f"{where}{key} must be one of {', '.join(HF_SCHEDULES)}, got {value!r}")
            checked[key] = value
            continue
        checked[key] = spec.coerce(value, where)
        if key == "assistant_confidence_threshold" and checked[key] > 1:
            raise SpeculaError(f"{where}{key} is a probability, from 0 to 1, got {checked[key]:g}")
    return checked


def checked_options(label: str, method: str, table: dict, defaults: dict) -> dict:
    """A method's options checked by the registry (the profile's ``defaults`` under them), as recorded."""
    acceptance, drafter_options = AcceptanceOptions.split(table)
    where = f"method {label}: " if label != method else ""
    budget = drafter_options.pop("draft_budget", None)  # the Speculator's, not the drafter's (`build_speculator`)
    if budget is not None:
        check_draft_budget(budget, where)
    usable = {k: v for k, v in defaults.items() if METHODS[method].takes(k)}
    options = {**check_options(method, usable, "hardware profile: "), **check_options(method, drafter_options, where)}
    METHODS[method].check(options)
    if acceptance.acceptance != "lossless":
        options.update({k: v for k, v in vars(acceptance).items() if v is not None})
    if budget is not None:
        options["draft_budget"] = budget
    return {k: str(v) if isinstance(v, Path) else v for k, v in options.items()}
