"""How many threads a decode step runs on, where Specula chose the count itself: measured, not assumed.

On a machine of at most two CPUs Specula decodes on one thread (`specula.openmp.default_threads`): a step of many
small operations paid more for a second thread than it gained, and a second thread collapses as soon as another
process wants the core. Since the native decoder stack (`specula.runtime.native_decoder`) makes a step a few large
calls, an idle 2-core AMD EPYC decodes SmolLM2 q4_1 1.45x faster on two threads that spin between the step's calls
(OpenMP's default spin: vanilla 131-140 against 92-93 tokens/s, suffix 206-231 against 159-162; Specula's shorter
`specula.openmp.SPIN_COUNT` does as well), while beside one busy process two threads run 2.5-3x slower than one
(32-34 against 79-94). Which holds depends on the
machine's load, which changes, so each option is timed on the steps themselves: `PROBE` steps on each, in turn step
after step, then the faster (by median step time) for `RECHECK` steps before both are timed again (twice as long
each time the loser loses clearly, `CLEAR_LOSS`). Every kernel computes each output on one thread in a fixed order,
so the tokens do not depend on the choice (`tests/test_decode_threads.py`).

Only where Specula chose the thread count (`specula.openmp.auto_threads`: the command line without ``--threads``,
``specula.load(threads="auto")``), on a CPU target of a machine of at most two CPUs, without ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from specula.openmp import auto_threads, few_cpus

PROBE = 4  # steps timed on each option each time they are compared
RECHECK = 256  # steps on the faster option before both are timed again
# A loser this much slower than the winner (a busy machine's two threads) waits twice as long to be tried again, up
# to `LONGEST_RECHECK` steps: its probe steps are the chooser's whole cost.
CLEAR_LOSS = 1.5
LONGEST_RECHECK = 4096


class DecodeThreads:
    """Chooses between ``options`` (thread counts) by timing the steps run on each (see the module)."""

    def __init__(self, options: tuple[int, ...], probe: int = PROBE, recheck: int = RECHECK,
                 clock: Callable[[], float] = time.perf_counter):
        self.options, self.probe, self.recheck, self.clock = options, probe, recheck, clock
        self.times = {option: deque(maxlen=probe) for option in options}
        self.chosen = options[0]
        self._plan: deque[int] = deque(self._probe())
        self._wait = recheck  # steps before the next comparison
        self._clear_winner: int | None = None  # the last comparison's winner, where it won clearly

    def _probe(self) -> list[int]:
        # The options in turn, step after step: consecutive steps verify blocks of like sizes, so each option's
        # median describes the same mix of blocks.
        return [option for _ in range(self.probe) for option in self.options]

    def next_option(self) -> int:
        """The thread count for the next step."""
        if not self._plan:
            ranked = sorted(self.options, key=self._median)
            clear = self._median(ranked[1]) >= CLEAR_LOSS * self._median(ranked[0])
            again = clear and ranked[0] == self._clear_winner  # the same clear outcome as last time
            self._wait = min(2 * self._wait, LONGEST_RECHECK) if again else self.recheck
            self.chosen, self._clear_winner = ranked[0], ranked[0] if clear else None
            self._plan.extend([self.chosen] * self._wait + self._probe())
        return self._plan.popleft()

    def record(self, option: int, seconds: float) -> None:
        self.times[option].append(seconds)
        if option != self.chosen and seconds >= CLEAR_LOSS * self._median(self.chosen):
            # Lost clearly at once (two threads beside a busy process take 3-8x a step): the rest of this probe
            # would cost as much again and say nothing new.
            self._plan = deque(planned for planned in self._plan if planned != option)

    def _median(self, option: int) -> float:
        times = self.times[option]
        return statistics.median(times) if times else float("inf")

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """Run the body (one decode step) on the next option's threads, timed; torch's setting comes back after."""
        option, current = self.next_option(), torch.get_num_threads()
        if option != current:
            torch.set_num_threads(option)
        start = self.clock()
        try:
            yield option
        finally:
            self.record(option, self.clock() - start)
            if option != current:
                torch.set_num_threads(current)


def spare_cpus(device: torch.device) -> int | None:
    """The CPUs a block on ``device`` may run on beyond torch's setting: all of them where Specula chose the thread
    count (`specula.openmp.auto_threads`: a user's ``--threads N`` or ``specula.load(threads=N)`` holds), ``device``
    is the CPU of a machine of at most two (`specula.openmp.few_cpus`), torch runs on fewer, and the user set no
    ``OMP_NUM_THREADS``; else None. Shared by prompts (`specula.runtime.target.prompt_threads`) and decode steps."""
    if not auto_threads():  # asked first: a decode step asks every time, and os.cpu_count costs ~6 us
        return None
    cpus = os.cpu_count() or 1
    if (device.type != "cpu" or not few_cpus(cpus) or "OMP_NUM_THREADS" in os.environ
            or torch.get_num_threads() >= cpus):
        return None
    return cpus


_shared: DecodeThreads | None = None


def decode_threads(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a decode step on ``device`` runs in: `DecodeThreads.step` of the process's chooser where it applies
    (see the module), else nothing."""
    global _shared
    cpus = spare_cpus(device)
    if cpus is None:
        return contextlib.nullcontext()
    if _shared is None:
        _shared = DecodeThreads((1, cpus))  # torch runs on fewer than cpus <= 2: one
    return _shared.step()
