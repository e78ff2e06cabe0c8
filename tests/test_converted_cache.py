"""A target converted to a quantized format is kept in the cache and mapped back in by later loads
(`specula.runtime.converted_cache`): the same model, converted once, converted again when its files change."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import STORIES, copy_dir

from specula.errors import SpeculaError
from specula.runtime import converted_cache, loading, weights
from specula.runtime.model_source import cache_dir
from specula.runtime.target import Target

PROMPT = torch.tensor([1, 403, 407, 261, 378, 9])


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty cache but for the kernels this machine built; conversions counted."""
    built = cache_dir() / "kernels"
    (tmp_path / "cache").mkdir()
    if built.is_dir():
        (tmp_path / "cache" / "kernels").symlink_to(built.resolve(), target_is_directory=True)
    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(converted_cache.ENVIRONMENT_VARIABLE, raising=False)  # conftest turns it off for the others
    conversions = []
    convert = loading.load_converted

    def counted(*args, **kwargs):
        conversions.append(args[3])
        return convert(*args, **kwargs)

    monkeypatch.setattr(loading, "load_converted", counted)
    return conversions


def entries() -> list[str]:
    folder = cache_dir() / "converted"
    return sorted(p.name for p in folder.glob("*.pt")) if folder.is_dir() else []


def logits(target: Target) -> torch.Tensor:
    target.reset()
    return target.prefill(PROMPT).logits


@pytest.mark.parametrize("fmt", ["q4_1", "int8"])
def test_a_converted_target_is_kept_and_read_back_as_the_same_model(empty_cache, fmt):
    try:
        weights.check_available(fmt, "cpu")
    except SpeculaError as err:
        pytest.skip(str(err))
    first = Target.load(STORIES, weights=fmt)
    assert empty_cache == [fmt] and len(entries()) == 1
    again = Target.load(STORIES, weights=fmt)
    assert empty_cache == [fmt]  # read back, not converted
    assert again.weights == fmt and type(again.model.lm_head) is type(first.model.lm_head)
    assert torch.equal(logits(again), logits(first))
    assert again.weights_report.converted == first.weights_report.converted


def test_a_changed_target_is_converted_again_and_replaces_its_entry(empty_cache, tmp_path):
    target = copy_dir(STORIES, tmp_path / "stories260k")
    Target.load(target, weights="int8")
    [entry] = entries()
    weights_file = target / "model.safetensors"
    stat = weights_file.stat()
    os.utime(weights_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    Target.load(target, weights="int8")
    assert empty_cache == ["int8", "int8"] and len(entries()) == 1 and entries() != [entry]


def test_each_thread_count_keeps_its_own_entry(empty_cache):
    """generate (one thread on a 2-CPU machine) and serve (torch's setting) do not replace each other's entry."""
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 1, 2):
            torch.set_num_threads(threads)
            Target.load(STORIES, weights="int8")
    finally:
        torch.set_num_threads(previous)
    assert empty_cache == ["int8", "int8"] and len(entries()) == 2


def test_a_damaged_entry_is_converted_again(empty_cache):
    reference = logits(Target.load(STORIES, weights="int8"))
    [entry] = entries()
    (cache_dir() / "converted" / entry).write_bytes(b"not a saved model")
    assert torch.equal(logits(Target.load(STORIES, weights="int8")), reference)
    assert empty_cache == ["int8", "int8"] and entries() == [entry]
    Target.load(STORIES, weights="int8")
    assert len(empty_cache) == 2  # rewritten whole: read back this time


def test_float32_and_the_switch_keep_nothing(empty_cache, monkeypatch):
    Target.load(STORIES, weights="float32")
    assert entries() == []
    monkeypatch.setenv(converted_cache.ENVIRONMENT_VARIABLE, "0")
    Target.load(STORIES, weights="int8")
    Target.load(STORIES, weights="int8")
    assert entries() == [] and empty_cache == ["int8", "int8"]
