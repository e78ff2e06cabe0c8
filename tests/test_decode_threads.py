"""Decode steps run on the thread count measured faster, only where Specula chose the count, with the same bits."""

from __future__ import annotations

import pathlib
import threading

import pytest
import torch
from conftest import LLAMA2XS, STORIES

import specula
from specula import openmp
from specula.kernels import attention, q4_1
from specula.runtime import decode_threads as threads_module
from specula.runtime.decode_threads import DecodeThreads, decode_threads
from specula.runtime.target import Target


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(chooser: DecodeThreads, clock: FakeClock, cost: dict[int, float], steps: int) -> list[int]:
    """``steps`` steps, each taking cost[its thread count] seconds on the fake clock → the counts they ran on."""
    used = []
    for _ in range(steps):
        with chooser.step() as option:
            assert torch.get_num_threads() == option
            clock.now += cost[option]
        used.append(option)
    return used


def test_the_faster_option_runs_after_both_are_timed_and_a_change_of_load_is_followed():
    clock, before = FakeClock(), torch.get_num_threads()
    chooser = DecodeThreads((1, 2), probe=3, recheck=10, clock=clock)
    probe = run_steps(chooser, clock, {1: 0.010, 2: 0.008}, 6)
    assert probe == [1, 2, 1, 2, 1, 2]  # in turn, so both see the same mix of blocks
    assert set(run_steps(chooser, clock, {1: 0.010, 2: 0.008}, 10)) == {2} and chooser.chosen == 2
    run_steps(chooser, clock, {1: 0.010, 2: 0.030}, 6)  # the machine got busy: two threads collapse
    assert set(run_steps(chooser, clock, {1: 0.010, 2: 0.030}, 10)) == {1} and chooser.chosen == 1
    assert torch.get_num_threads() == before  # torch's setting comes back after every step


def test_a_clear_loser_is_tried_again_less_and_less_often():
    clock = FakeClock()
    chooser = DecodeThreads((1, 2), probe=2, recheck=10, clock=clock)
    busy = {1: 0.010, 2: 0.040}
    used = run_steps(chooser, clock, busy, 4 + 10 + 4 + 20 + 4 + 40 + 4)
    probes_at = [i for i in range(1, len(used)) if used[i] == 2]
    assert probes_at == [1, 14, 37, 80]  # one probe step each (a clear loss ends it), 10, 20, 40 steps apart + probes
    chooser = DecodeThreads((1, 2), probe=2, recheck=10, clock=clock)
    run_steps(chooser, clock, {1: 0.010, 2: 0.012}, 4 + 10 + 4)  # a close call: the usual wait
    assert run_steps(chooser, clock, {1: 0.010, 2: 0.012}, 10) == [1] * 10 and chooser.next_option() == 1


def test_a_thread_count_the_user_chose_is_kept(monkeypatch):
    monkeypatch.setattr(openmp, "_auto_threads", False)
    with decode_threads(torch.device("cpu")) as chosen:
        assert chosen is None
    monkeypatch.setattr(openmp, "_auto_threads", True)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with decode_threads(torch.device("cpu")) as chosen:
        assert chosen is None


def test_where_specula_chose_two_cpus_take_turns(monkeypatch):
    monkeypatch.setattr(openmp, "_auto_threads", True)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads_module.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(threads_module, "_shared", None)
    torch.set_num_threads(1)
    used = []
    for _ in range(4):
        with decode_threads(torch.device("cpu")) as option:
            used.append(option)
    assert used == [1, 2, 1, 2]


@pytest.mark.skipif(q4_1.unavailable_reason() is not None or attention.unavailable_reason() is not None,
                    reason="the q4_1 and attention kernels are needed")
def test_a_native_step_gives_the_same_bits_on_one_thread_and_two():
    target = Target.load(LLAMA2XS, dtype="float32", weights="q4_1")
    assert target.runtime.native() is not None
    prompt = torch.randint(3, target.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    target.prefill(prompt)
    before = torch.get_num_threads()
    outputs = []
    for count in (1, 2):
        torch.set_num_threads(count)
        block = torch.randint(3, target.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
        outputs.append(target.forward(block).logits)
        target.truncate(len(prompt))
    torch.set_num_threads(before)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.skipif(q4_1.unavailable_reason() is not None or attention.unavailable_reason() is not None,
                    reason="the q4_1 and attention kernels are needed")
def test_a_packed_server_step_gives_the_same_bits_on_one_thread_and_two():
    """A server pass carrying a joining prompt runs on both CPUs (`prompt_threads`): its decode rows too."""
    from test_native_decoder import packed_outputs

    target = Target.load(LLAMA2XS, dtype="float32", weights="q4_1")
    before, logits = torch.get_num_threads(), []
    for count in (1, 2):
        torch.set_num_threads(count)
        logits.append([out.logits for out in packed_outputs(target, 3)[0]])
    torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*logits, strict=True))


def _os_threads() -> int:
    return len(list(pathlib.Path("/proc/self/task").iterdir()))


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_a_thread_that_released_its_openmp_team_leaves_no_openmp_threads_behind():
    # The server's engine steps the model on its own thread; the loading thread's idle team would make GNU OpenMP
    # throttle every team's spinning (`specula.openmp.release_thread_team`).
    current = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(4_000_000).add_(1)  # a parallel region: this thread now keeps a team of two
        with_team = _os_threads()
        assert openmp.release_thread_team()
        assert _os_threads() < with_team
        torch.ones(4_000_000).add_(1)  # and a new team serves the next region
        assert _os_threads() == with_team
    finally:
        torch.set_num_threads(current)


@pytest.mark.skipif(not pathlib.Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_a_generation_on_a_worker_thread_leaves_no_openmp_threads_on_it():
    # A web app generates on a pool of long-lived threads: the team one generation leaves on its thread would
    # slow the next generation, on another thread, as the loading thread's team slowed the server's engine.
    speculator = specula.load(STORIES, method="vanilla", dtype="float32", threads=None)
    current = torch.get_num_threads()
    torch.set_num_threads(2)
    counts = []

    def worker():
        torch.ones(4_000_000).add_(1)  # this thread keeps a team of two, as a generation's steps would leave it
        counts.append(_os_threads())
        speculator.generate("Once upon a time", max_new_tokens=4)
        counts.append(_os_threads())

    try:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(current)
    with_team, after = counts
    assert after < with_team
