"""The decoding engine behind the server: requests in, streams of text events out.

The HTTP side only knows `Engine`: ``submit(request) -> RequestStream`` (an async
iterator of `TextDelta` events ending in one `Finished` or `Failed`),
``RequestStream.cancel()``, and the load figures the metrics and the graceful
shutdown read. `SingleSequenceEngine` is the first implementation: one worker
thread owns the `Speculator` (whose KV cache holds one sequence, so it refuses
concurrent streams) and serves a bounded FIFO queue one request at a time. A
batched engine (many sequences per target forward, joining and leaving between
cycles) can replace it behind the same interface.

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
from dataclasses import dataclass, field
from typing import Protocol

from specula.decoding import GenerationStats
from specula.errors import SpeculaError
from specula.serve.metrics import ServerMetrics
from specula.serve.stops import StopMatcher

log = logging.getLogger("specula.serve")


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: the prompt's token ids (already through the chat template, or raw) and its sampling."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class TextDelta:
    """New text (possibly empty while a stop string or a multi-byte character is undecided) and its tokens."""

    text: str
    token_ids: list[int]


@dataclass
class Finished:
    """The end of a generation. finish_reason: "stop" (EOS, end of turn or a stop string), "length", "cancelled"."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    method: str
    tau: float = 0.0
    accepted_lengths: list[int] = field(default_factory=list)
    cycles: int = 0


@dataclass
class Failed:
    """A generation that could not be served: HTTP ``status`` and a message for the client."""

    status: int
    message: str


Event = TextDelta | Finished | Failed


class QueueFull(Exception):
    """No room in the request queue: the client should retry later (HTTP 429)."""


class EngineStopped(Exception):
    """The engine no longer takes requests (HTTP 503)."""


class RequestStream:
    """The events of one submitted request, in order; ``async for`` ends after `Finished` or `Failed`."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.submitted = time.perf_counter()
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._ended = False

    def cancel(self) -> None:
        """Stop generating at the worker's next cycle (a no-op once finished). Thread-safe."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def post(self, event: Event) -> None:
        """Hand ``event`` to the asyncio side; called from the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    async def get(self, timeout: float | None = None) -> Event | None:
        """The next event, or None if ``timeout`` seconds pass first (or the stream has ended)."""
        if self._ended:
            return None
        try:
            event = await asyncio.wait_for(self._events.get(), timeout)
        except asyncio.TimeoutError:
            return None
        self._ended = isinstance(event, (Finished, Failed))
        return event

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        event = await self.get()
        if event is None:
            raise StopAsyncIteration
        return event


class Engine(Protocol):
    """What the HTTP layer needs from a decoding engine."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue ``request`` (call on the event loop); raises `QueueFull` or `EngineStopped`."""
        ...

    @property
    def queue_length(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def idle(self) -> bool:
        """True when nothing is queued or being generated."""
        ...


class SingleSequenceEngine:
    """One worker thread, one sequence at a time, a FIFO queue of at most ``max_queue`` waiting requests."""

    def __init__(self, speculator, max_queue: int = 64, metrics: ServerMetrics | None = None):
        if max_queue < 1:
            raise SpeculaError(f"max_queue must be >= 1, got {max_queue}")
        self.speculator = speculator
        self.metrics = metrics or ServerMetrics()
        self._queue: queue.Queue[RequestStream | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()  # guards _unfinished and _stopping against the worker
        self._unfinished = 0  # submitted and not yet ended
        self._running = 0
        self._current: RequestStream | None = None  # the request being generated
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- the Engine interface

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="specula-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, fail the queued ones (503), stop the running one and end the worker."""
        with self._lock:
            self._stopping = True
        current = self._current
        if current is not None:
            current.cancel()
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
        return self._running

    @property
    def idle(self) -> bool:
        return self._unfinished == 0

    # ---------------------------------------------------------------- the worker

    def _work(self) -> None:
        while True:
            stream = self._queue.get()
            if stream is None:
                return
            self._update_gauges()
            try:
                self._serve(stream)
            except Exception:  # never let one request end the worker
                log.exception("the engine failed outside a generation")
                stream.post(Failed(500, "the server failed while generating; the request can be retried"))
            finally:
                self._ended()

    def _ended(self) -> None:
        with self._lock:
            self._unfinished -= 1
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.queue_length.set(self.queue_length)
        self.metrics.batch_size.set(self._running)

    def _serve(self, stream: RequestStream) -> None:
        request = stream.request
        method = str(getattr(self.speculator, "method", ""))
        if stream.cancelled:  # its client left while it waited
            self._finish(stream, Finished("cancelled", len(request.prompt_ids), 0, method))
            return
        stats = GenerationStats()
        stops = StopMatcher(request.stop)
        self._current, self._running = stream, 1
        self._update_gauges()
        chunks = self.speculator.stream(list(request.prompt_ids), max_new_tokens=request.max_tokens,
                                        temperature=request.temperature, top_p=request.top_p, seed=request.seed,
                                        stats=stats)
        reason = ""
        try:
            for chunk in chunks:
                if stats.cycles == 1 and chunk.token_ids:
                    self.metrics.time_to_first_token.observe(time.perf_counter() - stream.submitted)
                text, stopped = stops.push(chunk.text)
                stream.post(TextDelta(text, list(chunk.token_ids)))
                if stopped:
                    reason = "stop"
                    break
                if stream.cancelled:
                    reason = "cancelled"
                    break
            else:
                rest = stops.flush()
                if rest:
                    stream.post(TextDelta(rest, []))
                reason = "stop" if stats.stop_reason == "eos" else "length"
        except SpeculaError as err:
            self._fail(stream, Failed(400, str(err)))
            return
        except Exception:
            log.exception("generation failed")
            self._fail(stream, Failed(500, "the server failed while generating; the request can be retried"))
            return
        finally:
            chunks.close()  # frees the Speculator for the next request
            self._current, self._running = None, 0
        self._finish(stream, Finished(reason, stats.prompt_tokens or len(request.prompt_ids), stats.new_tokens,
                                      method, stats.tau, list(stats.accepted_lengths), stats.cycles))

    def _finish(self, stream: RequestStream, finished: Finished) -> None:
        m = self.metrics
        m.generations.labels(finish_reason=finished.finish_reason).inc()
        m.prompt_tokens.inc(finished.prompt_tokens)
        m.generated_tokens.inc(finished.completion_tokens)
        if finished.cycles:
            m.tau.observe(finished.tau)
        stream.post(finished)

    def _fail(self, stream: RequestStream, failed: Failed) -> None:
        self.metrics.generations.labels(finish_reason="error").inc()
        stream.post(failed)
