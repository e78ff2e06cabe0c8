"""Conversation jobs for generated training data: deterministic under a seed, varied, and free of evaluation data."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import REPO

from specula.errors import SpeculaError
from specula.training.conversations import (
    DOCUMENT_TASKS,
    LONG_REQUESTS,
    SYSTEM_PROMPTS,
    JobMaker,
    PromptMix,
    evaluation_overlap,
    fixed_texts,
    read_seed_prompts,
)

DATA = REPO.parent / "shared" / "data"
GSM8K, ALPACA = DATA / "gsm8k" / "train_questions.jsonl", DATA / "alpaca" / "seed_tasks.jsonl"


def evaluation_questions() -> list[str]:
    questions = []
    for name in ("mt_bench", "spec_bench"):
        for line in (DATA / name / "question.jsonl").read_text().splitlines():
            questions.extend(json.loads(line)["turns"])
    with gzip.open(DATA / "humaneval" / "HumanEval.jsonl.gz", "rt") as lines:
        questions.extend(json.loads(line)["prompt"] for line in lines)
    return questions


def test_jobs_are_a_function_of_seed_and_index():
    mix = PromptMix(seed=7, gsm8k=GSM8K, alpaca=ALPACA)
    first, again, other = JobMaker(mix), JobMaker(mix), JobMaker(PromptMix(seed=8, gsm8k=GSM8K, alpaca=ALPACA))
    assert [first.job(i) for i in range(50)] == [again.job(i) for i in reversed(range(50))][::-1]
    assert [first.job(i) for i in range(50)] != [other.job(i) for i in range(50)]


def test_the_mix_has_every_kind_system_prompts_both_temperatures_and_long_answers():
    maker = JobMaker(PromptMix(seed=0, gsm8k=GSM8K, alpaca=ALPACA))
    jobs = [maker.job(i) for i in range(400)]
    assert {job.kind for job in jobs} == {"magpie", "gsm8k", "alpaca", "long", "document"}
    assert {job.temperature for job in jobs} == {0.0, 1.0}
    turns = [turn for job in jobs for c in job.conversations for turn in c.turns]
    assert any(t.role == "system" for t in turns) and any(t.role == "user" and t.generated for t in turns)
    assert max(t.max_new_tokens for t in turns) >= 512
    multi = [c for job in jobs for c in job.conversations if sum(t.role == "assistant" for t in c.turns) > 1]
    quoted = [job for job in jobs if len(job.conversations) == 2]
    assert multi and quoted


def test_no_prompt_equals_or_contains_an_evaluation_question():
    questions = evaluation_questions()
    maker = JobMaker(PromptMix(seed=0, gsm8k=GSM8K, alpaca=ALPACA))
    texts = {text for i in range(3000) for text in fixed_texts(maker.job(i))}
    texts |= set(SYSTEM_PROMPTS) | {text for pair in DOCUMENT_TASKS for text in pair} | set(LONG_REQUESTS)
    texts |= set(read_seed_prompts(GSM8K, "GSM8K")) | set(read_seed_prompts(ALPACA, "Alpaca"))
    assert len(texts) > 7000
    assert evaluation_overlap(sorted(texts), questions) == []
    # The check itself finds a planted question, in other case and spacing.
    planted = "Intro.  " + questions[0].upper().replace(" ", "  ")
    assert evaluation_overlap([planted], questions) == [(planted, " ".join(questions[0].lower().split()))]


def test_bad_mix_settings_and_seed_files_are_refused(tmp_path):
    with pytest.raises(SpeculaError, match="weights"):
        PromptMix(weights={"chatlogs": 1.0})
    with pytest.raises(SpeculaError, match="temperatures"):
        PromptMix(temperatures=(-1.0,))
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(SpeculaError, match="line 1"):
        read_seed_prompts(tmp_path / "bad.jsonl", "GSM8K")
    with pytest.raises(SpeculaError, match="needs seed prompts"):
        JobMaker(PromptMix(chat=False))
