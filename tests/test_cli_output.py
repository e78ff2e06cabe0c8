"""Where the output goes: a closed pipe or a full disk ends with the right status and at most one line;
a rejected benchmark leaves no output directory behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STORIES

from specula.cli import main

CLI = [sys.executable, "-c", "import sys, specula.cli; sys.exit(specula.cli.main(sys.argv[1:]))"]
GENERATE = ["generate", "--target", str(STORIES), "--prompt", "Once upon a time"]


def test_a_reader_that_goes_away_stops_generation_quietly_with_sigpipe_status():
    process = subprocess.Popen(CLI + GENERATE + ["--max-new-tokens", "300"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.read(5)
    process.stdout.close()  # like `| head -c 5`
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141
    assert b"Traceback" not in err and b"Exception ignored" not in err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to simulate a full disk")
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_a_full_disk_is_one_error_line(extra):
    with open("/dev/full", "w") as full:
        done = subprocess.run(CLI + GENERATE + ["--max-new-tokens", "8", *extra], stdout=full,
                              stderr=subprocess.PIPE, timeout=120)
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 1
    assert lines == ["specula: error: cannot write output: No space left on device"]


def test_a_rejected_bench_option_leaves_no_output_directory(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "--target", str(STORIES), "--methods", "vanilla,pld", "--option", "vanilla.num_tokens=3",
                 "--limit", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "applies only to method" in err
    assert not out.exists()


def test_bench_refuses_to_write_into_a_model_directory(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    code = main(["bench", "--target", str(STORIES), "--methods", "vanilla", "--limit", "1", "--out", str(model)])
    assert code == 2 and "holds a model" in capsys.readouterr().err
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]


def test_a_prompt_that_is_not_utf8_is_one_error_line(capsys):
    assert main([*GENERATE[:3], "--prompt", "Once \udcff upon"]) == 2  # how Python passes a non-UTF-8 argv byte
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not valid UTF-8" in err


@pytest.mark.parametrize("option", [["--method", "eagle2", "--tree-top-k", "600", "--tree-total-tokens", "5"],
                                    ["--method", "eagle", "--tree-choices", "[[0],[700]]"]])
def test_more_children_than_the_head_can_draft_is_refused_before_generating(capsys, option):
    head = Path(__file__).parent / "data" / "eagle-stories260k"
    assert main([*GENERATE, "--draft", str(head), *option]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "the 512 tokens the head drafts" in captured.err
