"""The float32 matmul layout is chosen per machine by measurement, once: the environment variable decides when
set, a cached choice is reused without measuring, an unreadable cache is measured again and rewritten whole."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

from specula.errors import SpeculaError
from specula.kernels import float32 as float32_kernel
from specula.runtime import float32_layout
from specula.runtime.quantized_linear import Float32Linear
from specula.runtime.weights import FLOAT32_LAYOUT_MIN_ELEMENTS, quantize_linear_weights


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(float32_layout.ENVIRONMENT_VARIABLE, raising=False)
    return tmp_path / float32_layout.CACHE_FILE


def _large_head_model():
    return tiny_model("llama", tie_word_embeddings=True, vocab_size=FLOAT32_LAYOUT_MIN_ELEMENTS // 64)


@pytest.mark.parametrize(("setting", "swapped"), [("columns", True), ("rows", False)])
def test_the_environment_variable_decides_the_layout_without_measuring(cache, monkeypatch, setting, swapped):
    monkeypatch.setattr(float32_kernel, "_kernel", None)  # the choice is the BLAS layout's, where no kernel runs
    monkeypatch.setenv(float32_layout.ENVIRONMENT_VARIABLE, setting)
    monkeypatch.setattr(float32_layout, "measure", lambda: pytest.fail("measured despite the variable"))
    model = _large_head_model()
    quantize_linear_weights(model, "float32", lm_head=True)
    assert isinstance(model.lm_head, Float32Linear) is swapped
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not cache.exists()


def test_an_unknown_layout_setting_is_refused(cache, monkeypatch):
    monkeypatch.setenv(float32_layout.ENVIRONMENT_VARIABLE, "diagonal")
    with pytest.raises(SpeculaError, match="'columns' or 'rows'"):
        float32_layout.columns_layout_pays()


@pytest.mark.parametrize("columns", [True, False])
def test_a_cached_choice_is_reused_without_measuring(cache, monkeypatch, columns):
    cache.write_text(json.dumps({float32_layout.machine_key(): {"columns": columns}}))
    monkeypatch.setattr(float32_layout, "measure", lambda: pytest.fail("measured despite the cache"))
    assert float32_layout.columns_layout_pays() is columns


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"KEY": {"columns": "yes"}}'])
def test_an_unreadable_cache_is_measured_again_and_rewritten(cache, monkeypatch, damage, capsys):
    cache.write_text(damage.replace("KEY", float32_layout.machine_key()))
    monkeypatch.setattr(float32_layout, "measure", lambda: ([10.0, 20.0], [5.0, 6.0]))
    assert float32_layout.columns_layout_pays() is True
    entry = json.loads(cache.read_text())[float32_layout.machine_key()]
    assert entry["columns"] is True and entry["f_linear_ms"] == [10.0, 20.0]
    assert "timed this CPU's float32 matmul layouts once" in capsys.readouterr().err  # one line, said once


def test_columns_are_chosen_only_when_clearly_faster(cache, monkeypatch):
    monkeypatch.setattr(float32_layout, "measure", lambda: ([10.0, 10.0], [9.5, 9.5]))  # within the margin
    assert float32_layout.columns_layout_pays() is False


def test_the_measurement_times_both_layouts_for_each_row_count():
    rows_ms, columns_ms = float32_layout.measure()
    assert len(rows_ms) == len(columns_ms) == len(float32_layout.PROBE_ROWS)
    assert all(t > 0 for t in rows_ms + columns_ms)



def test_a_model_off_the_cpu_builds_no_cpu_kernel_and_measures_nothing(cache, monkeypatch):
    """A GPU target keeps its linears: neither the CPU kernel (a 30 s build on first use, seen on an H200 machine)
    nor the layout measurement runs. The meta device stands in for the GPU here."""
    from specula.runtime import weights

    monkeypatch.setattr(weights, "float32_kernel", lambda: pytest.fail("the CPU float32 kernel was asked for"))
    monkeypatch.setattr(float32_layout, "measure", lambda: pytest.fail("measured for a model off the CPU"))
    model = _large_head_model().to("meta")
    quantize_linear_weights(model, "float32", lm_head=True)
    assert type(model.lm_head) is torch.nn.Linear and not cache.exists()
