"""Property-based fuzzing of every input surface: each random input ends in success or the documented error.

- method options through the registry (every method) and the bench's transformers baselines: a checked dict,
  or a SpeculaError;
- request bodies through the server (in-process client): 200, or an OpenAI error object with a 4xx status;
- prompts of random types through `Speculator.generate`: a generation, or a SpeculaError;
- random bytes as `specula chat`'s input: every line answered or refused with one `specula: error:` line.

Examples are bounded (`CASES`) so the module runs in well under a minute; the number of generated cases is
counted and printed at the end (at least `MIN_CASES`).
"""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter

import pytest
import torch
from conftest import STORIES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specula
from specula.bench.config import HF_METHODS, method_specs
from specula.chat.session import run_chat
from specula.errors import SpeculaError
from specula.methods import METHODS, all_options, check_options

CASES = {"options": 600, "baselines": 200, "bodies": 500, "prompts": 450, "chat": 300}
MIN_CASES = 2000
COUNTS: Counter = Counter()
OUTCOMES: Counter = Counter()  # what the cases ended in, printed beside the counts: proof both paths were taken
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

pytestmark = pytest.mark.usefixtures("single_thread")


def bounded(name: str):
    return settings(max_examples=CASES[name], deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", autouse=True)
def case_count():
    yield
    total = sum(COUNTS.values())
    print(f"\nfuzzing: {total} generated cases ({', '.join(f'{k} {v}' for k, v in sorted(COUNTS.items()))}); "
          f"outcomes: {', '.join(f'{k} {v}' for k, v in sorted(OUTCOMES.items()))}")
    if set(COUNTS) == set(CASES):  # the whole module ran
        assert total >= MIN_CASES, COUNTS


# Values of every kind a config file, a command line or a caller could hand over.
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["1", "0", "-1", "nan", "inf", "1e400", "4.0", "true", "x", "[[0],[1]]", "",
                                     "int8", "q4_1", "[[0],[0,0]]", "[[1]]"]))
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.lists(st.lists(st.integers(-1, 3), max_size=3),
                                                                    max_size=4))
OPTION_NAMES = sorted({spec.name for spec in all_options()} | {"typical_threshold", "typical_alpha", "bogus", ""})


def own_options(method: str):
    """Options ``method`` takes, with values that are mostly in range: cases that reach the cross-option rules."""
    names = [spec.name for spec in METHODS[method].options]
    plausible = st.one_of(st.integers(1, 8), st.sampled_from(["2", "3", "true", "int8", "[[0],[1],[0,0]]"]),
                          st.booleans())
    return st.dictionaries(st.sampled_from(names), plausible, max_size=3) if names else st.just({})


METHOD_OPTIONS = st.one_of(
    st.tuples(st.sampled_from(sorted(METHODS)), st.dictionaries(st.sampled_from(OPTION_NAMES), VALUES, max_size=4)),
    st.sampled_from(sorted(METHODS)).flatmap(lambda m: st.tuples(st.just(m), own_options(m))))


@bounded("options")
@given(case=METHOD_OPTIONS)
def test_random_options_through_the_registry_are_checked_or_refused(case):
    method, options = case
    COUNTS["options"] += 1
    try:
        checked = check_options(method, options)
    except SpeculaError as err:
        OUTCOMES["options refused"] += 1
        assert str(err)
        return
    OUTCOMES["options accepted"] += 1
    assert set(checked) == set(options) and all(METHODS[method].takes(name) for name in checked)


@bounded("baselines")
@given(method=st.sampled_from(sorted(HF_METHODS)),
       table=st.dictionaries(st.sampled_from(sorted({k for m in HF_METHODS.values() for k in m} | {"x"})), VALUES,
                             max_size=3))
def test_random_baseline_options_are_checked_or_refused(method, table):
    COUNTS["baselines"] += 1
    try:
        (spec,) = method_specs([method], {method: {**table, "draft": "d"}})
    except SpeculaError as err:
        assert str(err)
        return
    assert spec.method == method


# ---------------------------------------------------------------- the server's request bodies


@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    from specula.serve import create_app

    with TestClient(create_app(specula.load(STORIES, dtype="float32", profile=False))) as client:
        yield client


FIELD_VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=5), SCALARS,
                                                                                  max_size=2))
MESSAGES = st.lists(st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bogus",
                                                                              ""]),
                                                     "content": st.one_of(st.text(max_size=30), SCALARS)}),
                              SCALARS), max_size=3)
BODY = st.fixed_dictionaries(
    {"model": st.one_of(st.just("stories260k"), SCALARS)},
    optional={"prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 600), max_size=6),
                                  st.lists(st.text(max_size=8), max_size=2), SCALARS),
              "messages": MESSAGES, "max_tokens": st.one_of(st.integers(-2, 4), SCALARS),
              "temperature": st.one_of(st.floats(-1, 3), SCALARS), "top_p": st.one_of(st.floats(-0.5, 1.5), SCALARS),
              "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), SCALARS),
              "seed": st.one_of(st.integers(-2, 2**65), SCALARS), "n": st.one_of(st.integers(0, 2), SCALARS),
              "stream": st.one_of(st.booleans(), SCALARS), "stream_options": FIELD_VALUES, "echo": SCALARS,
              "logprobs": SCALARS, "extra": FIELD_VALUES})


# Mostly valid completions, so that the fuzzer also reaches the engine and not only the schema's refusals.
VALID_BODY = st.fixed_dictionaries(
    {"model": st.just("stories260k"), "prompt": st.one_of(st.text(min_size=1, max_size=30),
                                                          st.lists(st.integers(0, 511), min_size=1, max_size=6))},
    optional={"max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
              "seed": st.integers(0, 2**64 - 1), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
              "stream": st.booleans()})


def raw_bodies():
    return st.one_of(BODY.map(lambda b: json.dumps(b).encode()), VALID_BODY.map(lambda b: json.dumps(b).encode()),
                     st.binary(max_size=64),
                     st.sampled_from([b"", b"{", b"[]", b"null", b'{"model": NaN}', b'"\\ud800"']))


@bounded("bodies")
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=raw_bodies())
def test_random_request_bodies_are_answered_or_refused_as_openai_errors(http, path, body):
    COUNTS["bodies"] += 1
    decoded = json.loads(body) if body.startswith(b"{") and _is_json(body) else None
    if isinstance(decoded, dict) and not (isinstance(decoded.get("max_tokens"), int) and decoded["max_tokens"] <= 4):
        decoded["max_tokens"] = 2  # keep generations short; the field's own fuzzing is above
        body = json.dumps(decoded).encode()
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    OUTCOMES[f"body {response.status_code}"] += 1
    assert response.status_code in (200, 400, 413), (response.status_code, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def _is_json(body: bytes) -> bool:
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------- prompts of any type through the Python API


@pytest.fixture(scope="module")
def speculator():
    return specula.load(STORIES, dtype="float32", profile=False)


TENSORS = st.builds(lambda values, dtype, shape: torch.tensor(values, dtype=dtype).reshape(shape(len(values))),
                    st.lists(st.integers(0, 255), min_size=1, max_size=6),
                    st.sampled_from([torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32, torch.bool]),
                    st.sampled_from([lambda n: (n,), lambda n: (1, n), lambda n: (n, 1)]))
PROMPTS = st.one_of(st.text(max_size=40), st.binary(max_size=10), st.lists(st.integers(-3, 600), max_size=6),
                    st.lists(st.one_of(st.integers(0, 500), st.floats(0, 500), st.booleans(), st.none(), st.text(
                        max_size=2)), max_size=4), TENSORS, SCALARS, st.tuples(st.integers(0, 500)))


@bounded("prompts")
@given(prompt=PROMPTS)
def test_random_prompt_types_generate_or_raise_specula_error(speculator, prompt):
    COUNTS["prompts"] += 1
    try:
        result = speculator.generate(prompt, max_new_tokens=1)
    except SpeculaError as err:
        OUTCOMES["prompt refused"] += 1
        assert str(err)
        return
    OUTCOMES["prompt generated"] += 1
    valid_ids = isinstance(prompt, (list, tuple)) and all(type(i) is int for i in prompt)
    valid_tensor = isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not (
        prompt.is_floating_point() or prompt.dtype == torch.bool)
    assert isinstance(prompt, str) or valid_ids or valid_tensor, f"{prompt!r} was silently accepted"
    assert len(result.token_ids) <= 1


# ---------------------------------------------------------------- random bytes as chat input


@pytest.fixture(scope="module")
def chat_speculator(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat") / "stories260k"
    shutil.copytree(STORIES, directory)
    for path in [directory, *directory.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return specula.load(directory, dtype="float32", profile=False)


@bounded("chat")
@given(data=st.lists(st.one_of(st.binary(max_size=24), st.sampled_from([b"/clear", b"/exit", b"\xff\xfe\x00",
                                                                      b"\xed\xa0\x80", b" ", b"\r"])),
                     max_size=4).map(b"\n".join))
def test_random_bytes_as_chat_input_are_answered_or_refused_line_by_line(chat_speculator, data):
    COUNTS["chat"] += 1
    lines = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="surrogateescape")
    out, err = io.StringIO(), io.StringIO()
    assert run_chat(chat_speculator, lines, out, max_new_tokens=1, error_stream=err) == 0
    assert all(line.startswith("specula: error:") for line in err.getvalue().splitlines()), err.getvalue()

