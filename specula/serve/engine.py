"""The decoding engine behind the server: requests in, streams of text events out.

The HTTP side only knows `Engine`: ``submit(request) -> RequestStream`` (an async
iterator of `TextDelta` events ending in one `Finished` or `Failed`),
``RequestStream.cancel()``, and the load figures the metrics and the graceful
shutdown read. `BatchedEngine` implements it with continuous batching: one worker
thread keeps up to ``max_batch`` sequences going, each in a slot of its own (a
`Target.fork` with its own KV cache and a `Drafter.fork`, weights shared), and runs
one packed target forward per cycle for all of them (`specula.runtime.packed`). A request
joins at the next cycle after a slot frees, and leaves the moment it ends, which
frees its slot (its cache shrinks back to its first allocation). How many tokens each
sequence drafts shrinks with the batch (`specula.draft_budget`).

Threads: `submit` runs on the asyncio loop; the worker posts events back with
``loop.call_soon_threadsafe`` onto the request's asyncio queue. Cancelling sets a
threading.Event the worker reads after every cycle, so a request whose client
went away stops at its next cycle (or is skipped if still queued).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from specula.decoding import GenerationStats, Sequence
from specula.detokenize import IncrementalDecoder
from specula.draft_budget import DEFAULT_MAX_BATCH, MAX_DEPTH, DraftBudget, measured_curve
from specula.errors import SpeculaError
from specula.openmp import release_thread_team
from specula.runtime.packed import forward_packed
from specula.sampling import SamplingParams
from specula.serve.metrics import ServerMetrics
from specula.serve.requests import (
    EngineStopped,
    Failed,
    Finished,
    GenerationRequest,
    QueueFull,
    RequestStream,
    TextDelta,
)
from specula.serve.stops import StopMatcher

log = logging.getLogger("specula.serve")


@dataclass
class Slot:
    """What one sequence decodes with: a fork of the target (its KV cache) and of the drafter (its state)."""

    target: object
    drafter: object


@dataclass
class Running:
    """A request being generated in a slot."""

    stream: RequestStream
    slot: Slot
    sequence: Sequence
    text: IncrementalDecoder
    stops: StopMatcher

    @property
    def stats(self) -> GenerationStats:
        return self.sequence.stats


class BatchedEngine:
    """Up to ``max_batch`` sequences per target forward, joining and leaving between cycles; a FIFO queue of at
    most ``max_queue`` waiting requests. ``budget``: how deep each sequence drafts by batch size (default:
    measured when it starts)."""

    def __init__(self, speculator, max_queue: int = 64, metrics: ServerMetrics | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, budget: DraftBudget | None = None):
        if max_queue < 1:
            raise SpeculaError(f"max_queue must be >= 1, got {max_queue}")
        if max_batch < 1:
            raise SpeculaError(f"max_batch must be >= 1, got {max_batch}")
        self.speculator = speculator
        self.method = str(getattr(speculator, "method", ""))
        self.max_batch = max_batch
        self.budget = budget
        self.metrics = metrics or ServerMetrics()
        self._queue: queue.Queue[RequestStream | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()  # guards _unfinished and _stopping against the worker
        self._unfinished = 0  # submitted and not yet ended
        self._running: list[Running] = []
        # A compiled target runs one sequence at a time, in the speculator's own slot (forks and packed
        # batches run eager, and the two round differently). Otherwise every slot is a fork, so the
        # speculator itself stays free for its own generate() calls.
        if getattr(speculator.target, "compiled", False):
            if max_batch != 1:
                raise SpeculaError("a compiled target decodes one sequence at a time: use max_batch 1 with compile "
                                   "(batched steps run eager)")
            self._free: list[Slot] = [Slot(speculator.target, speculator.drafter)]
        else:
            self._free = []
        self._stopping = False
        self._exit = False
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- the Engine interface

    def start(self) -> None:
        # The worker steps the model; the thread that loaded it (this one) keeps OpenMP threads it no longer needs,
        # which on a CPU double the time of the worker's steps (`specula.openmp.release_thread_team`).
        release_thread_team()
        self._thread = threading.Thread(target=self._work, name="specula-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, fail the queued ones (503), stop the running ones and end the worker."""
        with self._lock:
            self._stopping = True
        for running in list(self._running):
            running.stream.cancel()
        while True:
            try:
                stream = self._queue.get_nowait()
            except queue.Empty:
                break
            if stream is not None:
                stream.post(Failed(503, "the server is shutting down"))
                self._ended()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> RequestStream:
        stream = RequestStream(request, asyncio.get_running_loop())
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            try:
                self._queue.put_nowait(stream)
            except queue.Full:
                raise QueueFull(f"the request queue is full ({self._queue.maxsize} waiting)") from None
            self._unfinished += 1
        self._update_gauges()
        return stream

    @property
    def queue_length(self) -> int:
        return self._queue.qsize()

    @property
    def batch_size(self) -> int:
        return len(self._running)

    @property
    def idle(self) -> bool:
        return self._unfinished == 0

    # ---------------------------------------------------------------- the worker

    def _measured_budget(self) -> DraftBudget:
        """The draft budget over a verify-cost curve measured now, on the worker's thread, the one that runs every
        step. Measured on the event loop's thread before the worker started (as it was), the server then decoded
        suffix at one client at 79-92 tokens/s where the same server with no measurement ran 125-136 (a fixed
        table) and this one 109-131 (docs/benchmarks/serve-smollm2-draft-cost): forwards on a second thread left
        the worker's two-thread steps 17-19 ms against 10-12 on one. A curve that cannot be measured leaves
        drafting uncapped, logged."""
        try:
            return DraftBudget(measured_curve(self.speculator.target, self.max_batch), max_batch=self.max_batch)
        except Exception:
            log.exception("could not measure the verify-cost curve; drafting uncapped at every batch size")
            return DraftBudget(table={1: MAX_DEPTH}, max_batch=self.max_batch)

    def _work(self) -> None:
        if self.budget is None:
            self.budget = self._measured_budget()
        while not (self._exit and not self._running):
            try:
                self._admit()
                if self._running:
                    self._cycle()
            except Exception:  # never let the worker die: fail what was running, go on
                log.exception("the engine failed outside a generation")
                for running in list(self._running):
                    self._end(running, Failed(500, "the server failed while generating; the request can be retried"))

    def _admit(self) -> None:
        """Start queued requests while slots are free (waiting for one when nothing runs)."""
        while not self._exit and len(self._running) < self.max_batch:
            try:
                stream = self._queue.get(block=not self._running)
            except queue.Empty:
                return
            if stream is None:
                self._exit = True
                return
            self._start(stream)

    def _start(self, stream: RequestStream) -> None:
        request = stream.request
        if self._stopping:  # taken off the queue just as stop() emptied it
            self._post_failed(stream, Failed(503, "the server is shutting down"))
            return
        if stream.cancelled:  # its client left while it waited
            self._post_finished(stream, Finished("cancelled", len(request.prompt_ids), 0, self.method))
            return
        slot = None
        try:
            slot = self._take_slot()
            params = SamplingParams(request.temperature, 0, request.top_p)
            prompt = torch.tensor(request.prompt_ids, dtype=torch.long)
            sequence = Sequence(slot.target, slot.drafter, prompt, request.max_tokens, params, request.seed,
                                acceptor=self.speculator.acceptor, budget=self.budget)
            running = Running(stream, slot, sequence, IncrementalDecoder(self.speculator.tokenizer),
                              StopMatcher(request.stop))
        except Exception as err:  # this request fails alone; its slot goes back
            if slot is not None:
                self._free.append(slot)
            self._post_failed(stream, _failure(err))
            return
        self._running.append(running)
        self._update_gauges()

    def _take_slot(self) -> Slot:
        if self._free:
            return self._free.pop()
        return Slot(self.speculator.target.fork(), self.speculator.drafter.fork())

    def _cycle(self) -> None:
        """One packed target forward for every running sequence, then each takes its tokens."""
        batch = len(self._running)
        ready, blocks = [], []
        for running in list(self._running):
            try:
                blocks.append(running.sequence.block(batch=batch))  # drafted as deep as the budget allows
            except Exception as err:
                self._end(running, _failure(err))
                continue
            ready.append(running)
        if not ready:
            return
        try:
            outputs = forward_packed([r.slot.target for r in ready], blocks)
        except Exception:
            # Find the block that fails by running each alone (a block writes after its sequence's committed
            # prefix, so running it again is safe); only that request fails.
            outputs = []
            for running, block in zip(list(ready), blocks, strict=True):
                try:
                    outputs.append(block.run(running.slot.target))
                except Exception as err:
                    ready.remove(running)
                    self._end(running, _failure(err))
        for running, output in zip(ready, outputs, strict=True):
            try:
                new = running.sequence.advance(output)
            except Exception as err:
                self._end(running, _failure(err))
                continue
            self._emit(running, new)

    def _emit(self, running: Running, new: list[int]) -> None:
        stats, stream = running.stats, running.stream
        if stats.cycles == 1:
            self.metrics.time_to_first_token.observe(time.perf_counter() - stream.submitted)
        text, stopped = running.stops.push(running.text.push(new))
        if running.sequence.done and not stopped:
            rest, stopped = running.stops.push(running.text.finish())
            text += rest
        stream.post(TextDelta(text, new))
        if stopped:
            self._end(running, self._finished(running, "stop"))
        elif stream.cancelled:
            self._end(running, self._finished(running, "cancelled"))
        elif running.sequence.done:
            rest = running.stops.flush()
            if rest:
                stream.post(TextDelta(rest, []))
            self._end(running, self._finished(running, "stop" if stats.stop_reason == "eos" else "length"))

    def _finished(self, running: Running, reason: str) -> Finished:
        stats = running.stats
        return Finished(reason, stats.prompt_tokens, stats.new_tokens, self.method, stats.tau,
                        list(stats.accepted_lengths), stats.cycles)

    def _end(self, running: Running, event: Finished | Failed) -> None:
        """The request leaves its slot (free at once for the next one; the next `Sequence` resets its cache and
        drafter state) with its last event."""
        self._running.remove(running)
        # An idle slot should not hold the KV memory of the longest request it ever served.
        running.slot.target.release()
        self._free.append(running.slot)
        if isinstance(event, Finished):
            self._post_finished(running.stream, event)
        else:
            self._post_failed(running.stream, event)

    def _post_finished(self, stream: RequestStream, finished: Finished) -> None:
        m = self.metrics
        m.generations.labels(finish_reason=finished.finish_reason).inc()
        m.prompt_tokens.inc(finished.prompt_tokens)
        m.generated_tokens.inc(finished.completion_tokens)
        if finished.cycles:
            m.tau.observe(finished.tau)
        stream.post(finished)
        self._ended()

    def _post_failed(self, stream: RequestStream, failed: Failed) -> None:
        self.metrics.generations.labels(finish_reason="error").inc()
        stream.post(failed)
        self._ended()

    def _ended(self) -> None:
        with self._lock:
            self._unfinished -= 1
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.queue_length.set(self.queue_length)
        self.metrics.batch_size.set(len(self._running))


def _failure(err: Exception) -> Failed:
    """A request's error as the client sees it: its own fault (400) or the server's (500, logged)."""
    if isinstance(err, SpeculaError):
        return Failed(400, str(err))
    log.error("generation failed", exc_info=err)
    return Failed(500, "the server failed while generating; the request can be retried")
