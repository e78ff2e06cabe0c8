"""The method registry: every option is checked against its method's schema before any model loads,
the command line offers exactly the registry's options, and the package's imports flow one way."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
from conftest import STORIES

import specula
from specula.cli import build_parser, main
from specula.errors import SpeculaError
from specula.methods import METHODS, all_options, check_options
from specula.runtime.target import Target

PACKAGE = Path(specula.__file__).resolve().parent

WRONG_TYPE = {"int": [1], "float": "many", "bool": 3, "path": 5, "file": "/no/such/file", "tree": "not json",
              "weights": "q5"}
OUT_OF_RANGE = {"int": 0, "float": -1.0, "tree": [[-1]]}
VALID = {"int": 1, "float": 0.5, "bool": True, "path": "x", "file": "none", "tree": [[0]], "weights": "int8"}


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if anything tries to load a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: refuse()))


def cases():
    for name, method in METHODS.items():
        yield name, {"no_such_option": 1}, "unknown option"
        for spec in method.options:
            yield name, {spec.name: WRONG_TYPE[spec.kind]}, spec.flag
            if spec.kind in OUT_OF_RANGE:
                yield name, {spec.name: OUT_OF_RANGE[spec.kind]}, spec.flag
        foreign = next(s for s in all_options() if not method.takes(s.name))
        yield name, {foreign.name: VALID[foreign.kind]}, "applies only to method"


@pytest.mark.parametrize("method, options, fragment", list(cases()))
def test_bad_options_are_refused_before_any_model_loads(no_model_loads, method, options, fragment):
    with pytest.raises(SpeculaError, match=fragment.replace("-", r"\-")):
        specula.load(STORIES, method=method, draft=STORIES, **options)


@pytest.mark.parametrize("method, options, fragment", [
    ("eagle2", {"total_tokens": 50, "depth": 2, "top_k": 2}, "holds at most 6"),
    ("pld", {"min_ngram": 4, "max_ngram": 2}, "min_ngram <= max_ngram"),
    ("ada", {"top_k": 2}, "only with tree=true"),
    ("eagle", {"choices": [[0], [0]]}, "twice"),
    ("medusa", {"choices": [[0, 1]]}, "parent paths"),
    ("medusa", {"choices": []}, "non-empty"),
    ("pld", {"num_tokens": float("inf")}, "finite"),
    ("vanilla", {"acceptance": "sloppy"}, "unknown acceptance"),
    ("pld", {"typical_alpha": 0.2}, "only with --acceptance typical"),
])
def test_options_that_make_no_sense_together_are_refused(no_model_loads, method, options, fragment):
    with pytest.raises(SpeculaError, match=fragment):
        specula.load(STORIES, method=method, draft=STORIES, **options)


def test_values_are_coerced_to_their_types():
    assert check_options("eagle2", {"total_tokens": "8", "depth": 4.0}) == {"total_tokens": 8, "depth": 4}
    assert check_options("ada", {"tree": "true", "ldlp": "x"}) == {"tree": True, "ldlp": Path("x")}
    assert check_options("eagle", {"choices": "[[0],[0,0]]"}) == {"choices": [[0], [0, 0]]}


def test_cli_rejects_an_option_of_another_method_before_loading(no_model_loads, capfd):
    code = main(["generate", "--target", str(STORIES), "--method", "medusa", "--draft", str(STORIES),
                 "--tree-depth", "3", "--prompt", "Hi"])
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "applies only to method eagle2, eagle3" in err


def test_generate_help_lists_exactly_the_registry_options():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", "--help"]) == 0
    flags = {word.rstrip(",") for word in out.getvalue().split() if word.startswith("--")}
    for spec in all_options():
        assert spec.flag in flags
    generate = next(a for a in build_parser()._subparsers._group_actions[0].choices["generate"]._actions
                    if a.dest == "method")
    assert tuple(generate.choices) == tuple(METHODS)
