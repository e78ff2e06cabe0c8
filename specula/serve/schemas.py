"""The subset of the OpenAI API that `specula serve` speaks, as pydantic models.

Requests are validated strictly (``"0.5"`` is not a number, ``1`` is not a boolean), the way
the OpenAI API refuses wrong field types; fields that this server does not know are ignored,
as clients send some by default. Responses carry one extra top-level field, ``speculative``
(method, τ, accepted draft lengths, cycles), which OpenAI clients ignore.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from specula.serve.errors import APIError, bad_request

MAX_STOPS = 16


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    # The roles a chat template renders; another (a typo, "tool" without tools) would be wrapped as a turn the model
    # was never trained on, so it is refused.
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class _Sampling(_Request):
    """Fields shared by chat completions and completions; None means the default."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1.0, as the OpenAI API
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling(self) -> tuple[float, float]:
        """(temperature, top_p) with the OpenAI API's defaults (1.0, 1.0)."""
        return (1.0 if self.temperature is None else self.temperature, 1.0 if self.top_p is None else self.top_p)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:  # each is searched at every cycle: a long list would slow the worker for all
            raise bad_request(f"at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise bad_request("stop strings must not be empty", param="stop")
        return tuple(stops)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens

    def token_limit(self) -> tuple[str, int | None]:
        """The field that limits the answer's tokens and its value."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def token_limit(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Speculative(BaseModel):
    """What speculation did for one request (extra field; OpenAI clients ignore it)."""

    method: str
    tau: float
    accepted_lengths: list[int]
    cycles: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: Speculative


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative: Speculative | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A whole completion (``object="text_completion"``) or, in a stream, one chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculative: Speculative | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specula"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def parse_request(model: type[_Request], body: bytes) -> _Request:
    """``body`` (JSON bytes) as ``model``, or a 400 `APIError` naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {first['msg']}") from err
        if first["type"] == "model_type":  # the body is JSON, but not an object
            raise bad_request("the request body must be a JSON object") from err
        param = _param(first["loc"])
        raise bad_request(f"{param or 'body'}: {first['msg']}", param=param or None) from err


def _param(loc: tuple) -> str:
    """A location such as ("messages", 0, "content", "str") as "messages[0].content" (union tags dropped)."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item.isidentifier() and item.islower() and item not in _TYPE_TAGS:
            parts.append(("." if parts else "") + item)
        else:
            break
    return "".join(parts)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}

__all__ = ["APIError", "ChatCompletion", "ChatCompletionChunk", "ChatCompletionRequest", "ChatMessage", "Completion",
           "CompletionRequest", "ModelCard", "ModelList", "Speculative", "Usage", "parse_request"]
