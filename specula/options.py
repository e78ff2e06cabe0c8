"""Method options: one schema per option (type, range, command-line spelling), shared by every source.

The command line, ``--option``, bench configs, profiles and the Python API all coerce a value through
`OptionSpec.coerce`; the registry (`specula.methods`) says which method takes which option.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specula.acceptance_typical import POSTERIOR_ALPHA, POSTERIOR_THRESHOLD, make_acceptor
from specula.errors import SpeculaError
from specula.runtime.weights import WEIGHT_FORMATS
from specula.tree import check_rank_paths


@dataclass(frozen=True)
class OptionSpec:
    """One drafter option: its keyword name, value type, range and command-line spelling.

    kind: "int", "float", "bool", "path", "file" (an existing file, or 'none'), "weights" (a
    `specula.runtime.weights` format name) or "tree" (a non-empty list of child-rank paths, each path's parent
    listed too, no path twice; given as a list, JSON text or a JSON file).
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
                raise SpeculaError(f"{label} must be a path, got {value!r}")
            return Path(value)
        if self.kind == "file":  # checked here, before any model loads
            if isinstance(value, (str, Path)) and str(value) == "none":
                return "none"
            if not isinstance(value, (str, Path)) or not str(value) or not Path(value).is_file():
                raise SpeculaError(f"{label}: no such file: {value!r} (give a file, or 'none')")
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
    return [list(p) for p in check_rank_paths(value, label)]


# One definition per option; methods list the ones they take.
NUM_TOKENS = OptionSpec("num_tokens", "int", "--num-draft-tokens", "draft tokens per cycle", 1, "N")
MIN_NGRAM = OptionSpec("min_ngram", "int", "--pld-min-ngram", "pld: shortest n-gram to look up", 1, "N")
MAX_NGRAM = OptionSpec("max_ngram", "int", "--pld-max-ngram", "pld: longest n-gram to look up", 1, "N")
CHOICES = OptionSpec("choices", "tree", "--tree-choices",
                     "static tree as JSON child-rank paths (or a JSON file), e.g. '[[0],[1],[0,0]]'", None, "JSON")
TOTAL_TOKENS = OptionSpec("total_tokens", "int", "--tree-total-tokens", "dynamic tree: draft nodes kept", 1, "N")
DEPTH = OptionSpec("depth", "int", "--tree-depth", "dynamic tree: expansion steps", 1, "N")
TOP_K = OptionSpec("top_k", "int", "--tree-top-k", "dynamic tree: nodes expanded per step", 1, "K")
MIN_CONFIDENCE = OptionSpec("min_confidence", "float", "--tree-min-confidence",
                            "dynamic tree: grow no deeper under a layer whose best path confidence (the product of "
                            "the head's probabilities) is below P", 0.0, "P")
LDLP = OptionSpec("ldlp", "path", "--ldlp", "ada: the draft length predictor (default: DRAFT/ldlp)", None, "DIR")
# A draft model in a cheaper format than the target's (e.g. the target itself in q4_1 drafting for its
# float32 self) is the one sps draft this machine has for a target without a smaller sibling.
DRAFT_WEIGHTS = OptionSpec("draft_weights", "weights", "--draft-weights",
                           "sps: the draft model's weight format (default: float32)", None, "FORMAT")
TREE = OptionSpec("tree", "bool", "--ada-tree", "ada: a dynamic tree of the predicted depth instead of a chain")
HEAD_ONLY = OptionSpec("head_only", "bool", "--head-only", "draft from the head alone, without grafting the suffix "
                       "drafter's candidates onto its tree")
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
# The target's own answers, a fixed corpus the suffix drafter (and the head methods' grafted suffix drafts) use.
ANSWERS = OptionSpec("answers", "file", "--suffix-answers", "suffix: a corpus of the target's own answers to draft "
                     "from (scripts/build_answer_corpus.py), or 'none' (default: the one bundled for the default "
                     "target)", None, "FILE")
MERGED_OPTIONS = (HEAD_ONLY, ANSWERS)  # the head methods' grafted suffix drafts

# Acceptance options apply to every method: they choose the rule, not the drafter.
ACCEPTANCE = ("lossless", "typical")
TYPICAL_THRESHOLD = OptionSpec("typical_threshold", "float", "--typical-threshold",
                               f"typical acceptance ε (default {POSTERIOR_THRESHOLD})", 0.0, "EPS")
TYPICAL_ALPHA = OptionSpec("typical_alpha", "float", "--typical-alpha",
                           f"typical acceptance δ (default {POSTERIOR_ALPHA})", 0.0, "DELTA")
# Medusa's code calls ε and δ the posterior threshold and alpha; bench configs may use either spelling.
ALIASES = {"posterior_threshold": "typical_threshold", "posterior_alpha": "typical_alpha"}



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
