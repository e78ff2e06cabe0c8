"""The target's tokenizer without `transformers` (`specula.runtime.tokenizer.PlainTokenizer`): the same ids, texts
and chat prompts as the transformers tokenizer it stands for, kept across the converted cache, and a warm start that
never imports `transformers`."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LLAMA2XS, PYCODER, REPO, STORIES, copy_dir
from transformers import AutoTokenizer

from specula.chat.template import end_of_turn_ids, template_end_ids
from specula.runtime.model_source import cache_dir
from specula.runtime.tokenizer import PlainTokenizer, load_tokenizer, plain_tokenizer, tokenizer_fingerprint

MT_BENCH = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
AWKWARD = ["", " ", "\n\n\n", "\t x \t", "<|im_start|>user\nhi<|im_end|>", "</s> <s> <unk> <|endoftext|>",
           "\u200b\u200d\ufeff zero widths", "e\u0301 combining, \u00e9 composed", "\U0001f469\u200d\U0001f4bb 🙂",
           "\\x00 \\n literal escapes", "  x" * 50, "Ωμέγα Кириллица 日本語 العربية", "{{ '{%' }} {% raw %}"]


def texts() -> list[str]:
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines()]
    return [turn for q in questions[:40] for turn in q["turns"]] + AWKWARD


@pytest.fixture(scope="module")
def smollm2_dir(smollm2) -> Path:
    """The bundled chat model's tokenizer files (from the GGUF converted into this session's cache)."""
    return smollm2.speculator.tokenizer.source


def pair(model_dir: Path) -> tuple[PlainTokenizer, object]:
    plain = load_tokenizer(model_dir)
    assert isinstance(plain, PlainTokenizer)
    return plain, AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.mark.parametrize("model", [STORIES, LLAMA2XS, PYCODER], ids=lambda p: p.name)
def test_a_plain_tokenizer_encodes_and_decodes_as_transformers_does(model):
    plain, full = pair(model)
    for text in texts():
        for special in (True, False):
            ids = full(text, add_special_tokens=special).input_ids
            assert plain(text, add_special_tokens=special).input_ids == ids == plain.encode(text, special)
            for skip in (True, False):
                assert plain.decode(ids, skip_special_tokens=skip) == full.decode(ids, skip_special_tokens=skip)
    assert plain.get_vocab() == full.get_vocab() and len(plain) == len(full)
    # A generated-data directory is keyed by the tokenizer's fingerprint: a run resumes under either tokenizer.
    assert tokenizer_fingerprint(plain) == tokenizer_fingerprint(full) and plain._full is None
    assert plain.all_special_ids == full.all_special_ids
    assert (plain.eos_token_id, plain.bos_token_id, plain.pad_token_id) == (
        full.eos_token_id, full.bos_token_id, full.pad_token_id)
    ids = full("Once upon a time").input_ids
    assert plain.convert_ids_to_tokens(ids) == full.convert_ids_to_tokens(ids)
    assert plain.convert_ids_to_tokens(ids[0]) == full.convert_ids_to_tokens(ids[0])


def test_a_plain_tokenizer_renders_the_chat_template_as_transformers_does(smollm2_dir):
    plain, full = pair(smollm2_dir)
    prompts = texts()
    for i, text in enumerate(prompts):
        other = prompts[(i + 1) % len(prompts)]
        for conversation in ([{"role": "user", "content": text}],
                             [{"role": "system", "content": other}, {"role": "user", "content": text}],
                             [{"role": "user", "content": other}, {"role": "assistant", "content": text},
                              {"role": "user", "content": other}]):
            for generation in (True, False):
                ids = full.apply_chat_template(conversation, add_generation_prompt=generation)["input_ids"]
                assert plain.apply_chat_template(conversation, add_generation_prompt=generation)["input_ids"] == ids
                assert plain.apply_chat_template(conversation, add_generation_prompt=generation,
                                                 return_dict=False) == ids
                assert plain.apply_chat_template(conversation, add_generation_prompt=generation, tokenize=False) == (
                    full.apply_chat_template(conversation, add_generation_prompt=generation, tokenize=False))
    assert template_end_ids(plain) == template_end_ids(full) == {full.convert_tokens_to_ids("<|im_end|>")}
    # What the plain tokenizer does not answer itself (another message field, another option) transformers does.
    named = [{"role": "user", "content": "Hi", "name": "ann"}]
    assert plain.apply_chat_template(named, tokenize=False) == full.apply_chat_template(named, tokenize=False)
    assert plain.convert_tokens_to_ids("<|im_end|>") == full.convert_tokens_to_ids("<|im_end|>")


def test_a_plain_tokenizer_survives_pickling_and_copies_for_the_cache_and_the_servers_threads(smollm2_dir):
    plain, full = pair(smollm2_dir)
    conversation = [{"role": "user", "content": "Write a short poem about the sea."}]
    expected = full.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    for again in (pickle.loads(pickle.dumps(plain)), copy.deepcopy(plain)):
        assert isinstance(again, PlainTokenizer) and again._full is None
        assert again.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False) == expected
        assert again.decode(expected) == full.decode(expected)


def test_a_template_jinja_cannot_compile_here_keeps_the_transformers_tokenizer(tmp_path):
    """transformers adds a ``{% generation %}`` tag for assistant masks; a template using it stays with transformers."""
    model = copy_dir(STORIES, tmp_path / "stories260k")
    full = AutoTokenizer.from_pretrained(model, local_files_only=True)
    full.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                          "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    assert plain_tokenizer(full, model) is full
    full.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert isinstance(plain_tokenizer(full, model), PlainTokenizer)


def test_a_warm_quantized_start_never_imports_transformers(tmp_path):
    """The second `specula generate` maps the converted model and its plain tokenizer from the cache: the first
    token comes without `transformers`' ~1 s of imports, and the answer is the first run's."""
    try:
        from specula.runtime.weights import check_available

        check_available("q4_1", "cpu")
    except Exception as err:
        pytest.skip(str(err))
    env = {**os.environ, "SPECULA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop("SPECULA_CONVERTED_CACHE", None)
    (tmp_path / "cache").mkdir()
    built = cache_dir() / "kernels"
    if built.is_dir():
        (tmp_path / "cache" / "kernels").symlink_to(built.resolve(), target_is_directory=True)
    run = ("import sys; from specula.cli import main; "
           f"code = main(['generate', '--target', {str(STORIES)!r}, '--weights', 'q4_1', '--method', 'pld', "
           "'--prompt', 'Once upon a time', '--max-new-tokens', '12', '--json']); "
           "print('transformers' in sys.modules, file=sys.stderr); sys.exit(code)")
    answers = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", run], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        answers.append((json.loads(done.stdout)["token_ids"], done.stderr.strip().splitlines()[-1]))
    assert answers[0][1] == "True" and answers[1][1] == "False"  # cold converts through transformers; warm does not
    assert answers[0][0] == answers[1][0] and len(answers[0][0]) == 12


def test_end_of_turn_ids_are_the_same_through_either_tokenizer(smollm2):
    speculator = smollm2.speculator
    model = speculator.target.model
    assert isinstance(speculator.tokenizer, PlainTokenizer)
    full = AutoTokenizer.from_pretrained(speculator.tokenizer.source, local_files_only=True)
    assert end_of_turn_ids(speculator.tokenizer, model) == end_of_turn_ids(full, model)
