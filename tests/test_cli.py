"""The `specula` command line: one-line errors with exit 2 for bad input, JSON and streamed output, losslessness."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LLAMA2XS, PYCODER, STORIES

import specula
import specula.cli.generate
from specula.cli import build_parser, main
from specula.methods import DEFAULT_TARGET

PROMPT = "Once upon a time"
NEW_TOKENS = 16
SPS_DRAFT_TOKENS = 3


def run(capfd, *args) -> tuple[int, str, str]:
    """main() in-process; capfd rather than capsys so output written by any logging handler is seen too."""
    code = main([str(a) for a in args])
    out, err = capfd.readouterr()
    return code, out, err


def generate(capfd, *args) -> tuple[int, str, str]:
    return run(capfd, "generate", *args)


def assert_one_line_error(code: int, out: str, err: str, fragment: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("specula: error: ")
    assert fragment in lines[0]
    assert out == ""


@pytest.fixture
def not_a_model(tmp_path) -> Path:
    (tmp_path / "weights.bin").write_bytes(b"")
    return tmp_path


def encoder_config_dir(tmp_path: Path, model_type: str) -> Path:
    """A directory whose config.json is a tiny encoder-only (non-causal) model."""
    config = {"model_type": model_type, "architectures": [f"{model_type.capitalize()}Model"], "vocab_size": 64,
              "hidden_size": 16, "dim": 16, "hidden_dim": 32, "n_layers": 1, "n_heads": 2,
              "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
              "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def swapped_tokenizer_draft(tmp_path: Path) -> Path:
    """llama2xs with two vocabulary entries swapped: same vocab size, different tokenizer."""
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        os.symlink(LLAMA2XS.resolve() / name, tmp_path / name)
    tokenizer = json.loads((LLAMA2XS / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["▁the"], vocab["▁and"] = vocab["▁and"], vocab["▁the"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return tmp_path


# ---------------------------------------------------------------- bad input: one line, exit 2


def test_missing_target_directory(capfd, tmp_path):
    assert_one_line_error(*generate(capfd, "--target", tmp_path / "nope", "--prompt", PROMPT), "not found")


def test_target_directory_without_config(capfd, not_a_model):
    assert_one_line_error(*generate(capfd, "--target", not_a_model, "--prompt", PROMPT), "no config.json")


def test_missing_draft_directory(capfd, tmp_path):
    result = generate(capfd, "--target", STORIES, "--method", "sps", "--draft", tmp_path / "nope", "--prompt", PROMPT)
    assert_one_line_error(*result, "draft model not found")


def test_draft_directory_without_config(capfd, not_a_model):
    result = generate(capfd, "--target", STORIES, "--method", "sps", "--draft", not_a_model, "--prompt", PROMPT)
    assert_one_line_error(*result, "no config.json")


def test_encoder_only_config_is_not_a_causal_lm(capfd, tmp_path):
    result = generate(capfd, "--target", encoder_config_dir(tmp_path, "distilbert"), "--prompt", PROMPT)
    assert_one_line_error(*result, "not a causal language model")


def test_bert_config_is_reported_as_not_causal(capfd, tmp_path):
    result = generate(capfd, "--target", encoder_config_dir(tmp_path, "bert"), "--prompt", PROMPT)
    assert_one_line_error(*result, "not a causal language model")


def test_draft_with_other_vocabulary(capfd):
    result = generate(capfd, "--target", STORIES, "--method", "sps", "--draft", PYCODER, "--prompt", PROMPT)
    assert_one_line_error(*result, "vocabulary size")


def test_draft_with_other_tokenizer_of_the_same_size(capfd, tmp_path):
    draft = swapped_tokenizer_draft(tmp_path)
    result = generate(capfd, "--target", STORIES, "--method", "sps", "--draft", draft, "--prompt", PROMPT)
    assert_one_line_error(*result, "tokenizer differs")


@pytest.mark.parametrize("prompt", ["", "  \n\t "])
def test_empty_prompt(capfd, prompt):
    assert_one_line_error(*generate(capfd, "--target", STORIES, "--prompt", prompt), "prompt is empty")


@pytest.mark.parametrize("content", ["", " \n\n"])
def test_empty_prompt_file(capfd, tmp_path, content):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(content)
    result = generate(capfd, "--target", STORIES, "--prompt-file", prompt_file)
    assert_one_line_error(*result, "is empty")


def test_missing_prompt_file(capfd, tmp_path):
    result = generate(capfd, "--target", STORIES, "--prompt-file", tmp_path / "absent.txt")
    assert_one_line_error(*result, "cannot read prompt file")


def test_prompt_longer_than_the_context(capfd, tmp_path):
    # ~3000 words is several thousand tokens against stories260k's 512; the tokenizer's own warning must not leak.
    prompt_file = tmp_path / "long.txt"
    prompt_file.write_text(" ".join(["the little dog ran"] * 750))
    result = generate(capfd, "--target", STORIES, "--prompt-file", prompt_file)
    assert_one_line_error(*result, "context limit")


@pytest.mark.parametrize(("option", "value", "fragment"), [
    ("--temperature", "-0.5", "temperature must be >= 0"),
    ("--temperature", "nan", "temperature must be >= 0"),
    ("--top-p", "0", "top-p must be in (0, 1]"),
    ("--top-p", "1.5", "top-p must be in (0, 1]"),
    ("--top-k", "-1", "top-k must be >= 0"),
    ("--max-new-tokens", "0", "--max-new-tokens: must be >= 1"),
    ("--max-new-tokens", "ten", "--max-new-tokens: expected a whole number"),
    ("--num-draft-tokens", "0", "--num-draft-tokens: must be >= 1"),
    ("--device", "toaster", "device 'toaster' is not usable"),
    ("--dtype", "int8", "invalid choice"),
])
def test_bad_option_values(capfd, option, value, fragment):
    result = generate(capfd, "--target", STORIES, "--prompt", PROMPT, option, value)
    assert_one_line_error(*result, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device(capfd):
    result = generate(capfd, "--target", STORIES, "--prompt", PROMPT, "--device", "cuda")
    assert_one_line_error(*result, "device 'cuda' is not usable")


def test_sps_without_draft(capfd):
    assert_one_line_error(*generate(capfd, "--target", STORIES, "--method", "sps", "--prompt", PROMPT), "--draft")


def test_unknown_method(capfd):
    result = generate(capfd, "--target", STORIES, "--method", "medusa9000", "--prompt", PROMPT)
    assert_one_line_error(*result, "invalid choice: 'medusa9000'")


@pytest.mark.parametrize("args", [
    [],
    ["generate"],
    ["generate", "--prompt", PROMPT, "--prompt-file", "p.txt"],
    ["generate", "--prompt", PROMPT, "--no-such-flag"],
    ["fly", "--prompt", PROMPT],
])
def test_usage_errors_are_one_line(capfd, args):
    assert_one_line_error(*run(capfd, *args), "")


def test_real_process_exit_status_and_no_traceback(not_a_model):
    proc = subprocess.run([sys.executable, "-m", "specula", "generate", "--target", str(not_a_model),
                           "--prompt", PROMPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [f"specula: error: target directory {not_a_model} has no config.json "
                                        "(not a Hugging Face model directory)"]


def test_a_real_generate_process_prints_its_whole_answer_into_a_pipe_and_exits_0():
    """`specula generate` ends without the interpreter's teardown (`specula.cli.run`): what it printed into a pipe
    must all arrive, the answer on stdout and the statistics line on stderr, with exit status 0."""
    command = [sys.executable, "-m", "specula", "generate", "--target", str(STORIES), "--method", "pld",
               "--prompt", "Once upon a time", "--max-new-tokens", "12", "--no-profile"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    expected = specula.load(STORIES, method="pld", profile=False)
    ids = expected.encode("Once upon a time")
    answer = expected.tokenizer.decode(expected.generate(ids, max_new_tokens=12).token_ids)
    assert proc.stdout.strip() == answer.strip()
    assert proc.stderr.strip().splitlines()[-1].startswith("[pld] ")


def test_ctrl_c_exits_130_quietly(capfd, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(specula.cli.generate, "build_speculator", interrupted)
    assert run(capfd, "generate", "--target", STORIES, "--prompt", PROMPT) == (130, "", "")


def test_help_exits_0(capfd):
    code, out, err = run(capfd, "generate", "--help")
    assert code == 0 and "--num-draft-tokens" in out and err == ""


def test_target_defaults_to_the_bundled_model():
    assert build_parser().parse_args(["generate", "--prompt", PROMPT]).target == DEFAULT_TARGET


def test_method_defaults_to_the_fastest_measured_one():
    for argv in (["generate", "--prompt", PROMPT], ["chat"], ["serve"]):
        assert build_parser().parse_args(argv).method == "suffix"  # docs/defaults.md: measured fastest


# ---------------------------------------------------------------- happy paths


METHOD_ARGS = {
    "vanilla": [],
    "pld": [],
    "sps": ["--draft", str(LLAMA2XS), "--num-draft-tokens", str(SPS_DRAFT_TOKENS)],
}


@pytest.fixture(scope="module")
def json_runs() -> dict[str, dict]:
    """One greedy --json run per method (module-scoped: each generation costs about a second)."""
    runs = {}
    for method, extra in METHOD_ARGS.items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["generate", "--target", str(STORIES), "--method", method, "--prompt", PROMPT,
                         "--max-new-tokens", str(NEW_TOKENS), "--json", *extra])
        assert code == 0, err.getvalue()
        assert len(out.getvalue().splitlines()) == 1  # exactly one JSON object
        runs[method] = json.loads(out.getvalue())
    return runs


@pytest.mark.parametrize("method", list(METHOD_ARGS))
def test_json_output(json_runs, method):
    report = json_runs[method]
    for key in ("text", "token_ids", "new_tokens", "cycles", "tau", "tokens_per_s", "method", "stop_reason",
                "accepted_lengths", "draft_time", "verify_time"):
        assert key in report
    assert report["method"] == method
    assert report["new_tokens"] == len(report["token_ids"])
    if report["stop_reason"] == "eos":
        assert report["new_tokens"] <= NEW_TOKENS
    else:
        assert report["stop_reason"] == "max_new_tokens" and report["new_tokens"] == NEW_TOKENS
    assert report["tau"] >= 1.0
    assert report["tau"] == pytest.approx(report["new_tokens"] / report["cycles"], abs=1e-3)
    assert report["text"].strip()


def test_num_draft_tokens_reaches_the_drafter(json_runs):
    assert max(json_runs["sps"]["tree_sizes"]) == SPS_DRAFT_TOKENS


def test_greedy_output_is_identical_across_methods(json_runs):
    ids = {method: report["token_ids"] for method, report in json_runs.items()}
    assert ids["pld"] == ids["vanilla"]
    assert ids["sps"] == ids["vanilla"]
    assert json_runs["sps"]["tau"] > 1.0  # the same-tokenizer draft actually got tokens accepted


def test_plain_text_streams_the_same_text(capfd, tmp_path, json_runs):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT)  # no trailing newline: the file is the prompt verbatim
    code, out, err = generate(capfd, "--target", STORIES, "--prompt-file", prompt_file, "--method", "vanilla",
                              "--max-new-tokens", NEW_TOKENS)
    assert code == 0
    assert out == json_runs["vanilla"]["text"] + "\n"
    summary = err.splitlines()
    assert len(summary) == 1
    assert summary[0].startswith(f"[vanilla] {json_runs['vanilla']['new_tokens']} new tokens in ")
    assert "tau 1.00" in summary[0]
    prompt_tokens = json_runs["vanilla"]["prompt_tokens"]
    assert re.search(r"[0-9.]+ tokens/s \((eos|max_new_tokens)\); "
                     rf"prompt {prompt_tokens} tokens in [0-9.]+ s, then [0-9.]+ tokens/s$", summary[0])


def test_typical_acceptance_is_opt_in_labelled_lossy_and_warned(capfd):
    common = ["generate", "--target", str(STORIES), "--method", "pld", "--prompt", PROMPT, "--max-new-tokens", "8",
              "--json", "--seed", "1"]
    code, out, err = run(capfd, *common, "--temperature", "0.8")
    assert code == 0 and json.loads(out)["lossless"] is True and json.loads(out)["acceptance"] == "lossless"
    assert "lossy" not in err
    code, out, err = run(capfd, *common, "--temperature", "0.8", "--acceptance", "typical", "--typical-alpha", "0.2")
    report = json.loads(out)
    assert code == 0 and report["acceptance"] == "typical" and report["lossless"] is False
    assert "warning: --acceptance typical is lossy" in err
    code, out, _ = run(capfd, *common, "--acceptance", "typical")  # at T=0 it is greedy matching: exact
    assert code == 0 and json.loads(out)["lossless"] is True
    code, out, err = run(capfd, *common, "--typical-alpha", "0.2")
    assert code == 2 and out == "" and err.startswith("specula: error:") and "--acceptance typical" in err
    # The paper's symbols spell the same options; a bad ε is one error line, not a traceback.
    code, out, err = run(capfd, *common, "--temperature", "0.8", "--acceptance", "typical", "--typical-epsilon", "2")
    assert_one_line_error(code, out, err, "threshold must be in (0, 1]")
    code, out, _ = run(capfd, *common, "--temperature", "0.8", "--acceptance", "typical", "--typical-delta", "0.2")
    assert code == 0 and json.loads(out)["token_ids"] == report["token_ids"]  # same seed and δ as above


def test_generate_takes_the_hardware_profile_unless_told_not_to(capfd, tmp_path, monkeypatch):
    from specula.runtime.profile import save_profile

    monkeypatch.setenv("SPECULA_CACHE_DIR", str(tmp_path))
    save_profile({"target": "stories260k", "device": "cpu", "methods": {"pld": {"defaults": {"num_tokens": 1}}}},
                 tmp_path / "profile-stories260k.json")
    # A repetitive prompt: prompt lookup finds matches and drafts as many tokens as it may.
    common = ["generate", "--target", str(STORIES), "--method", "pld", "--max-new-tokens", "24", "--json",
              "--prompt", "Once upon a time. Once upon a time. Once upon a time. Once upon"]
    code, out, _ = run(capfd, *common)
    assert code == 0 and max(json.loads(out)["tree_sizes"]) == 1  # the profile's num_tokens
    code, out, _ = run(capfd, *common, "--num-draft-tokens", "3")
    assert code == 0 and max(json.loads(out)["tree_sizes"]) == 3  # explicit beats the profile
    code, out, _ = run(capfd, *common, "--no-profile")
    assert code == 0 and max(json.loads(out)["tree_sizes"]) > 3  # the method's own default


def test_decoding_commands_default_to_one_thread_on_a_machine_of_two_cpus_and_let_steps_time_two():
    """On 2 CPUs one torch thread is the base (docs/defaults.md, "Threads"); where the user gave no --threads a decode
    step may run on two (`specula.runtime.decode_threads`), where the user gave one it may not."""
    from specula.cli.common import command_threads
    from specula.openmp import auto_threads, default_threads

    assert default_threads(1) == default_threads(2) == 1
    assert default_threads(16) is None  # torch's own choice
    before = torch.get_num_threads()
    for command in (["generate", "--prompt", "hi"], ["chat"], ["check", "--method", "pld"], ["serve"]):
        for given, chosen_by_specula in (([], True), (["--threads", "1"], False)):
            with command_threads(build_parser().parse_args(command + given)):
                assert auto_threads() is chosen_by_specula, command + given
                assert torch.get_num_threads() == (default_threads() or before)
        assert not auto_threads() and torch.get_num_threads() == before


@pytest.mark.parametrize("threads", ["auto", 3, None])
def test_load_sets_the_process_threads_as_the_command_line_does(threads, monkeypatch):
    """`specula.load` is for a program of the user's: "auto" gives it the command line's thread rule, an int that
    many threads, None leaves torch's setting."""
    from specula.openmp import default_threads

    before = torch.get_num_threads()
    untouched = 5 if before != 5 else 6
    torch.set_num_threads(untouched)
    try:
        specula.load(STORIES, method="vanilla", dtype="float32", threads=threads)
        expected = {"auto": default_threads() or untouched, 3: 3, None: untouched}[threads]
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "two"])
def test_load_refuses_a_thread_count_that_is_not_one_or_more_before_loading(threads, monkeypatch):
    monkeypatch.setattr(specula.methods, "build_speculator", lambda *a, **k: pytest.fail("loaded anyway"))
    with pytest.raises(specula.SpeculaError, match="threads must be"):
        specula.load(STORIES, threads=threads)


def test_generate_runs_on_the_threads_asked_and_gives_the_setting_back(monkeypatch):
    from specula.errors import SpeculaError

    seen = []

    def stop(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise SpeculaError("stopped before loading")

    monkeypatch.setattr(specula.cli.generate, "build_speculator", stop)
    before = torch.get_num_threads()
    target = 2 if before == 1 else 1
    assert main(["generate", "--prompt", "hi", "--threads", str(target)]) == 2
    assert seen == [target] and torch.get_num_threads() == before
    assert main(["generate", "--prompt", "hi", "--threads", "0"]) == 2  # refused by argparse
    assert seen == [target]
