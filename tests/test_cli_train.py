"""`specula train eagle` from the command line: a real run, and bad input as one line with exit 2."""

from __future__ import annotations

import json

from conftest import STORIES

from specula.cli import main


def run(capfd, *args: str) -> tuple[int, str, str]:
    code = main(["train", "eagle", *map(str, args)])
    out, err = capfd.readouterr()
    return code, out, err


def last_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("specula: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def write_records(path, count: int = 12) -> None:
    stories = ["Once upon a time there was a little cat. The cat liked to play with a ball.",
               "Tom went to the park with his mom. They saw a big dog and a red bird."]
    path.write_text("".join(json.dumps({"text": stories[i % 2] + f" Day {i}."}) + "\n" for i in range(count)))


def common(tmp_path, data) -> list[str]:
    return ["--target", str(STORIES), "--data", str(data), "--out", str(tmp_path / "head"), "--epochs", "1",
            "--batch-size", "4", "--eval-samples", "2", "--gen-max-new-tokens", "8", "--warmup-steps", "1"]


def test_training_writes_a_loadable_head_and_resumes(capfd, tmp_path):
    data = tmp_path / "data.jsonl"
    write_records(data)
    code, _, err = run(capfd, *common(tmp_path, data), "--cache-dir", tmp_path / "cache")
    assert code == 0, err
    assert (tmp_path / "head" / "model.safetensors").is_file()
    assert (tmp_path / "cache" / "samples.pt").is_file()
    # Resuming a finished run is a no-op that reuses the cache; a head of another shape is refused.
    code, _, err = run(capfd, *common(tmp_path, data), "--cache-dir", tmp_path / "cache", "--resume")
    assert code == 0 and "reusing" in err, err
    code, _, err = run(capfd, *common(tmp_path, data), "--cache-dir", tmp_path / "cache", "--resume",
                       "--num-layers", "2")
    assert code == 2 and "another shape" in last_line_error(err)


def test_missing_target_is_one_line(capfd, tmp_path):
    data = tmp_path / "data.jsonl"
    write_records(data)
    args = common(tmp_path, data)
    args[1] = str(tmp_path / "nowhere")
    code, _, err = run(capfd, *args)
    assert code == 2 and "not found" in last_line_error(err)


def test_empty_data_file_is_one_line(capfd, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("")
    code, _, err = run(capfd, *common(tmp_path, data))
    assert code == 2 and "empty" in last_line_error(err)


def test_malformed_data_line_names_the_line(capfd, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    code, _, err = run(capfd, *common(tmp_path, data))
    assert code == 2 and "line 2" in last_line_error(err)


def test_missing_data_file_is_one_line(capfd, tmp_path):
    code, _, err = run(capfd, *common(tmp_path, tmp_path / "absent.jsonl"))
    assert code == 2 and "not found" in last_line_error(err)
