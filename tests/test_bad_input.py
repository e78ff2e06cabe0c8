"""The last hostile inputs of the hardening audit (issue 41): each ends in one `specula: error:` line and exit 2 (or
a SpeculaError in the Python API) with nothing left behind — never a traceback, a silent coercion or exit 1.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, STORIES, copy_dir, write_tiny_gguf
from safetensors.torch import load_file, save_file

import specula
from specula.chat.session import run_chat
from specula.cli import main
from specula.cli.common import report_os_error
from specula.errors import SpeculaError

EAGLE = REPO / "tests" / "data" / "eagle-stories260k"
QUESTION = {"question_id": "q", "category": "story", "prompt": "Once upon a time"}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

pytestmark = pytest.mark.usefixtures("single_thread")


def one_error(capsys, code: int) -> str:
    """The single `specula: error:` line of a run that must have failed with exit status 2."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specula: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


def records_file(path: Path, count: int = 4) -> Path:
    path.write_text("".join(json.dumps({"text": f"Once upon a time there was a cat. Day {i}."}) + "\n"
                            for i in range(count)))
    return path


def bench(out: Path, questions: Path, *extra: str) -> int:
    return main(["bench", "--target", str(STORIES), "--data", str(questions), "--max-new-tokens", "4",
                 "--threads", "1", "--out", str(out), "--no-progress", "--no-profile", *extra])


@pytest.fixture
def questions(tmp_path) -> Path:
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps(QUESTION) + "\n")
    return path


# ---------------------------------------------------------------- tracebacks that were exit 1


def test_an_ldlp_with_nan_weights_is_refused_by_name(tmp_path, capsys):
    head = copy_dir(EAGLE, tmp_path / "head")
    weights = head / "ldlp" / "model.safetensors"
    save_file({k: v * math.nan for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    line = one_error(capsys, main(["generate", "--target", str(STORIES), "--method", "ada", "--draft", str(head),
                                   "--prompt", "Once upon a time", "--max-new-tokens", "4", "--dtype", "float32"]))
    assert "non-finite" in line and str(head / "ldlp") in line, line


def test_train_eagle3_on_a_config_without_model_type_is_refused_as_generate_refuses_it(tmp_path, capsys):
    target = copy_dir(STORIES, tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    del config["model_type"]
    (target / "config.json").write_text(json.dumps(config))
    line = one_error(capsys, main(["train", "eagle3", "--target", str(target), "--data",
                                   str(records_file(tmp_path / "data.jsonl")), "--out", str(tmp_path / "out")]))
    assert "target config" in line and "model_type" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("line", ['{"turns": []}', '{"prompt": 3}', '["a"]', "{no json"])
def test_train_eagle3_refuses_an_evaluation_prompt_file_with_a_bad_line_by_its_line_number(tmp_path, capsys, line):
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text('{"prompt": "fine"}\n' + line + "\n")
    message = one_error(capsys, main(["train", "eagle3", "--target", str(STORIES), "--data",
                                      str(records_file(tmp_path / "data.jsonl")), "--out", str(tmp_path / "out"),
                                      "--eval-prompts", str(prompts)]))
    assert f"{prompts}:2" in message, message
    assert not (tmp_path / "out").exists()


def test_bench_refuses_to_resume_from_a_foreign_record(tmp_path, questions, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"records": [{"foo": 1}]}))
    line = one_error(capsys, bench(out, questions, "--methods", "vanilla"))
    assert "record 0 is not a bench record (no 'question')" in line, line


def test_bench_without_data_where_the_default_set_is_absent_says_to_pass_data(tmp_path, monkeypatch, capsys):
    """Installed from a wheel there is no ../shared/data beside the package: one line naming --data."""
    from specula.cli import bench as bench_cli

    monkeypatch.setattr(bench_cli, "DEFAULT_DATA", tmp_path / "shared" / "data" / "mt_bench" / "question.jsonl")
    line = one_error(capsys, main(["bench", "--target", str(STORIES), "--methods", "vanilla", "--out",
                                   str(tmp_path / "out")]))
    assert "pass --data FILE" in line, line


@pytest.mark.parametrize("value, message", [("0", "must be >= 1"), ('"x"', "whole number"), ("2.5", "whole number")])
def test_a_transformers_baseline_option_is_checked_before_anything_runs(value, message, tmp_path, questions, capsys):
    out = tmp_path / "out"
    line = one_error(capsys, bench(out, questions, "--methods", "vanilla,hf_pld", "--option",
                                   f"hf_pld.num_tokens={value}"))
    assert "hf_pld" in line and "num_tokens" in line and message in line, line
    assert not out.exists()


@pytest.mark.parametrize("setting, message", [('seed = "abc"', "seed must be a whole number"),
                                              ("seed = -1", "seed must be >= 0"),
                                              ('top_p = "x"', "top_p must be a number"),
                                              ("dtype = 3", "dtype must be a string")])
def test_a_bench_config_value_of_the_wrong_type_is_one_error_line(setting, message, tmp_path, questions, capsys):
    config = tmp_path / "bench.toml"
    config.write_text(f"[bench]\n{setting}\n")
    line = one_error(capsys, bench(tmp_path / "out", questions, "--methods", "vanilla", "--config", str(config)))
    assert message in line, line
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory, no_machine_profile):
    from specula.runtime.target import Target

    return Target.load(write_tiny_gguf(tmp_path_factory.mktemp("synth") / "tiny-chat.gguf"), dtype="float32")


def test_prompt_synthesis_takes_a_seed_from_the_top_of_the_documented_range(tiny_chat):
    from specula.training.synthesis import SynthesisOptions, synthesize_prompts

    options = SynthesisOptions(count=2, max_new_tokens=12, batch_size=4, min_chars=1, max_attempts=4)
    for seed in (20_000_000_000_000, 2**64 - 1):
        report = synthesize_prompts(tiny_chat, dataclasses.replace(options, seed=seed), progress=False)
        assert sum(report.dropped.values()) + len(report.prompts) == 4  # every sampled message was judged


# ---------------------------------------------------------------- the Python API never coerces a prompt


@pytest.fixture(scope="module")
def speculator():
    return specula.load(STORIES, dtype="float32", profile=False)


@pytest.mark.parametrize("prompt", [b"Once upon a time", bytearray(b"Once"), [1.0, 2.0], [1, 2.5], [True, 3],
                                    [None], torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), torch.tensor(5),
                                    torch.tensor([True]), 7, {"text": "Once"}],
                         ids=lambda p: type(p).__name__ + (f"-{p.dtype}-{p.dim()}D" if isinstance(p, torch.Tensor)
                                                           else ""))
def test_a_prompt_is_text_token_ids_or_an_integer_tensor_and_nothing_else(speculator, prompt):
    with pytest.raises(SpeculaError, match="a prompt is text"):
        speculator.generate(prompt, max_new_tokens=2)


def test_integer_prompts_of_every_accepted_form_give_the_same_tokens(speculator):
    ids = speculator.encode("Once upon a time").tolist()
    expected = speculator.generate(ids, max_new_tokens=4).token_ids
    for prompt in (tuple(ids), torch.tensor(ids), torch.tensor(ids, dtype=torch.int32)):
        assert speculator.generate(prompt, max_new_tokens=4).token_ids == expected


# ---------------------------------------------------------------- paths: named, checked first, nothing left behind


def test_an_os_error_names_the_path_and_what_failed(capsys):
    assert report_os_error(FileExistsError(errno.EEXIST, "File exists", "/tmp/x/cache")) == 2
    assert capsys.readouterr().err == "specula: error: cannot create /tmp/x/cache: something else is there already\n"
    assert report_os_error(OSError(errno.ENOSPC, "No space left on device", "/tmp/x/out.json")) == 1  # the machine
    assert "/tmp/x/out.json" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--cache-dir", "--out"])
def test_a_training_path_that_is_or_lies_under_a_file_is_refused_before_loading(flag, tmp_path, capsys):
    (tmp_path / "file").write_text("keep me")
    paths = {"--cache-dir": tmp_path / "cache", "--out": tmp_path / "out", flag: tmp_path / "file" / "x"}
    line = one_error(capsys, main(["train", "eagle", "--target", str(STORIES), "--data",
                                   str(records_file(tmp_path / "data.jsonl")), "--out", str(paths["--out"]),
                                   "--cache-dir", str(paths["--cache-dir"])]))
    assert flag in line and str(tmp_path / "file") in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "file"]


def test_a_training_run_refused_after_loading_leaves_no_out_directory(tmp_path, capsys):
    line = one_error(capsys, main(["train", "eagle", "--target", str(STORIES), "--data",
                                   str(records_file(tmp_path / "data.jsonl", 2)), "--out", str(tmp_path / "out"),
                                   "--eval-samples", "4", "--no-regenerate"]))
    assert "too few" in line, line
    assert not (tmp_path / "out").exists()


def test_prompts_refuses_an_out_directory_before_loading(tmp_path, monkeypatch, capsys):
    from specula.runtime.target import Target

    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: pytest.fail("a model was loaded")))
    line = one_error(capsys, main(["prompts", "--target", str(STORIES), "--out", str(tmp_path), "--force"]))
    assert "is a directory" in line


def test_calibrate_refuses_its_out_before_measuring(tmp_path, monkeypatch, capsys):
    import specula.cli.bench as bench_cli

    monkeypatch.setattr(bench_cli, "calibrate", lambda *a, **k: pytest.fail("measured before checking --out"))
    (tmp_path / "file").write_text("keep me")
    line = one_error(capsys, main(["calibrate", "--target", str(STORIES), "--method", "pld", "--out",
                                   str(tmp_path / "file" / "profile.json")]))
    assert "lies under" in line and str(tmp_path / "file") in line


# ---------------------------------------------------------------- chat skips a failed turn


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    directory = copy_dir(STORIES, tmp_path_factory.mktemp("chat") / "stories260k")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return directory


def test_chat_skips_a_line_that_is_not_utf8_and_answers_the_next(chat_dir):
    done = subprocess.run([sys.executable, "-m", "specula", "chat", "--target", str(chat_dir), "--dtype", "float32",
                           "--max-new-tokens", "4", "--no-profile"], input=b"Hello\n\xff\xfe\x00junk\nWhat is 2+2?\n",
                          capture_output=True, timeout=300)
    errors = done.stderr.decode().splitlines()
    assert done.returncode == 0 and len(errors) == 1 and errors[0].startswith("specula: error:"), done.stderr
    assert "UTF-8" in errors[0]
    assert sum("tokens/s" in line for line in done.stdout.decode().splitlines()) == 2  # the first and third lines


def test_a_strictly_decoded_stream_that_fails_is_one_error_line_not_a_traceback(chat_dir):
    lines = io.TextIOWrapper(io.BytesIO(b"\xff\xfe junk\n"), encoding="utf-8", errors="strict")
    out, err = io.StringIO(), io.StringIO()
    assert run_chat(specula.load(chat_dir, dtype="float32", profile=False), lines, out, max_new_tokens=4,
                    error_stream=err) == 0
    assert err.getvalue().startswith("specula: error:") and err.getvalue().count("\n") == 1


# ---------------------------------------------------------------- training's error is a line of its own


def test_a_diverged_training_error_starts_on_a_line_of_its_own(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"Tom and his dog went to the park on day {i}. They played."}) + "\n"
                            for i in range(12)))
    code = main(["train", "eagle", "--target", str(STORIES), "--data", str(data), "--out", str(tmp_path / "out"),
                 "--epochs", "2", "--batch-size", "4", "--eval-samples", "2", "--gen-max-new-tokens", "8",
                 "--warmup-steps", "0", "--lr", "1e30"])
    line = one_error(capsys, code)  # the line starts with `specula: error:`, not after the progress bar's text
    assert "diverged" in line, line
