"""OpenMP's waiting policy: passive in Specula's own process on a machine of at most two CPUs unless the user chose
one (docs/defaults.md, "OpenMP waiting"); programs Specula starts that are not Specula get the environment the user
gave. And the thread count that goes with it (`default_threads`).

Imported by ``specula/__init__.py`` before torch loads (this module must not import it).
"""

from __future__ import annotations

import os

# Variables through which a user chooses how OpenMP threads wait; any one of them set keeps ours out.
USER_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# Machines with at most this many CPUs decode on one torch thread whose OpenMP threads wait passively, unless told
# otherwise: a step of a small model is many small operations, a second thread woken passively for each costs more
# than it gives, and spinning threads take the cores from each other as soon as anything else runs (2-core AMD EPYC).
# Larger machines keep OpenMP's own waiting (spinning a while) and torch's thread count: on a 16-core Xeon, SmolLM2's
# q4_1 step took 12-25 ms on 16 spinning threads, 29-57 ms on 16 passive ones and 28-37 ms on one (docs/defaults.md,
# "Threads").
ONE_THREAD_UP_TO_CPUS = 2

# Whether `wait_passively_unless_chosen` set OMP_WAIT_POLICY itself (then the user's environment had none).
set_by_specula = False

_auto_threads = False  # see auto_threads


def auto_threads() -> bool:
    """Whether Specula chose the thread count itself (`default_threads`, for the command line without --threads or
    ``specula.load(threads="auto")``): then a decode step may run on more (`specula.runtime.decode_threads`)."""
    return _auto_threads


def set_auto_threads(chosen_by_specula: bool) -> None:
    global _auto_threads
    _auto_threads = chosen_by_specula


def few_cpus(cpus: int | None = None) -> bool:
    """Whether the machine has at most `ONE_THREAD_UP_TO_CPUS` CPUs (``cpus``, default `os.cpu_count`)."""
    cpus = os.cpu_count() if cpus is None else cpus
    return cpus is not None and cpus <= ONE_THREAD_UP_TO_CPUS


def wait_passively_unless_chosen(cpus: int | None = None) -> None:
    """Set OMP_WAIT_POLICY=PASSIVE for this process on a machine of at most `ONE_THREAD_UP_TO_CPUS` CPUs (``cpus``,
    default `os.cpu_count`) unless the user chose a policy.

    torch's OpenMP runtime and the system one Specula's kernels link each keep their threads spinning between
    parallel regions, so on a machine whose few cores are busy they take the cores from each other.
    """
    global set_by_specula
    if few_cpus(cpus) and not any(name in os.environ for name in USER_POLICY_VARIABLES):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        set_by_specula = True


def foreign_environment() -> dict[str, str]:
    """The environment for a program Specula starts that is not Specula (llama.cpp's ``llama-server``): ours
    without the policy Specula set for itself. Inherited, it cost llama.cpp 2/3 of its speed: its threads meet at
    a barrier per operation, and woken by the kernel at each one (100 % system time) SmolLM2 q4_1 decoded at
    37.8 tokens/s instead of 114 on 2 cores (docs/defaults.md)."""
    environment = dict(os.environ)
    if set_by_specula and environment.get("OMP_WAIT_POLICY") == "PASSIVE":
        del environment["OMP_WAIT_POLICY"]
    return environment


def default_threads(cpus: int | None = None) -> int | None:
    """The torch threads Specula decodes on unless told otherwise: 1 on a machine of at most `ONE_THREAD_UP_TO_CPUS`
    CPUs (``cpus``, default `os.cpu_count`), else None (torch's own choice)."""
    return 1 if few_cpus(cpus) else None
