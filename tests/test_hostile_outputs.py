"""Commands that write an output refuse, before any model loads or anything is written, an output they would
damage: a directory holding files they did not write, a path under a file, a file that is not their own kind of
output (issue 41). One `specula: error:` line, exit 2, the path untouched; their own earlier output is resumed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, STORIES, copy_dir, fingerprint, one_error

from specula.cli import main
from specula.runtime.target import Target

pytestmark = pytest.mark.usefixtures("single_thread")

EAGLE3 = REPO / "tests" / "data" / "eagle3-stories260k"
QUESTION = {"question_id": "q", "category": "story", "prompt": "Once upon a time"}


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model fails the test: the refusal must come first."""
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: pytest.fail("a model was loaded")))


def occupied(case: str, tmp_path: Path) -> tuple[Path, Path]:
    """(--out to refuse, the path that must stay as it was)."""
    if case == "other files":
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "todo.txt").write_text("keep me")
        (tmp_path / "notes" / "results.md").write_text("my own results")  # a name bench writes
        return tmp_path / "notes", tmp_path / "notes"
    if case == "model directory":
        model = copy_dir(STORIES, tmp_path / "model")
        return model, model
    if case == "under a file":
        (tmp_path / "file").write_text("keep me")
        return tmp_path / "file" / "out", tmp_path
    raise AssertionError(case)


EXPECTED = {"other files": "files it did not write", "model directory": "a model or draft head",
            "under a file": "which is a file"}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bench_refuses_an_out_it_did_not_write_before_loading(case, tmp_path, no_loading, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps(QUESTION) + "\n")
    out, guarded = occupied(case, tmp_path)
    before = fingerprint(guarded)
    line = one_error(capsys, main(["bench", "--target", str(STORIES), "--data", str(questions), "--methods",
                                   "vanilla", "--max-new-tokens", "4", "--out", str(out), "--no-profile"]))
    assert EXPECTED[case] in line and str(out) in line, line
    assert fingerprint(guarded) == before


DATA_ARGS = ["--gen-weights", "float32", "--gen-max-jobs", "1", "--gen-batch-size", "1", "--gen-answer-tokens", "4",
             "--gen-max-length", "64"]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_train_data_refuses_an_out_it_did_not_write_before_loading(case, tmp_path, no_loading, capsys):
    out, guarded = occupied(case, tmp_path)
    before = fingerprint(guarded)
    line = one_error(capsys, main(["train", "data", "--target", str(STORIES), "--out", str(out), *DATA_ARGS]))
    assert EXPECTED[case] in line and str(out) in line, line
    assert fingerprint(guarded) == before


def test_generated_data_is_not_written_into_a_directory_it_did_not_write(tmp_path, no_loading, capsys):
    out, guarded = occupied("other files", tmp_path)
    before = fingerprint(guarded)
    records = tmp_path / "data.jsonl"
    records.write_text(json.dumps({"text": "Once upon a time"}) + "\n")
    line = one_error(capsys, main(["train", "eagle", "--target", str(STORIES), "--generated", str(out),
                                   "--gen-tokens", "8", "--out", str(tmp_path / "head"), *DATA_ARGS]))
    assert "--generated" in line and "files it did not write" in line, line
    assert fingerprint(guarded) == before and not (tmp_path / "head").exists()


def test_train_data_refused_after_loading_leaves_no_out(tmp_path, capsys):
    # stories260k has no chat template, so its data needs seed prompts: known before anything is generated
    line = one_error(capsys, main(["train", "data", "--target", str(STORIES), "--out", str(tmp_path / "data"),
                                   *DATA_ARGS]))
    assert "seed prompts" in line, line
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("run_file", ["{bad json", "[]", '{"components": 3}'])
def test_train_data_resuming_a_damaged_run_file_is_one_error_line(run_file, tmp_path, no_loading, capsys):
    out = tmp_path / "data"
    out.mkdir()
    (out / "run.json").write_text(run_file)
    line = one_error(capsys, main(["train", "data", "--target", str(STORIES), "--out", str(out), *DATA_ARGS]))
    assert str(out / "run.json") in line, line
    assert (out / "run.json").read_text() == run_file


def test_calibrate_never_replaces_a_file_that_is_not_a_profile(tmp_path, monkeypatch, capsys):
    import specula.cli.bench as bench_cli

    monkeypatch.setattr(bench_cli, "calibrate", lambda *a, **k: pytest.fail("measured before checking --out"))
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    line = one_error(capsys, main(["calibrate", "--target", str(STORIES), "--method", "pld", "--out", str(notes)]))
    assert str(notes) in line and "not a hardware profile" in line, line
    assert notes.read_text() == "keep me"


def test_medusa_tree_never_replaces_a_file_that_is_not_a_tree(tmp_path, no_loading, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    records = tmp_path / "data.jsonl"
    records.write_text(json.dumps({"text": "Once upon a time"}) + "\n")
    line = one_error(capsys, main(["train", "medusa-tree", "--target", str(STORIES), "--draft", str(tmp_path),
                                   "--data", str(records), "--out", str(notes)]))
    assert str(notes) in line and "not a Medusa tree" in line, line
    assert notes.read_text() == "keep me"


def test_a_cache_dir_that_is_a_file_is_refused_by_name_before_loading(tmp_path, no_loading, capsys):
    cache = tmp_path / "cache"
    cache.write_text("keep me")
    records = tmp_path / "data.jsonl"
    records.write_text(json.dumps({"text": "Once upon a time"}) + "\n")
    line = one_error(capsys, main(["train", "eagle", "--target", str(STORIES), "--data", str(records), "--out",
                                   str(tmp_path / "head"), "--cache-dir", str(cache)]))
    assert "--cache-dir" in line and str(cache) in line and "is a file" in line, line
    assert cache.read_text() == "keep me" and not (tmp_path / "head").exists()


def test_a_gguf_export_under_a_file_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "file").write_text("keep me")
    out = tmp_path / "file" / "head.gguf"
    line = one_error(capsys, main(["convert", "--draft", str(EAGLE3), "--to", "gguf", "--target", str(STORIES),
                                   "--out", str(out)]))
    assert f"--out {out} lies under {tmp_path / 'file'}, which is a file" in line, line
