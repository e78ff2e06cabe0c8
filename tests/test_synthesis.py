"""Prompts the target writes itself: filters for length, language and near-duplicates, the same prompts for the
same seed, and `specula prompts` writing JSONL that `specula train` reads."""

from __future__ import annotations

import itertools

import pytest
from conftest import STORIES, write_tiny_gguf

from specula.cli import main
from specula.errors import SpeculaError
from specula.runtime.target import Target
from specula.training.records import read_records
from specula.training.synthesis import (
    SynthesisOptions,
    rejection,
    shingles,
    similarity,
    synthesize_prompts,
    user_prefix_ids,
)

OPTIONS = SynthesisOptions(count=6, max_new_tokens=40, batch_size=8, min_chars=4, max_chars=400, min_latin=0.5)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory, no_machine_profile):
    """A random 2-layer chat model with a ChatML template, from a GGUF converted into the session cache."""
    return Target.load(write_tiny_gguf(tmp_path_factory.mktemp("synth") / "tiny-chat.gguf"), dtype="float32")


@pytest.mark.parametrize("text, reason", [
    ("Hi", "length"),
    ("x" * 700, "length"),
    ("What is the capital of France?", ""),
    ("¿Dónde está la biblioteca pública?", ""),
    ("Что такое машинное обучение и зачем оно?", "language"),
    ("{}[]();;;;==++--**//\\\\ a", "language"),
])
def test_length_and_language_filters(text, reason):
    assert rejection(text, SynthesisOptions()) == reason


def test_near_duplicates_are_measured_on_word_trigrams():
    a = shingles("How do I bake a loaf of sourdough bread at home?")
    b = shingles("how do I bake a loaf of sourdough bread at home")
    c = shingles("Write a poem about the sea at night.")
    assert similarity(a, b) == 1.0 and similarity(a, c) == 0.0


def test_the_user_prefix_is_where_the_template_puts_the_message(tiny_chat):
    prefix = tiny_chat.tokenizer.decode(user_prefix_ids(tiny_chat.tokenizer))
    assert prefix == "<|im_start|>user\n"


def test_a_model_without_a_chat_template_is_refused():
    with pytest.raises(SpeculaError, match="no chat template"):
        user_prefix_ids(Target.load(STORIES, dtype="float32").tokenizer)


def test_kept_prompts_pass_every_filter_and_repeat_for_a_seed(tiny_chat):
    first = synthesize_prompts(tiny_chat, OPTIONS, progress=False)
    again = synthesize_prompts(tiny_chat, OPTIONS, progress=False)
    other = synthesize_prompts(tiny_chat, SynthesisOptions(**{**vars(OPTIONS), "seed": 1}), progress=False)
    assert first.prompts == again.prompts and first.prompts != other.prompts
    assert 0 < len(first.prompts) <= OPTIONS.count
    assert len(first.prompts) + sum(first.dropped.values()) <= first.generated
    assert all(rejection(p, OPTIONS) == "" for p in first.prompts)
    for a, b in itertools.combinations(first.prompts, 2):
        assert similarity(shingles(a), shingles(b)) < OPTIONS.max_similarity


def test_prompts_command_writes_records_train_reads_and_never_overwrites(tiny_chat, tmp_path, capsys):
    out = tmp_path / "prompts.jsonl"
    argv = ["prompts", "--target", str(tiny_chat.path), "--out", str(out), "--count", "4", "--max-new-tokens", "40",
            "--min-chars", "4", "--seed", "3"]
    assert main(argv) == 0
    records = read_records(out)
    assert 1 <= len(records) <= 4
    before = out.read_bytes()
    assert main(argv) == 2 and "exists" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert main([*argv[:2], str(STORIES), *argv[3:], "--force"]) == 2
    assert "no chat template" in capsys.readouterr().err and out.read_bytes() == before
