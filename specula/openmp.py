"""OpenMP's waiting policy: a short spin in Specula's own process on a machine of at most two CPUs unless the user
chose one (docs/defaults.md, "OpenMP waiting"); programs Specula starts that are not Specula get the environment the
user gave. And the thread count that goes with it (`default_threads`).

Imported by ``specula/__init__.py`` before torch loads (this module must not import it).
"""

from __future__ import annotations

import ctypes
import os

# Variables through which a user chooses how OpenMP threads wait; any one of them set keeps ours out.
USER_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# Machines with at most this many CPUs decode on one torch thread unless told otherwise, each decode step on one or
# two as timed (`specula.runtime.decode_threads`): two spinning threads are 1.35x faster on an idle 2-core AMD EPYC
# since the native decoder stack, and take the cores from each other as soon as anything else runs.
# Larger machines keep OpenMP's own waiting (spinning a while) and torch's thread count: on a 16-core Xeon, SmolLM2's
# q4_1 step took 12-25 ms on 16 spinning threads, 29-57 ms on 16 passive ones and 28-37 ms on one (docs/defaults.md,
# "Threads").
ONE_THREAD_UP_TO_CPUS = 2

# Whether `wait_briefly_unless_chosen` set GOMP_SPINCOUNT itself (then the user's environment had no policy).
set_by_specula = False
# Spins of an idle OpenMP thread before it sleeps, on a machine of at most `ONE_THREAD_UP_TO_CPUS` CPUs. The
# bicycle answer of the README (76 tokens, suffix, no flags, two threads chosen): 8.5 ms a cycle with 10,000,
# 9.2 with 30,000, ~16 passive; one thread 11.8-12.1 (2-core AMD EPYC, idle).
SPIN_COUNT = 10_000

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


def wait_briefly_unless_chosen(cpus: int | None = None) -> None:
    """Set GOMP_SPINCOUNT=`SPIN_COUNT` for this process on a machine of at most `ONE_THREAD_UP_TO_CPUS` CPUs
    (``cpus``, default `os.cpu_count`) unless the user chose a policy: an OpenMP thread spins that long after a
    parallel region (tens of microseconds), then sleeps.

    OpenMP's default spinning (300,000) lets torch's runtime and the system one Specula's kernels link take the few
    cores from each other and from other processes; passive waiting (no spin) wakes a sleeping thread for every
    parallel region, which made two threads slower than one (docs/defaults.md, "OpenMP waiting"). A short spin keeps
    a second thread awake between the regions of one decode step and lets it sleep between steps; where the machine
    is busy, `specula.runtime.decode_threads` finds two threads slower and decodes on one.
    """
    global set_by_specula
    if few_cpus(cpus) and not any(name in os.environ for name in USER_POLICY_VARIABLES):
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
        set_by_specula = True


def foreign_environment() -> dict[str, str]:
    """The environment for a program Specula starts that is not Specula (llama.cpp's ``llama-server``): ours
    without the policy Specula set for itself. Inherited, Specula's former passive policy cost llama.cpp 2/3 of its
    speed: its threads meet at a barrier per operation, and woken by the kernel at each one (100 % system time)
    SmolLM2 q4_1 decoded at 37.8 tokens/s instead of 114 on 2 cores (docs/defaults.md)."""
    environment = dict(os.environ)
    if set_by_specula and environment.get("GOMP_SPINCOUNT") == str(SPIN_COUNT):
        del environment["GOMP_SPINCOUNT"]
    return environment


def default_threads(cpus: int | None = None) -> int | None:
    """The torch threads Specula decodes on unless told otherwise: 1 on a machine of at most `ONE_THREAD_UP_TO_CPUS`
    CPUs (``cpus``, default `os.cpu_count`), else None (torch's own choice)."""
    return 1 if few_cpus(cpus) else None


# The names an OpenMP runtime torch brings answers to once loaded: GNU's (Linux wheels), LLVM's and Intel's.
OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so", "libiomp5.so", "libomp.dylib", "libiomp5.dylib")


def release_thread_team() -> bool:
    """Let go of the OpenMP threads the calling thread keeps for its parallel regions (``omp_pause_resource_all``
    in the runtime already loaded; nothing is loaded for it). Returns whether a runtime took the call.

    Every thread that runs a parallel region keeps a team of its own, and GNU OpenMP cuts its threads' spinning to
    almost nothing once the process holds more OpenMP threads than CPUs: each region then wakes a sleeping thread.
    The server loads its model on one thread and decodes on another (`specula.serve.engine`), so the loading
    thread's idle team made the decoding thread's two-thread SmolLM2 q4_1 steps 13.7-15 ms where the same steps on
    the loading thread took 6.5-7 ms (2-core AMD EPYC); with the loading thread's team released, 6.5-6.8 ms on the
    engine's thread. The thread gets a new team the next time it runs a parallel region (~0.1 ms). GNU OpenMP
    (torch's Linux wheels) lets go of the calling thread's team alone; LLVM's and Intel's runtimes take the same
    call as a soft pause (their threads sleep until the next region), measured only with GNU OpenMP here."""
    if not hasattr(os, "RTLD_NOLOAD"):
        return False
    for name in OPENMP_RUNTIMES:
        try:
            runtime = ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
        pause = getattr(runtime, "omp_pause_resource_all", None)
        if pause is not None:
            return pause(1) == 0  # omp_pause_soft: the runtime keeps its state, the threads go
    return False
