"""Chat templates as `transformers` applies them, --system/--raw, the end-of-turn stop, and `specula chat`."""

from __future__ import annotations

import copy
import io
import json

import pytest
from conftest import STORIES

import specula
import specula.cli.chat
from specula import methods
from specula.chat.session import run_chat
from specula.chat.template import encode_chat, end_of_turn_ids, template_end_ids
from specula.cli import main
from specula.errors import SpeculaError

QUESTION = "What is the capital of France?"
CONVERSATIONS = [
    [{"role": "user", "content": QUESTION}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name a colour."}],
]


def template_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


@pytest.fixture
def chat_model(smollm2):
    return smollm2.speculator


@pytest.fixture(scope="module")
def stories():
    return specula.load(STORIES, dtype="float32")


# ---------------------------------------------------------------- the prompt rule


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_messages_are_encoded_exactly_as_apply_chat_template(chat_model, messages):
    expected = template_ids(chat_model.tokenizer, messages)
    assert encode_chat(chat_model.tokenizer, messages) == expected
    assert chat_model.encode(messages=messages).tolist() == expected


def test_text_prompt_is_the_users_message_and_system_comes_first(chat_model):
    tokenizer = chat_model.tokenizer
    assert chat_model.encode(QUESTION).tolist() == template_ids(tokenizer, CONVERSATIONS[0])
    assert chat_model.encode(QUESTION, system="Answer in one word.").tolist() == template_ids(tokenizer,
                                                                                               CONVERSATIONS[1])
    assert chat_model.encode(messages=CONVERSATIONS[0], system="Answer in one word.").tolist() == template_ids(
        tokenizer, CONVERSATIONS[1])


def test_raw_bypasses_the_template_and_ids_are_used_as_given(chat_model):
    tokenizer = chat_model.tokenizer
    assert chat_model.encode(QUESTION, raw=True).tolist() == tokenizer(QUESTION).input_ids
    assert chat_model.encode([5, 6, 7]).tolist() == [5, 6, 7]
    raw = chat_model.generate(QUESTION, raw=True, max_new_tokens=8)
    assert raw.stats.prompt_tokens == len(tokenizer(QUESTION).input_ids)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=QUESTION, messages=CONVERSATIONS[0]), "either a prompt or messages"),
    (dict(messages=CONVERSATIONS[0], raw=True), "raw applies to a text prompt"),
    (dict(prompt=QUESTION, raw=True, system="x"), "a system message needs"),
    (dict(prompt=[1, 2], system="x"), "a system message needs"),
    (dict(messages=CONVERSATIONS[1], system="x"), "already start with a system message"),
    (dict(messages=[{"role": "user"}]), "each message must be"),
    (dict(messages=[]), "non-empty list"),
    (dict(prompt="  "), "the prompt is empty"),
    (dict(), "the prompt is empty"),
])
def test_bad_chat_input_is_a_specula_error(chat_model, kwargs, message):
    with pytest.raises(SpeculaError, match=message):
        chat_model.encode(**kwargs)


def test_models_without_a_template_keep_plain_prompts(stories):
    assert stories.encode("Once upon a time").tolist() == stories.tokenizer("Once upon a time").input_ids
    with pytest.raises(SpeculaError, match="no chat template|messages need a chat template"):
        stories.encode(messages=CONVERSATIONS[0])
    with pytest.raises(SpeculaError, match="a system message needs"):
        stories.encode("Once upon a time", system="Be brief.")
    with pytest.raises(SpeculaError, match="has no chat template; use `specula generate`"):
        run_chat(stories, io.StringIO("hello\n"), io.StringIO())


# ---------------------------------------------------------------- end of turn


def test_end_of_turn_is_the_token_the_template_closes_an_answer_with(chat_model):
    tokenizer, model = chat_model.tokenizer, chat_model.target.model
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert template_end_ids(tokenizer) == {im_end} and end_of_turn_ids(tokenizer, model) == {2} == {im_end}
    other = copy.deepcopy(tokenizer)
    other.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert template_end_ids(other) == {end_of_text}
    assert end_of_turn_ids(other, model) == {2, end_of_text}


def test_generation_stops_at_end_of_turn(chat_model):
    result = chat_model.generate(QUESTION, max_new_tokens=32)
    assert result.text == "The capital of France is Paris."
    assert result.stats.stop_reason == "eos" and result.token_ids[-1] == 2 and len(result.token_ids) < 32


# ---------------------------------------------------------------- the chat loop


def spy_on_prompts(monkeypatch, speculator) -> list[list[int]]:
    """Record the ids of every prompt the speculator encodes."""
    prompts, encode = [], speculator.encode

    def recording(*args, **kwargs):
        ids = encode(*args, **kwargs)
        prompts.append(ids.tolist())
        return ids

    monkeypatch.setattr(speculator, "encode", recording)
    return prompts


def contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i:i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


def test_chat_through_a_pipe_keeps_the_first_turn_in_context(chat_model, monkeypatch):
    prompts = spy_on_prompts(monkeypatch, chat_model)
    out = io.StringIO()
    code = run_chat(chat_model, io.StringIO(f"{QUESTION}\n\nAnd of Italy?\n/exit\nnever read\n"), out,
                    max_new_tokens=16)
    assert code == 0
    turns = [p for i, p in enumerate(prompts) if i == 0 or p != prompts[i - 1]]  # fitting the context encodes too
    assert len(turns) == 2
    text = out.getvalue()
    first_answer = "The capital of France is Paris."
    assert text.startswith(first_answer + "\n") and "Rome" in text
    assert turns[1][: len(turns[0])] == turns[0]  # the first question...
    assert contains(turns[1], chat_model.tokenizer(first_answer, add_special_tokens=False).input_ids)  # ...answered
    stats_lines = [line for line in text.splitlines() if "tokens/s" in line]
    assert len(stats_lines) == 2 and all("τ 1.00 (vanilla" in line for line in stats_lines)
    assert "\033[" not in text  # not a terminal: no colour codes
    assert "never read" not in text


def test_chat_ends_cleanly_at_end_of_input_and_dims_stats_on_a_terminal(chat_model):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    assert run_chat(chat_model, io.StringIO("Say hi."), out, max_new_tokens=2) == 0
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("\033[2m") and lines[-1].endswith("\033[0m") and "tokens/s" in lines[-1]


def test_specula_chat_command_reads_stdin(chat_model, monkeypatch, capsys):
    loaded = []

    def fake_load(target, **kwargs):
        loaded.append((target, kwargs))
        return chat_model

    monkeypatch.setattr(specula.cli.chat, "build_speculator", fake_load)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTION}\nAnd of Germany?\n"))
    assert main(["chat", "--max-new-tokens", "16", "--system", "You are a helpful AI assistant."]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "Berlin" in out and out.count("tokens/s") == 2
    assert str(loaded[0][0]) == "SmolLM2-135M-Instruct" and loaded[0][1]["method"] == "suffix"


def test_generate_command_system_and_raw(chat_model, monkeypatch, capsys):
    monkeypatch.setattr(specula.cli.chat, "build_speculator", lambda target, **kwargs: chat_model)
    lengths = set()
    for flags, kwargs in [([], {}), (["--raw"], {"raw": True}), (["--system", "Be brief."], {"system": "Be brief."})]:
        assert main(["generate", "--prompt", QUESTION, "--max-new-tokens", "1", "--json", *flags]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["prompt_tokens"] == len(chat_model.encode(QUESTION, **kwargs))
        lengths.add(report["prompt_tokens"])
    assert len(lengths) == 3


def test_head_method_on_the_default_target_without_a_head_is_one_line(monkeypatch, capsys):
    # Heads for the default target land one by one; take eagle2's away so this pins the message, not the catalogue.
    bundled = methods.DEFAULT_HEADS[methods.DEFAULT_MODEL]
    without_eagle2 = {m: d for m, d in bundled.items() if m != "eagle2"}
    monkeypatch.setitem(methods.DEFAULT_HEADS, methods.DEFAULT_MODEL, without_eagle2)
    assert main(["generate", "--method", "eagle2", "--prompt", QUESTION]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "no eagle2 head ships for the default target SmolLM2-135M-Instruct yet: pass --draft" in err
