"""The FastAPI app: OpenAI-compatible endpoints in front of one decoding `Engine`.

``create_app(speculator_or_factory, settings)`` returns an ASGI app; the engine starts
with the app's lifespan (a factory is called then, so a server can load its model
lazily). Every refusal is an OpenAI error object; a request is checked completely
(auth, model name, field types and ranges, prompt length against the context) before
it is queued, so a bad request never reaches the worker.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specula.draft_budget import DEFAULT_MAX_BATCH, DraftBudget
from specula.errors import SpeculaError
from specula.sampling import SamplingParams, check_seed
from specula.serve import BODY_TIMEOUT_S
from specula.serve.body import read_body
from specula.serve.engine import BatchedEngine
from specula.serve.errors import APIError, bad_request
from specula.serve.metrics import ServerMetrics
from specula.serve.prompt_bound import ThreadTokenizers, fewest_tokens, max_token_bytes
from specula.serve.requests import (
    Engine,
    EngineStopped,
    Failed,
    Finished,
    GenerationRequest,
    QueueFull,
    TextDelta,
)
from specula.serve.responses import (
    EventStream,
    ResponseMeta,
    chat_completion,
    chat_events,
    completion,
    completion_events,
    failure,
)
from specula.serve.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, parse_request

DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI API's default max_tokens for /v1/completions
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks whether its client is still there


@dataclass(frozen=True)
class ServeSettings:
    """How the server behaves (everything but where it listens)."""

    model_name: str | None = None  # None: the target's name
    api_key: str | None = None  # None: no authentication
    max_queue: int = 64  # requests waiting for the worker before new ones get 429
    max_tokens_limit: int | None = None  # largest max_tokens a request may ask for (None: the context)
    max_batch: int = DEFAULT_MAX_BATCH  # sequences decoded together (one packed target forward per cycle)
    draft_budget: dict[int, int] | None = None  # fixed {batch size: deepest draft}; None: measured
    verify_curve: dict[int, float] | None = None  # {tokens: seconds per forward} (calibrate's); None: measured
    retry_after_s: int = 1
    max_body_bytes: int = 8 * 2**20
    body_timeout_s: float = BODY_TIMEOUT_S


@dataclass
class ServerState:
    """What the handlers share; ``draining`` is set by a graceful shutdown."""

    settings: ServeSettings
    metrics: ServerMetrics
    engine: Engine | None = None
    speculator: object = None
    model_name: str = ""
    created: int = 0
    draining: bool = False
    tokenizers: ThreadTokenizers | None = None
    max_token_bytes: int = 0  # the most UTF-8 bytes one token's text spells (`max_token_bytes`)

    @property
    def idle(self) -> bool:
        return self.engine is None or self.engine.idle


EngineFactory = Callable[[object, ServeSettings, ServerMetrics], Engine]


def batched_engine(speculator, settings: ServeSettings, metrics: ServerMetrics) -> Engine:
    """The default engine: continuous batching, drafts per sequence from the settings' table, from the given
    verify-cost curve, or (neither) from a curve measured when it starts (`specula.draft_budget`)."""
    budget = None
    if settings.draft_budget is not None:
        budget = DraftBudget(table=settings.draft_budget, max_batch=settings.max_batch)
    elif settings.verify_curve:
        budget = DraftBudget(settings.verify_curve, max_batch=settings.max_batch)
    return BatchedEngine(speculator, settings.max_queue, metrics, settings.max_batch, budget)


def create_app(speculator_or_factory, settings: ServeSettings | None = None,
               engine_factory: EngineFactory = batched_engine) -> FastAPI:
    """An OpenAI-compatible app serving ``speculator_or_factory`` (a `Speculator`, or a callable returning one).

    ``app.state.specula`` is the `ServerState`; setting its ``draining`` makes new requests get 503.
    """
    settings = settings or ServeSettings()
    state = ServerState(settings, ServerMetrics())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        is_factory = callable(speculator_or_factory) and not hasattr(speculator_or_factory, "stream")
        speculator = speculator_or_factory() if is_factory else speculator_or_factory
        state.speculator = speculator
        state.model_name = settings.model_name or speculator.target.name
        state.tokenizers = ThreadTokenizers(speculator.tokenizer)
        state.max_token_bytes = max_token_bytes(speculator.tokenizer)
        state.created = int(time.time())
        state.engine = engine_factory(speculator, settings, state.metrics)
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="specula serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.specula = state
    app.add_middleware(CountRequests, metrics=state.metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", type=kind).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        return APIError(500, "internal server error", type="server_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        engine = state.engine
        body = {"status": "draining" if state.draining else "ok", "model": state.model_name,
                "queue_length": engine.queue_length if engine else 0, "batch_size": engine.batch_size if engine else 0}
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.engine is not None:
            state.metrics.queue_length.set(state.engine.queue_length)
            state.metrics.batch_size.set(state.engine.batch_size)
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        admit(state, request)
        card = ModelCard(id=state.model_name, created=state.created)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> JSONResponse:
        admit(state, request)
        if name != state.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{state.model_name}'",
                           param="model", code="model_not_found")
        return JSONResponse(ModelCard(id=state.model_name, created=state.created).model_dump(mode="json"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        admit(state, request)
        raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        body = parse_request(ChatCompletionRequest, raw)
        if not body.messages:
            raise bad_request("messages must be a non-empty list", param="messages")
        check_request(state, body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_bytes_fit(state, [m["content"] for m in messages], "messages")
        ids = await encode(state, "messages", lambda s, tokenizer: s.encode(messages=messages, tokenizer=tokenizer))
        return await serve(state, request, body, ids, "chatcmpl", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        admit(state, request)
        raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
        body = parse_request(CompletionRequest, raw)
        check_request(state, body)
        prompt = unsupported_completion_fields(body)
        if isinstance(prompt, str):
            check_bytes_fit(state, [prompt], "prompt")
        ids = await encode(state, "prompt", lambda s, tokenizer: s.encode(prompt, raw=True, tokenizer=tokenizer))
        return await serve(state, request, body, ids, "cmpl", chat=False)

    return app


# ---------------------------------------------------------------- checks before queueing


def admit(state: ServerState, request: Request) -> None:
    """503 while draining; 401 without the API key (when one is set)."""
    if state.draining:
        raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
    key = state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                       type="invalid_request_error", code="invalid_api_key")


def unsupported_completion_fields(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (text or token ids); 400 for what this server does not do."""
    if body.echo:
        raise bad_request("echo is not supported", param="echo", code="unsupported")
    if body.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported")
    if body.best_of not in (None, 1):
        raise bad_request("best_of must be 1", param="best_of", code="unsupported")
    if body.logprobs is not None:
        raise bad_request("logprobs are not supported", param="logprobs", code="unsupported")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise bad_request("one prompt per request (n prompts would be n choices, and n must be 1)",
                              param="prompt", code="unsupported")
        prompt = prompt[0]
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise bad_request("the prompt is empty", param="prompt")
    return prompt


def check_bytes_fit(state: ServerState, texts: list[str], param: str) -> None:
    """400 for text too long for the context whatever the tokenizer makes of it, before the tokenizer runs.

    B bytes make at least B / `max_token_bytes` tokens, so a prompt past that bound is refused in microseconds
    instead of holding a thread for the seconds an 8 MB text takes to tokenize; one within it is tokenized and then
    checked exactly (`generation_request`).
    """
    size, fewest = fewest_tokens(texts, state.max_token_bytes)
    context = state.speculator.target.max_length
    if fewest >= context:
        raise bad_request(f"the prompt is {size} bytes, at least {fewest} tokens; this model's context is {context} "
                          "tokens", param=param, code="context_length_exceeded")


async def encode(state: ServerState, param: str, how: Callable) -> list[int]:
    """Prompt ids by ``how(speculator, tokenizer)`` in a worker thread, with that thread's own tokenizer."""

    def run() -> list[int]:
        return how(state.speculator, state.tokenizers.get()).tolist()

    try:
        return await anyio.to_thread.run_sync(run)
    except SpeculaError as err:
        raise bad_request(str(err), param=param) from err


def check_request(state: ServerState, body) -> None:
    """400 for a model this server does not serve and for sampling settings out of range (before encoding)."""
    if body.model != state.model_name:
        raise bad_request(f"the model '{body.model}' does not exist; this server serves '{state.model_name}'",
                          param="model", code="model_not_found")
    if body.n not in (None, 1):
        raise bad_request(f"n must be 1, got {body.n}", param="n", code="unsupported")
    temperature, top_p = body.sampling()
    if not (math.isfinite(temperature) and temperature >= 0):
        raise bad_request(f"temperature must be >= 0 and finite, got {temperature}", param="temperature")
    if not (0 < top_p <= 1):  # NaN fails too
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    for param, check in (("temperature", lambda: SamplingParams(temperature, 0, top_p)),
                         ("seed", lambda: check_seed(body.seed))):
        try:
            check()
        except SpeculaError as err:
            raise bad_request(str(err), param=param) from err
    body.stop_strings()


def generation_request(state: ServerState, body, ids: list[int], chat: bool) -> GenerationRequest:
    """The checked settings of ``body`` for prompt ``ids``: max_tokens against the limit and the context."""
    temperature, top_p = body.sampling()
    context = state.speculator.target.max_length
    room = context - len(ids)
    if room < 1:
        raise bad_request(f"the prompt has {len(ids)} tokens; this model's context is {context} tokens",
                          param="messages" if chat else "prompt", code="context_length_exceeded")
    limit = state.settings.max_tokens_limit or context
    field, asked = body.token_limit()
    if asked is None:
        max_tokens = min(room, limit) if chat else min(DEFAULT_COMPLETION_TOKENS, room, limit)
    elif asked < 1:
        raise bad_request(f"{field} must be >= 1, got {asked}", param=field)
    elif asked > limit:
        raise bad_request(f"{field} must be <= {limit} on this server, got {asked}", param=field)
    elif asked > room:
        raise bad_request(f"this model's context is {context} tokens; the prompt has {len(ids)} and {field} "
                          f"asks for {asked} more", param=field, code="context_length_exceeded")
    else:
        max_tokens = asked
    return GenerationRequest(tuple(ids), max_tokens, temperature, top_p, body.seed, body.stop_strings())


# ---------------------------------------------------------------- serving


async def serve(state: ServerState, request: Request, body, ids: list[int], prefix: str, chat: bool) -> Response:
    generation = generation_request(state, body, ids, chat)
    try:
        stream = state.engine.submit(generation)
    except QueueFull as err:
        raise APIError(429, f"{err}; retry later", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(state.settings.retry_after_s)}) from err
    except EngineStopped as err:
        raise APIError(503, str(err), type="service_unavailable", code="shutting_down") from err
    meta = ResponseMeta.new(prefix, state.model_name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = chat_events if chat else completion_events
        return EventStream(events(stream, meta, include_usage), on_close=stream.cancel)
    try:
        text, finished = await collect(stream, request)
    finally:
        stream.cancel()  # no-op once finished; stops the worker if this handler was abandoned
    if finished is None:  # the client left; nobody reads this
        return Response(status_code=499)
    return JSONResponse((chat_completion if chat else completion)(meta, text, finished))


async def collect(stream, request: Request) -> tuple[str, Finished | None]:
    """All the text of a non-streamed request; (text, None) if its client disconnected first."""
    parts: list[str] = []
    checked = time.monotonic()
    while True:
        event = await stream.get(timeout=DISCONNECT_POLL_S)
        if time.monotonic() - checked >= DISCONNECT_POLL_S:  # events may never pause: check by the clock
            if await request.is_disconnected():
                return "".join(parts), None
            checked = time.monotonic()
        if isinstance(event, TextDelta):
            parts.append(event.text)
        elif isinstance(event, Finished):
            return "".join(parts), event
        elif isinstance(event, Failed):
            raise failure(event)


class CountRequests:
    """ASGI middleware: counts every HTTP response by endpoint and status (streams count when they start)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.metrics.count_request(scope.get("path", ""), status)
