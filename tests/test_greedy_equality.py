"""Greedy decoding through every method equals `transformers` generate token for token (float32)."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA2XS, STORIES, STORY_PROMPTS

import specula
from specula.runtime.plain_model import transformers_model

NEW_TOKENS = 64
METHODS = {
    "vanilla": {},
    "sps": {"draft": LLAMA2XS, "num_tokens": 4},
    "pld": {"num_tokens": 8},
}


@pytest.fixture(scope="module")
def reference_outputs():
    """The new tokens of `transformers` greedy generate for each prompt."""
    speculator = specula.load(STORIES, method="vanilla", dtype="float32")
    model = transformers_model(speculator.target.model)
    outputs = []
    for prompt in STORY_PROMPTS:
        ids = speculator.encode(prompt)[None]
        generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        outputs.append(generated[0, ids.shape[1]:].tolist())
    return outputs


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_output_equals_transformers_generate(method, reference_outputs):
    speculator = specula.load(STORIES, method=method, dtype="float32", **METHODS[method])
    drafted = 0
    for prompt, expected in zip(STORY_PROMPTS, reference_outputs, strict=True):
        result = speculator.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert result.token_ids == expected, f"{method} diverged from transformers on {prompt!r}"
        drafted += sum(result.stats.accepted_lengths)
    if method != "vanilla":
        assert drafted > 0, f"{method} never accepted a draft token, so the test proved nothing"


def test_compiled_target_decodes_what_transformers_generate_decodes(reference_outputs):
    """With the target's steps compiled (float32: Inductor only reorders sums), a method still decodes
    `transformers`' greedy output."""
    speculator = specula.load(STORIES, method="pld", dtype="float32", compile=True, num_tokens=1)
    assert speculator.target.compiled
    for prompt, expected in zip(STORY_PROMPTS, reference_outputs, strict=True):
        assert speculator.generate(prompt, max_new_tokens=NEW_TOKENS).token_ids == expected


def test_stream_yields_the_same_tokens_as_generate():
    # Drafts verified whole: with the budget (on by default) the second call plans from what the first taught it, so
    # the two may take different cycles to the same tokens.
    speculator = specula.load(STORIES, method="sps", draft=LLAMA2XS, dtype="float32", draft_budget="off")
    whole = speculator.generate(STORY_PROMPTS[0], max_new_tokens=40)
    chunks = list(speculator.stream(STORY_PROMPTS[0], max_new_tokens=40))
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    assert "".join(c.text for c in chunks) == whole.text
    assert len(chunks) == whole.stats.cycles


def test_generation_stops_at_eos_like_transformers():
    speculator = specula.load(STORIES, method="pld", dtype="float32")
    model = transformers_model(speculator.target.model)
    # stories260k separates stories with BOS and rarely emits its EOS, so a full stop plays EOS here.
    full_stop = speculator.tokenizer.convert_tokens_to_ids(".")
    speculator.target.eos_token_ids = {full_stop}
    for prompt in STORY_PROMPTS[:5]:
        ids = speculator.encode(prompt)
        expected = model.generate(ids[None], max_new_tokens=64, do_sample=False,
                                  eos_token_id=full_stop)[0, len(ids):].tolist()
        result = speculator.generate(prompt, max_new_tokens=64)
        assert result.token_ids == expected
        assert result.stats.stop_reason == "eos" and result.token_ids[-1] == full_stop


def test_context_limit_stops_generation_without_error():
    speculator = specula.load(STORIES, method="sps", draft=LLAMA2XS, dtype="float32", max_length=40)
    result = speculator.generate(STORY_PROMPTS[0], max_new_tokens=100, stop_on_eos=False)
    assert result.stats.stop_reason == "context_length"
    assert len(speculator.encode(STORY_PROMPTS[0])) + len(result.token_ids) == 40


def test_sampling_is_reproducible_with_a_seed():
    # Without a draft budget: one that learns from the first call drafts otherwise in the second, and a draft of
    # another depth consumes other random numbers (the distribution is the same, the tokens are not).
    speculator = specula.load(STORIES, method="sps", draft=LLAMA2XS, dtype="float32", draft_budget="off")
    first = speculator.generate(STORY_PROMPTS[1], max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7)
    again = speculator.generate(STORY_PROMPTS[1], max_new_tokens=30, temperature=0.8, top_p=0.9, seed=7)
    assert first.token_ids == again.token_ids


def test_tokens_per_cycle_counts_the_target_token():
    speculator = specula.load(STORIES, method="vanilla", dtype="float32")
    result = speculator.generate(STORY_PROMPTS[2], max_new_tokens=20, stop_on_eos=False)
    assert result.stats.cycles == 20 and result.stats.tau == pytest.approx(1.0)
    assert torch.is_tensor(speculator.encode(result.token_ids))
