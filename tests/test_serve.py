"""`specula serve`: the OpenAI API as the official `openai` client sees it, against servers this module starts on
free ports of 127.0.0.1 (uvicorn in a background thread) over stories260k.

Pinned: completions and chat completions (through the chat template), streamed and whole, equal at T=0 to
`specula generate`; stop strings; the OpenAI error schema and status of every refusal; the API key; a bounded
queue (429); a client leaving mid-stream frees the worker; a graceful shutdown (in-flight requests finish, new
ones get 503); concurrent clients neither fail nor change each other's output; Prometheus metrics.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import STORIES, STORY_PROMPTS
from prometheus_client.parser import text_string_to_metric_families

import specula
from specula.cli import main
from specula.serve import ServeSettings, create_app, running_server
from specula.serve.stops import StopMatcher

MODEL = "stories260k"
WAIT_S = 30.0  # bound on every wait in this file
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

pytestmark = pytest.mark.usefixtures("single_thread")


def load(method: str = "vanilla", target=STORIES):
    return specula.load(target, method=method, dtype="float32", profile=False)


def client_for(server, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=api_key, max_retries=0,
                         timeout=WAIT_S)


def http_for(server, **kwargs) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S, **kwargs)


def wait_until(condition, what: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        time.sleep(0.01)
    pytest.fail(f"timed out waiting until {what}")


@pytest.fixture(scope="module")
def server():
    """Vanilla stories260k, default settings."""
    with running_server(create_app(load())) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return client_for(server)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """stories260k with a plain chat template in its tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("chat") / MODEL
    shutil.copytree(STORIES, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


def cli_generate(capsys, method: str, prompt: str, max_new_tokens: int) -> str:
    """`specula generate --json`'s text."""
    capsys.readouterr()
    assert main(["generate", "--target", str(STORIES), "--method", method, "--prompt", prompt, "--raw",
                 "--max-new-tokens", str(max_new_tokens), "--dtype", "float32", "--no-profile", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["text"]


def metric_samples(server) -> dict[tuple, float]:
    """/metrics parsed as Prometheus text: {(sample name, sorted labels): value}."""
    with http_for(server) as http:
        response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


class Throttled:
    """A Speculator whose drafter (and every fork of it, one per batch slot) waits for ``gate`` and ``delay`` seconds
    before each draft, i.e. before every cycle after a sequence's first token; ``explode`` makes that draft raise.
    ``waiting`` is set while a draft waits at the gate."""

    def __init__(self, speculator, delay: float = 0.0):
        self.inner = speculator
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()
        self.delay = delay
        self.explode = False
        self.fork_fails = False  # the next slot cannot be set up
        self.drafter = GatedDrafter(speculator.drafter, self)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class GatedDrafter:
    def __init__(self, inner, owner: Throttled):
        self.inner, self.owner = inner, owner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, *args, **kwargs):
        owner = self.owner
        owner.waiting.set()
        if not owner.gate.wait(WAIT_S):
            raise RuntimeError("the test never opened the gate")
        owner.waiting.clear()
        time.sleep(owner.delay)
        if owner.explode:
            raise RuntimeError("the model broke")
        return self.inner.propose(*args, **kwargs)

    def fork(self):
        if self.owner.fork_fails:
            raise MemoryError("no memory for another slot")
        return GatedDrafter(self.inner.fork(), self.owner)


def finished(server, reason: str) -> float:
    return metric_samples(server).get(("specula_generations_total", (("finish_reason", reason),)), 0.0)


# ---------------------------------------------------------------- completions and chat, equal to specula generate


@pytest.mark.parametrize("method", ["vanilla", "pld"])
def test_completions_at_t0_equal_specula_generate_streamed_and_whole(method, capsys):
    prompts = STORY_PROMPTS[:2]
    expected = [cli_generate(capsys, method, prompt, 40) for prompt in prompts]
    with running_server(create_app(load(method))) as running:
        client = client_for(running)
        for prompt, text in zip(prompts, expected, strict=True):
            whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
            assert whole.choices[0].text == text
            assert whole.choices[0].finish_reason == "length"
            prompt_tokens = len(load().encode(prompt, raw=True))
            assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
                prompt_tokens, 40, prompt_tokens + 40)
            spec = whole.speculative  # the extra field, kept by the client as an attribute
            assert spec["method"] == method and spec["cycles"] >= 1 and len(spec["accepted_lengths"]) == spec[
                "cycles"] - 1
            assert spec["tau"] == pytest.approx(40 / spec["cycles"], abs=1e-3)

            pieces, finish = [], []
            for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                                   stream=True):
                pieces.append(chunk.choices[0].text)
                finish.append(chunk.choices[0].finish_reason)
            assert "".join(pieces) == text
            assert finish[-1] == "length" and set(finish[:-1]) == {None}


def test_chat_completions_go_through_the_chat_template(chat_target):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story, please."}]
    reference = load(target=chat_target)
    expected = reference.generate(messages=messages, max_new_tokens=30)
    assert reference.encode(messages=messages).tolist() == reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True)["input_ids"]
    with running_server(create_app(load(target=chat_target))) as running:
        client = client_for(running)
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
        assert whole.object == "chat.completion"
        assert whole.choices[0].message.role == "assistant"
        assert whole.choices[0].message.content == expected.text
        assert whole.usage.prompt_tokens == len(reference.encode(messages=messages))
        assert whole.usage.completion_tokens == len(expected.token_ids)

        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
        assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
        # content parts ({"type": "text"}) are the same message as a string
        parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "A story, "},
                                                            {"type": "text", "text": "please."}]}]
        same = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=30, temperature=0)
        assert same.choices[0].message.content == expected.text


def test_chat_on_a_model_without_a_chat_template_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="chat template"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)


def test_stream_is_server_sent_events_as_openai_sends_them(server):
    with http_for(server) as http:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert all(event.startswith("data: ") for event in events[:-1])
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    final, usage = chunks[-2], chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["speculative"]["method"] == "vanilla"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is None for c in chunks[:-1])


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("pieces, stops, emitted, stopped", [
    (["Once upon", " a time"], ["a time"], "Once upon ", True),
    (["Once up", "on a", " time"], ["upon"], "Once ", True),
    (["ab", "ab", "c"], ["abc"], "ab", True),
    (["xa", "ab"], ["aab"], "x", True),
    (["hello", " world"], ["zzz"], "hello world", False),
    (["one", "two"], ["two", "netw"], "o", True),
])
def test_stop_strings_cut_the_text_at_the_first_and_never_emit_part_of_one(pieces, stops, emitted, stopped):
    matcher = StopMatcher(stops)
    out, hit = "", False
    for piece in pieces:
        text, hit = matcher.push(piece)
        out += text
        if hit:
            break
    if not hit:
        out += matcher.flush()
    assert (out, hit) == (emitted, stopped)


def test_stop_string_ends_the_completion_with_finish_reason_stop(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0)
    text = full.choices[0].text
    stop = text[10:16]
    cut = text[:text.index(stop)]
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                      stop=[stop, "no such text"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (cut, "stop")
    assert whole.usage.completion_tokens < 40
    streamed = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- errors


COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def with_(body: dict, **changes) -> bytes:
    return json.dumps({**body, **changes}).encode()


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/completions", b'{"model": "stories260k", "prompt": ', 400, None, None),
    ("/v1/completions", b'["not", "an", "object"]', 400, None, None),
    ("/v1/completions", with_(COMPLETION, temperature="hot"), 400, "temperature", None),
    ("/v1/completions", with_(COMPLETION, max_tokens=1.5), 400, "max_tokens", None),
    ("/v1/completions", with_(COMPLETION, stream="yes"), 400, "stream", None),
    ("/v1/completions", with_(COMPLETION, prompt=7), 400, "prompt", None),
    ("/v1/chat/completions", with_(CHAT, messages="Hi"), 400, "messages", None),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "user"}]), 400, "messages[0].content", None),
    ("/v1/completions", with_(COMPLETION, model="gpt-4o"), 400, "model", "model_not_found"),
    ("/v1/completions", json.dumps({"prompt": "Hi"}).encode(), 400, "model", None),
    ("/v1/completions", with_(COMPLETION, max_tokens=0), 400, "max_tokens", None),
    ("/v1/completions", with_(COMPLETION, max_tokens=-3), 400, "max_tokens", None),
    ("/v1/completions", with_(COMPLETION, max_tokens=100_000), 400, "max_tokens", None),
    ("/v1/completions", with_(COMPLETION, max_tokens=510), 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", with_(COMPLETION, prompt="Once " * 600), 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", with_(COMPLETION, temperature=-0.5), 400, "temperature", None),
    ("/v1/completions", b'{"model": "stories260k", "prompt": "Hi", "temperature": NaN}', 400, "temperature", None),
    ("/v1/completions", b'{"model": "stories260k", "prompt": "Hi", "temperature": Infinity}', 400, "temperature",
     None),
    ("/v1/completions", with_(COMPLETION, top_p=0), 400, "top_p", None),
    ("/v1/completions", with_(COMPLETION, top_p=1.5), 400, "top_p", None),
    ("/v1/completions", with_(COMPLETION, prompt=""), 400, "prompt", None),
    ("/v1/completions", with_(COMPLETION, prompt=[600, 1]), 400, "prompt", None),
    ("/v1/completions", with_(COMPLETION, n=2), 400, "n", "unsupported"),
    ("/v1/completions", with_(COMPLETION, seed=-1), 400, "seed", None),
    ("/v1/completions", with_(COMPLETION, stop=[""]), 400, "stop", None),
    ("/v1/completions", with_(COMPLETION, stop=[f"s{i}" for i in range(17)]), 400, "stop", None),
    ("/v1/chat/completions", with_(CHAT, messages=[]), 400, "messages", None),
    ("/v1/chat/completions", with_(CHAT, messages=[{"role": "bogus", "content": "Hi"}]), 400, "messages[0].role",
     None),
    ("/v1/completions", with_(COMPLETION, prompt="Once upon a time " * 8_000), 400, "prompt",
     "context_length_exceeded"),
    ("/v1/no/such/endpoint", b"{}", 404, None, None),
])
def test_refusals_are_openai_errors_with_their_status(server, path, body, status, param, code):
    with http_for(server) as http:
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    # the server is unharmed
    with http_for(server) as http:
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_the_openai_client_raises_its_own_error_types(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=3)
    assert raised.value.code == "model_not_found" and raised.value.param == "model"
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, top_p=2.0)


def test_api_key_is_required_when_set():
    with running_server(create_app(load(), ServeSettings(api_key="sekrit"))) as running:
        with pytest.raises(openai.AuthenticationError):
            client_for(running, api_key="wrong").models.list()
        with http_for(running) as http:
            refused = http.post("/v1/completions", json=COMPLETION)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert http.get("/health").status_code == 200  # health and metrics stay open for probes
        right = client_for(running, api_key="sekrit")
        assert [m.id for m in right.models.list()] == [MODEL]
        served = right.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        assert served.usage.completion_tokens == 3


def test_a_factory_is_loaded_at_start_and_settings_name_the_model_and_cap_max_tokens():
    loaded = []
    with running_server(create_app(lambda: loaded.append(load()) or loaded[0],
                                   ServeSettings(model_name="tiny", max_tokens_limit=10))) as running:
        assert len(loaded) == 1
        client = client_for(running)
        assert [m.id for m in client.models.list()] == ["tiny"]
        capped = client.completions.create(model="tiny", prompt="Hi", temperature=0)  # default 16, capped to 10
        assert capped.usage.completion_tokens == 10
        with pytest.raises(openai.BadRequestError, match="<= 10"):
            client.completions.create(model="tiny", prompt="Hi", max_tokens=11)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


# ---------------------------------------------------------------- load, queue, disconnects, shutdown


def test_full_queue_is_a_429_with_retry_after():
    throttled = Throttled(load())
    with running_server(create_app(throttled, ServeSettings(max_queue=1, max_batch=1))) as running:
        state = running.config.app.state.specula
        throttled.gate.clear()
        client = client_for(running)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.completions.create, model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
            wait_until(lambda: state.engine.batch_size == 1 and throttled.waiting.is_set(),
                       "the first request is generating")
            second = pool.submit(client.completions.create, model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
            wait_until(lambda: state.engine.queue_length == 1, "the second request waits")
            with http_for(running) as http:
                refused = http.post("/v1/completions", json=COMPLETION)
            throttled.gate.set()
            assert first.result(WAIT_S).choices[0].text == second.result(WAIT_S).choices[0].text
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"


def test_a_client_leaving_mid_stream_frees_its_slot():
    throttled = Throttled(load(), delay=0.02)  # 400 tokens would take 8 s: the stream is cut long before
    with running_server(create_app(throttled, ServeSettings(max_batch=1))) as running:
        state = running.config.app.state.specula
        client = client_for(running)
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0,
                                           stream=True)
        for _, _chunk in zip(range(3), stream, strict=False):
            pass
        stream.close()  # the connection goes
        # With one slot, this is served only once the left stream has given its slot back.
        after = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        assert after.usage.completion_tokens == 3
        assert finished(running, "cancelled") == 1 and finished(running, "length") == 1
        wait_until(lambda: state.engine.idle and state.engine.batch_size == 0, "every slot is free")


def test_a_client_leaving_before_a_whole_response_frees_its_slot():
    throttled = Throttled(load(), delay=0.02)
    with running_server(create_app(throttled, ServeSettings(max_batch=1))) as running:
        with http_for(running) as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**COMPLETION, "max_tokens": 400}, timeout=0.5)
        after = client_for(running).completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
        assert after.usage.completion_tokens == 3
        assert finished(running, "cancelled") == 1


def test_a_failing_generation_is_a_500_and_the_server_goes_on():
    throttled = Throttled(load())
    with running_server(create_app(throttled)) as running:
        client = client_for(running)
        throttled.explode = True
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0)
        with pytest.raises(openai.APIError, match="failed while generating"):
            list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, stream=True))
        throttled.explode = False
        served = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0)
        assert served.usage.completion_tokens == 5
        assert finished(running, "error") == 2


def test_a_request_whose_slot_cannot_be_set_up_fails_alone():
    throttled = Throttled(load())
    with running_server(create_app(throttled)) as running:
        state = running.config.app.state.specula
        client = client_for(running)
        throttled.fork_fails = True
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0)
        throttled.fork_fails = False
        served = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0)
        assert served.usage.completion_tokens == 5
        wait_until(lambda: state.engine.idle, "nothing is left in flight")


def test_sigterm_lets_in_flight_requests_finish_and_refuses_new_ones():
    throttled = Throttled(load())
    with running_server(create_app(throttled)) as running:
        client = client_for(running)
        throttled.gate.clear()  # the generation waits after its first token until the shutdown has begun
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
                                           stream=True)
        wait_until(throttled.waiting.is_set, "generation started")
        running.handle_exit(signal.SIGTERM, None)
        with http_for(running) as http:
            refused = http.post("/v1/completions", json=COMPLETION)
            assert http.get("/health").status_code == 503
        throttled.gate.set()
        chunks = list(stream)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(len(c.choices[0].text) > 0 for c in chunks) > 1
        wait_until(lambda: running.should_exit, "the drained server stops")


def test_concurrent_clients_all_succeed_with_the_output_they_would_get_alone(server, client):
    reference, expected = load(), {}
    jobs = []  # (client number, request kwargs)
    for i in range(16):
        for j in range(5):
            prompt = STORY_PROMPTS[(i + j) % 6]
            sampled = (i + j) % 3 == 0  # seeded sampling must not depend on the neighbours either
            settings = dict(temperature=1.0, seed=(i + 2 * j) % 5) if sampled else dict(temperature=0.0, seed=None)
            key = (prompt, settings["temperature"], settings["seed"])
            if key not in expected:
                expected[key] = reference.generate(prompt, max_new_tokens=8, raw=True, **settings).text
            jobs.append((i, dict(prompt=prompt, max_tokens=8, stream=(i + j) % 2 == 0, **settings)))

    def run_client(number: int) -> list[tuple[str, str]]:
        results = []
        for owner, kwargs in jobs:
            if owner != number:
                continue
            if kwargs["stream"]:
                text = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, **kwargs))
            else:
                text = client.completions.create(model=MODEL, **kwargs).choices[0].text
            results.append((text, expected[kwargs["prompt"], kwargs["temperature"], kwargs["seed"]]))
        return results

    with ThreadPoolExecutor(16) as pool:
        outcomes = [future.result(WAIT_S * 4) for future in [pool.submit(run_client, n) for n in range(16)]]
    pairs = [pair for outcome in outcomes for pair in outcome]
    assert len(pairs) == 80
    assert [got for got, _ in pairs] == [want for _, want in pairs]


def test_metrics_are_prometheus_text_with_the_counters(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0)
    with http_for(server) as http:
        http.post("/v1/completions", json={**COMPLETION, "model": "nope"})
    samples = metric_samples(server)
    assert samples[("specula_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 1
    assert samples[("specula_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] >= 1
    assert samples[("specula_generated_tokens_total", ())] >= 5
    assert samples[("specula_tau_count", ())] >= 1
    assert samples[("specula_generations_total", (("finish_reason", "length"),))] >= 1
    assert ("specula_queue_length", ()) in samples and ("specula_batch_size", ()) in samples


# ---------------------------------------------------------------- the command line


def test_serve_command_listens_on_localhost_with_the_settings_given(monkeypatch):
    import specula.serve

    served = {}
    monkeypatch.setattr(specula.serve, "serve", lambda app, **where: served.update(app=app, **where))
    assert main(["serve", "--target", str(STORIES), "--method", "pld", "--dtype", "float32", "--api-key", "k",
                 "--max-queue", "3", "--max-tokens-limit", "50", "--model-name", "tiny", "--no-profile",
                 "--max-batch", "4", "--draft-budget", "1:6,2:1,4:0", "--body-timeout", "5"]) == 0
    settings = served["app"].state.specula.settings
    assert (served["host"], served["port"]) == ("127.0.0.1", 8000)
    assert (settings.api_key, settings.max_queue, settings.max_tokens_limit, settings.model_name) == ("k", 3, 50,
                                                                                                       "tiny")
    assert (settings.max_batch, settings.draft_budget, settings.body_timeout_s) == (4, {1: 6, 2: 1, 4: 0}, 5.0)


def test_serve_command_refuses_bad_options_before_loading(monkeypatch, capsys):
    from specula.runtime.target import Target

    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: pytest.fail("a model was loaded")))
    assert main(["serve", "--target", str(STORIES), "--method", "pld", "--pld-max-ngram", "0"]) == 2
    assert main(["serve", "--max-queue", "0"]) == 2
    assert main(["serve", "--draft-budget", "2:4"]) == 2  # says nothing of batch size 1
    assert main(["serve", "--max-batch", "0"]) == 2
    assert main(["serve", "--compile"]) == 2  # a compiled step decodes one sequence at a time
    assert main(["serve", "--body-timeout", "0"]) == 2
    assert main(["serve", "--body-timeout", "nan"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 7 and all(line.startswith("specula: error:") for line in lines)


# ---------------------------------------------------------------- one request cannot stall the others


class GatedTokenizer:
    """A tokenizer that blocks on a prompt containing "GATE" until released (copies share the gate)."""

    def __init__(self, inner, entered: threading.Event, release: threading.Event):
        self.inner, self.entered, self.release = inner, entered, release

    def __call__(self, text, **kwargs):
        if "GATE" in text:
            self.entered.set()
            assert self.release.wait(WAIT_S)
        return self.inner(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __deepcopy__(self, memo):
        import copy

        return GatedTokenizer(copy.deepcopy(self.inner, memo), self.entered, self.release)


def test_a_prompt_being_tokenized_never_holds_up_another_request():
    from specula.serve.prompt_bound import ThreadTokenizers

    app = create_app(load())
    entered, release = threading.Event(), threading.Event()
    with running_server(app) as server, ThreadPoolExecutor(1) as pool:
        state = app.state.specula
        state.tokenizers = ThreadTokenizers(GatedTokenizer(state.speculator.tokenizer, entered, release))
        slow = pool.submit(lambda: http_for(server).post("/v1/completions", json={**COMPLETION, "prompt": "GATE"}))
        assert entered.wait(WAIT_S)
        try:
            with http_for(server) as http:  # answered while the first prompt is still inside the tokenizer
                assert http.post("/v1/completions", json=COMPLETION).status_code == 200
            assert not slow.done()
        finally:
            release.set()
        assert slow.result(WAIT_S).status_code == 200


def test_a_body_shorter_than_its_content_length_is_a_client_error_not_a_500(server):
    import socket

    def count(status: str) -> float:
        return sum(v for (name, labels), v in metric_samples(server).items()
                   if name == "specula_requests_total" and dict(labels).get("status") == status)

    errors_before = count("500")
    with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": \"stories")
    wait_until(lambda: count("499") >= 1, "the cut-off request was counted")
    assert count("500") == errors_before
    with http_for(server) as http:
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_a_client_that_drips_its_body_is_timed_out_as_a_client_error_while_others_are_served():
    import socket

    app = create_app(load(), ServeSettings(body_timeout_s=1.0))
    with running_server(app) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"model\": \"stories")
        with http_for(server) as http:  # served while the slow client holds its connection open
            assert http.post("/v1/completions", json=COMPLETION).status_code == 200
        sock.settimeout(0.25)
        reply, deadline = b"", time.monotonic() + WAIT_S
        while not reply and time.monotonic() < deadline:  # a byte at a time, never the whole body
            try:
                reply = sock.recv(4096)
            except TimeoutError:
                sock.sendall(b" ")
        assert reply.startswith(b"HTTP/1.1 408"), reply
        statuses = {dict(labels)["status"]: v for (name, labels), v in metric_samples(server).items()
                    if name == "specula_requests_total" and dict(labels).get("endpoint") == "/v1/completions"}
        assert statuses.get("408") == 1 and "500" not in statuses, statuses


def test_serve_refuses_a_port_in_use_before_loading(monkeypatch, capsys):
    import socket

    from specula.runtime.target import Target

    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: pytest.fail("a model was loaded")))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--target", str(STORIES), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specula: error: cannot listen on 127.0.0.1:") and err.count("\n") == 1, err


def test_a_prompt_too_long_for_the_context_is_refused_before_the_tokenizer_sees_it():
    from specula.serve.prompt_bound import ThreadTokenizers

    app = create_app(load())
    entered, release = threading.Event(), threading.Event()
    release.set()
    with running_server(app) as server, http_for(server) as http:
        state = app.state.specula
        state.tokenizers = ThreadTokenizers(GatedTokenizer(state.speculator.tokenizer, entered, release))
        response = http.post("/v1/completions", json={**COMPLETION, "prompt": "GATE " + "Once upon a time " * 8_000})
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        assert not entered.is_set()  # refused from its byte length alone
        assert http.post("/v1/completions", json={**COMPLETION, "prompt": "GATE Once"}).status_code == 200
        assert entered.is_set()
