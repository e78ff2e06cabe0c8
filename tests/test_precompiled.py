"""Compiled graphs saved in Specula's cache and loaded by a later process (`specula.runtime.precompiled`)."""

from __future__ import annotations

import torch

from specula.runtime.precompiled import Precompiled, graphs_dir, source_key


class Scaled(torch.nn.Module):
    """A module whose float constant the graph reads (a guard a saved graph must check) and a weight it takes."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale
        self.weight = torch.nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4), requires_grad=False)


def scaled_step(module: Scaled, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, module.weight).relu() * module.scale


def test_a_new_process_loads_the_saved_graph_and_computes_the_same_bits():
    """What one process compiled, the next reads from the cache (no compilation) and runs to the same bits."""
    module, x = Scaled(2.0), torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    first = Precompiled(scaled_step, torch.device("cpu"))
    expected = first(module, x)
    assert (first.compiled_graphs, first.loaded_graphs) == (1, 0)
    assert torch.equal(expected, scaled_step(module, x))
    again = Precompiled(scaled_step, torch.device("cpu"))  # as a later process would: nothing in memory
    assert torch.equal(again(module, x), expected)
    assert (again.compiled_graphs, again.loaded_graphs) == (0, 1)


def test_a_saved_graph_whose_guards_reject_the_call_is_not_used():
    """Two modules of one structure whose constants differ: the graph traced with one is never run for the other
    (its saved guards reject it once, and a graph of its own is compiled beside it)."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    Precompiled(scaled_step, torch.device("cpu"))(Scaled(5.0), x)
    later = Precompiled(scaled_step, torch.device("cpu"))
    other = Scaled(-3.0)
    assert torch.equal(later(other, x), scaled_step(other, x))
    assert later.compiled_graphs == 1
    assert torch.equal(later(Scaled(5.0), x), scaled_step(Scaled(5.0), x))  # the first, loaded, still serves
    assert later.compiled_graphs == 1


def test_each_new_object_is_checked_against_the_graph_it_would_run():
    """In one process too: a call picks its graph by tensor shapes and objects, so a second module of other
    constants, at the same shapes, does not run the first one's graph."""
    step = Precompiled(scaled_step, torch.device("cpu"))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    for scale in (1.5, 4.0, 1.5):
        module = Scaled(scale)
        assert torch.equal(step(module, x), scaled_step(module, x))
    assert step.compiled_graphs == 2


def test_a_damaged_saved_graph_is_compiled_again_and_replaced():
    module, x = Scaled(7.0), torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    before = set(graphs_dir().glob("*.bin")) if graphs_dir().is_dir() else set()
    Precompiled(scaled_step, torch.device("cpu"))(module, x)
    (saved,) = set(graphs_dir().glob("*.bin")) - before
    saved.write_bytes(b"not a graph")
    step = Precompiled(scaled_step, torch.device("cpu"))
    assert torch.equal(step(module, x), scaled_step(module, x))
    assert (step.compiled_graphs, step.loaded_graphs) == (1, 0)
    assert saved.read_bytes() != b"not a graph"
    assert Precompiled(scaled_step, torch.device("cpu")).loaded_graphs == 0  # loads only when called ...
    reread = Precompiled(scaled_step, torch.device("cpu"))
    reread(module, x)
    assert (reread.compiled_graphs, reread.loaded_graphs) == (0, 1)  # ... and the replacement loads


def test_the_graphs_key_changes_with_any_source_of_the_package(tmp_path, monkeypatch):
    """A saved graph holds traced code: a change to any module of the package must not load it."""
    import specula.runtime.precompiled as precompiled

    (tmp_path / "module.py").write_text("x = 1\n")
    monkeypatch.setattr(precompiled, "PACKAGE", tmp_path)
    source_key.cache_clear()
    try:
        before = source_key()
        source_key.cache_clear()
        (tmp_path / "module.py").write_text("x = 2\n")
        assert source_key() != before
    finally:
        source_key.cache_clear()


def test_inductors_vector_isa_probe_runs_once_per_machine():
    """The probe (a build and a subprocess per ISA, ~1.3 s a process) is recorded; a later process that finds the
    record skips it and gets the same ISAs; a record that does not match what the CPU offers is probed again."""
    from torch._inductor import config, cpu_vec_isa

    from specula.runtime.precompiled import skip_known_vector_isa_probe

    record = graphs_dir() / "vector-isas.txt"
    chosen = config.cpp.vec_isa_ok
    try:
        for before in (None, "an ISA this CPU does not offer"):
            config.cpp.vec_isa_ok = None
            record.unlink(missing_ok=True)
            if before is not None:
                record.write_text(before)
            skip_known_vector_isa_probe()  # probes (the record is missing or wrong) and records
            cpu_vec_isa.valid_vec_isa_list.cache_clear()
            probed = ",".join(map(str, cpu_vec_isa.valid_vec_isa_list()))
            assert record.read_text() == probed
        config.cpp.vec_isa_ok = None
        skip_known_vector_isa_probe()  # as a later process: the record stands for the probe
        assert config.cpp.vec_isa_ok is True
        assert ",".join(map(str, cpu_vec_isa.valid_vec_isa_list())) == probed
    finally:
        config.cpp.vec_isa_ok = chosen
        cpu_vec_isa.valid_vec_isa_list.cache_clear()


def test_only_the_most_recent_graph_directories_are_kept(tmp_path, monkeypatch):
    """Each version of the package saves its graphs in a directory of its own; older ones do not pile up."""
    import os

    import specula.runtime.precompiled as precompiled

    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))
    (tmp_path / "graphs").mkdir()
    for age in range(6):
        old = tmp_path / "graphs" / f"version-{age}"
        old.mkdir()
        (old / "graph-0.bin").write_bytes(b"x")
        os.utime(old, (1_000_000 - age, 1_000_000 - age))
    precompiled.prune_graph_directories(keep=4)
    assert sorted(path.name for path in (tmp_path / "graphs").iterdir()) == [f"version-{age}" for age in range(4)]


def test_calls_of_objects_since_gone_are_forgotten(monkeypatch):
    """A server makes new objects per request (caches, drafter forks): the calls remembered for them go once the
    objects do, so the table stays bounded."""
    import specula.runtime.precompiled as precompiled

    monkeypatch.setattr(precompiled, "MAX_CALLS", 8)
    step = Precompiled(scaled_step, torch.device("cpu"))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(4))
    kept = Scaled(2.5)
    step(kept, x)
    for _ in range(20):
        module = Scaled(2.5)
        assert torch.equal(step(module, x), scaled_step(module, x))
        del module
    assert len(step._calls) <= 8
    assert step.compiled_graphs == 1  # every module of these constants ran the one graph
    assert torch.equal(step(kept, x), scaled_step(kept, x))
