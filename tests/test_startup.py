"""What a process pays before `specula generate`'s first token: only the subcommand's own modules load, on a
machine of at most two CPUs OpenMP threads wait passively unless the user chose otherwise, and a prompt runs on
both of its CPUs with the same bits as on one. No timing is asserted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import STORIES

from specula import openmp
from specula.runtime import target as target_module
from specula.runtime.target import Target

PROBE = ("import os, sys; import specula.cli as cli; cli.build_parser('generate'); "
         "print(os.environ.get('GOMP_SPINCOUNT'), "
         "sorted({m.split('.')[1] for m in sys.modules if m.startswith('specula.') and m.count('.') >= 1}))")


def probe(code: str = PROBE, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


def test_generate_loads_neither_the_trainers_nor_the_benchmark_nor_the_certifier():
    policy, packages = probe().split(" ", 1)
    assert policy == (str(openmp.SPIN_COUNT) if openmp.few_cpus() else "None")  # larger: OpenMP's own waiting
    for heavy in ("training", "bench", "certify", "serve"):
        assert f"'{heavy}'" not in packages


def test_the_full_help_lists_every_subcommand_without_importing_transformers():
    """`specula --help` builds every subcommand's parser; importing `transformers` for it took 3.3 of its 6 s on a
    2-core AVX2 machine, and no parser needs it."""
    assert probe("import sys; import specula.cli as cli; cli.build_parser(); print('transformers' in sys.modules)") \
        == "False"


def test_a_wait_policy_the_user_chose_is_kept():
    assert probe(OMP_WAIT_POLICY="ACTIVE").startswith("None ")
    assert probe(GOMP_SPINCOUNT="1000").startswith("1000 ")


@pytest.mark.parametrize("cpus, policy", [(1, "10000"), (2, "10000"), (3, None), (16, None)])
def test_threads_spin_briefly_only_on_a_machine_of_at_most_two_cpus(cpus, policy, monkeypatch):
    """On 2 cores long-spinning threads take the cores from each other and passive ones wake too slowly; on 16
    OpenMP's own spinning decoded 1.5-3x faster than passive waiting (docs/defaults.md, "Threads")."""
    clean = {k: v for k, v in os.environ.items() if k not in openmp.USER_POLICY_VARIABLES}
    monkeypatch.setattr(os, "environ", clean)  # the process's own environment stays as it was
    monkeypatch.setattr(openmp, "set_by_specula", False)
    openmp.wait_briefly_unless_chosen(cpus)
    assert os.environ.get("GOMP_SPINCOUNT") == policy
    assert openmp.set_by_specula == (policy is not None)
    assert openmp.default_threads(cpus) == (1 if policy else None)  # one thread, each step on one or two as timed


@pytest.mark.parametrize("weights", ["float32", "q4_1"])
def test_a_prompt_runs_on_both_cpus_of_a_small_machine_with_the_same_bits(weights, monkeypatch):
    target = Target.load(STORIES, dtype="float32", weights=weights)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    threads, forward = [], target.runtime.forward

    def spy(*args, **kwargs):
        threads.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    monkeypatch.setattr(target.runtime, "forward", spy)
    prompt, previous, outputs = torch.arange(3, 103), torch.get_num_threads(), []
    torch.set_num_threads(1)  # what a 2-CPU machine decodes on
    openmp.set_auto_threads(True)  # Specula chose the threads (the conftest fixture sets it back after the test)
    try:
        for first_threaded_prompt in (target_module.PROMPT_THREADS_FROM, 10 ** 9):  # then never: one thread
            monkeypatch.setattr(target_module, "PROMPT_THREADS_FROM", first_threaded_prompt)
            target.reset()
            target.reserve(200)
            prompt_logits = target.forward(prompt, last_logits_only=True).logits
            target.commit()
            outputs.append((prompt_logits, target.forward(torch.tensor([7])).logits))  # reads the prompt's cache
        # The prompts (calls 0 and 2): on two threads, then on one; the steps between are the chooser's
        # (`specula.runtime.decode_threads`). torch's setting is back to one after each.
        assert threads[0::2] == [2, 1] and torch.get_num_threads() == 1
        # A thread count the user chose (specula.load(threads=1), --threads 1) holds for prompts too.
        openmp.set_auto_threads(False)
        monkeypatch.setattr(target_module, "PROMPT_THREADS_FROM", 8)
        target.reset()
        target.forward(prompt, last_logits_only=True)
        assert threads[-1] == 1
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))
