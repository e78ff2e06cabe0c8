"""`--weights auto` decided once per machine and target (`specula.runtime.auto_weights`): what the cached decision
chose, float32 where no quantized kernel exists, decided once per load and again when the target's files change.
No timing is asserted: which format is faster is the machine's business."""

from __future__ import annotations

import json
import os

import pytest
from conftest import STORIES, copy_dir

import specula
from specula import methods
from specula.cli import build_parser
from specula.cli.bench import bench_settings
from specula.errors import SpeculaError
from specula.runtime import auto_weights, weights
from specula.runtime.model_source import cache_dir


@pytest.fixture
def deciding(tmp_path, monkeypatch):
    """An empty cache (but for the kernels this machine built) and no pinned meaning of auto (conftest pins float32
    for the other tests)."""
    built = cache_dir() / "kernels"
    (tmp_path / "cache").mkdir()
    if built.is_dir():
        (tmp_path / "cache" / "kernels").symlink_to(built.resolve(), target_is_directory=True)
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(auto_weights.ENVIRONMENT_VARIABLE, raising=False)
    return tmp_path


def counting(monkeypatch, module, name):
    """Wrap ``module.name`` so that its calls are counted; returns the list of their results."""
    results = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        results.append(original(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(module, name, wrapper)
    return results


def test_auto_is_the_cached_decision_made_once_per_load_and_again_when_the_target_changes(deciding, monkeypatch):
    target = copy_dir(STORIES, deciding / "stories260k")
    chosen = {"choice": "int8", "formats": {"int8": {"step_ms": 1.0, "pass_ms": 2.0}}, "unavailable": {}}
    decisions = []
    monkeypatch.setattr(auto_weights, "choose", lambda shapes, device: decisions.append(shapes) or dict(chosen))
    resolved = counting(monkeypatch, methods, "resolve_auto_weights")

    assert specula.load(target, method="pld", profile=False).target.weights == "int8"
    assert len(decisions) == 1 and resolved == ["int8"]
    assert decisions[0].hidden == 64 and decisions[0].layers == 5  # the target's own shapes
    record = json.loads(auto_weights.record_path(target).read_text())
    assert [entry["choice"] for entry in record["machines"].values()] == ["int8"]

    assert specula.load(target, method="vanilla", profile=False).target.weights == "int8"  # read from the cache
    assert len(decisions) == 1 and resolved == ["int8", "int8"]  # resolved once per load, decided once in all

    weights_file = target / "model.safetensors"
    stat = weights_file.stat()
    os.utime(weights_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the target file changed
    chosen["choice"] = "int4"
    assert specula.load(target, method="pld", profile=False).target.weights == "int4"
    assert len(decisions) == 2
    assert specula.load(target, method="pld", weights="float32").target.weights == "float32"  # a format is a format
    assert len(decisions) == 2 and len(resolved) == 4


def test_auto_is_float32_where_no_quantized_kernel_exists(deciding, monkeypatch, capsys):
    def no_kernel(fmt, device, *args):
        if fmt not in ("float32", "auto"):
            raise SpeculaError(f"{fmt} weights are not available: simulated")

    monkeypatch.setattr(weights, "check_available", no_kernel)
    monkeypatch.setattr(auto_weights, "check_available", no_kernel)
    decision = auto_weights.measured_choice(STORIES)
    assert decision["choice"] == "float32"
    assert set(decision["unavailable"]) == {"q4_1", "int4", "int8"} and set(decision["formats"]) == {"float32"}
    assert "--weights auto means float32" in capsys.readouterr().err  # said once, when decided
    assert specula.load(STORIES, method="pld", profile=False).target.weights == "float32"
    assert capsys.readouterr().err == ""  # cached: nothing measured or said again


def test_without_q4_1_the_fastest_measured_format_wins(deciding, monkeypatch):
    def no_q4_1(fmt, device, *args):
        if fmt == "q4_1":
            raise SpeculaError("q4_1 weights are not available: simulated")
        return check_available(fmt, device, *args)

    check_available = weights.check_available
    monkeypatch.setattr(auto_weights, "check_available", no_q4_1)
    monkeypatch.setattr(weights, "check_available", no_q4_1)
    decision = auto_weights.measured_choice(STORIES)
    timed = decision["formats"]
    assert "float32" in timed and "q4_1" in decision["unavailable"]
    assert all(timed[fmt]["step_ms"] > 0 and timed[fmt]["pass_ms"] > 0 for fmt in timed)
    assert decision["choice"] == min(timed, key=lambda fmt: timed[fmt]["step_ms"])


def test_q4_1_wherever_its_kernel_runs(deciding):
    try:
        weights.check_available("q4_1", "cpu")
    except SpeculaError as err:
        pytest.skip(f"no q4_1 kernel here: {err}")
    assert auto_weights.measured_choice(STORIES)["choice"] == "q4_1"


def test_a_calibrated_profile_and_the_environment_decide_before_the_measurement(deciding, monkeypatch):
    monkeypatch.setattr(auto_weights, "choose", lambda shapes, device: pytest.fail("nothing is measured"))
    profile = {"target": "stories260k", "device": "cpu", "auto_weights": {"choice": "int4"}}
    assert auto_weights.resolve_auto_weights("auto", STORIES, "cpu", profile) == "int4"
    assert auto_weights.resolve_auto_weights("int8", STORIES, "cpu", profile) == "int8"
    monkeypatch.setenv(auto_weights.ENVIRONMENT_VARIABLE, "int8")
    assert auto_weights.resolve_auto_weights("auto", STORIES, "cpu", None) == "int8"
    monkeypatch.setenv(auto_weights.ENVIRONMENT_VARIABLE, "fast")
    with pytest.raises(SpeculaError, match="SPECULA_AUTO_WEIGHTS must be one of"):
        auto_weights.resolve_auto_weights("auto", STORIES, "cpu", None)


def test_bench_spells_out_what_auto_decided(deciding, monkeypatch):
    monkeypatch.setattr(auto_weights, "choose", lambda shapes, device: {"choice": "int4", "formats": {},
                                                                        "unavailable": {}})
    args = build_parser().parse_args(["bench", "--target", str(STORIES), "--methods", "vanilla", "--no-profile",
                                      "--out", str(deciding / "out")])
    settings = bench_settings(args)
    assert settings.weights == "int4" and "--weights int4" in settings.command
