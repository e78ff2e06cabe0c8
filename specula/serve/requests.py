"""What the server's HTTP side and its engine exchange: a request, the events of its stream, and the protocol.

`Engine.submit(request) -> RequestStream`: an async iterator of `TextDelta` events ending in one `Finished`
or `Failed`; ``RequestStream.cancel()`` stops it at the engine's next cycle. The worker thread posts events
with ``loop.call_soon_threadsafe`` onto the request's asyncio queue (`specula.serve.engine.BatchedEngine`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol


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
