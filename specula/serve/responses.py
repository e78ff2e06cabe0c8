"""Engine events as OpenAI responses: whole completions, and server-sent event streams as the OpenAI API sends them.

A stream is ``data: {chunk}\\n\\n`` events: chat streams open with a chunk whose delta
carries the role, then one chunk per piece of text, then a chunk with an empty delta and
the finish_reason (and the ``speculative`` statistics); with
``stream_options.include_usage`` a last chunk with no choices carries ``usage``; then
``data: [DONE]``. A failure mid-stream is one ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specula.serve.errors import APIError
from specula.serve.requests import Failed, Finished, RequestStream, TextDelta
from specula.serve.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    Speculative,
    Usage,
)

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ResponseMeta:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> ResponseMeta:
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)


def usage(finished: Finished) -> Usage:
    return Usage(prompt_tokens=finished.prompt_tokens, completion_tokens=finished.completion_tokens,
                 total_tokens=finished.prompt_tokens + finished.completion_tokens)


def speculative(finished: Finished) -> Speculative:
    return Speculative(method=finished.method, tau=round(finished.tau, 4), accepted_lengths=finished.accepted_lengths,
                       cycles=finished.cycles)


def failure(event: Failed) -> APIError:
    kind = "invalid_request_error" if event.status < 500 else "server_error"
    return APIError(event.status, event.message, type=kind)


def chat_completion(meta: ResponseMeta, text: str, finished: Finished) -> dict:
    return ChatCompletion(id=meta.id, created=meta.created, model=meta.model,
                          choices=[ChatChoice(message=ChatMessageOut(content=text),
                                              finish_reason=finished.finish_reason)],
                          usage=usage(finished), speculative=speculative(finished)).model_dump(mode="json")


def completion(meta: ResponseMeta, text: str, finished: Finished) -> dict:
    return Completion(id=meta.id, created=meta.created, model=meta.model,
                      choices=[CompletionChoice(text=text, finish_reason=finished.finish_reason)],
                      usage=usage(finished), speculative=speculative(finished)).model_dump(mode="json")


def _event(payload) -> str:
    data = payload if isinstance(payload, dict) else payload.model_dump(mode="json", exclude_none=True)
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _chat_chunk(meta: ResponseMeta, choices: list[ChatChunkChoice], include_usage: bool, **extra) -> dict:
    chunk = ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=choices, **extra)
    data = chunk.model_dump(mode="json", exclude={"usage", "speculative"})
    for choice in data["choices"]:  # OpenAI sends delta fields only when set, but logprobs/finish_reason always
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if include_usage:
        data["usage"] = chunk.usage.model_dump() if chunk.usage else None
    if chunk.speculative:
        data["speculative"] = chunk.speculative.model_dump()
    return data


async def chat_events(stream: RequestStream, meta: ResponseMeta, include_usage: bool) -> AsyncIterator[str]:
    yield _event(_chat_chunk(meta, [ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))], include_usage))
    async for event in stream:
        if isinstance(event, TextDelta):
            if event.text:
                choice = ChatChunkChoice(delta=ChatDelta(content=event.text))
                yield _event(_chat_chunk(meta, [choice], include_usage))
        elif isinstance(event, Finished):
            choice = ChatChunkChoice(delta=ChatDelta(), finish_reason=event.finish_reason)
            yield _event(_chat_chunk(meta, [choice], include_usage, speculative=speculative(event)))
            if include_usage:
                yield _event(_chat_chunk(meta, [], include_usage, usage=usage(event)))
            yield DONE
        else:
            yield _event(failure(event).body())


def _completion_chunk(meta: ResponseMeta, choices: list[CompletionChoice], include_usage: bool, **extra) -> dict:
    chunk = Completion(id=meta.id, created=meta.created, model=meta.model, choices=choices, **extra)
    data = chunk.model_dump(mode="json", exclude={"usage", "speculative"})
    if include_usage:
        data["usage"] = chunk.usage.model_dump() if chunk.usage else None
    if chunk.speculative:
        data["speculative"] = chunk.speculative.model_dump()
    return data


async def completion_events(stream: RequestStream, meta: ResponseMeta, include_usage: bool) -> AsyncIterator[str]:
    async for event in stream:
        if isinstance(event, TextDelta):
            if event.text:
                yield _event(_completion_chunk(meta, [CompletionChoice(text=event.text)], include_usage))
        elif isinstance(event, Finished):
            choice = CompletionChoice(text="", finish_reason=event.finish_reason)
            yield _event(_completion_chunk(meta, [choice], include_usage, speculative=speculative(event)))
            if include_usage:
                yield _event(_completion_chunk(meta, [], include_usage, usage=usage(event)))
            yield DONE
        else:
            yield _event(failure(event).body())


class EventStream(StreamingResponse):
    """A text/event-stream response that calls ``on_close`` however it ends: finished, failed, or the client gone
    (Starlette cancels the response when the client disconnects; the finally clause still runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
