"""llama.cpp rows of `specula bench`: what is asked of llama-server, how its answers are read, its lifecycle.

Most tests run without llama.cpp: the request and the answer are pure functions, and the server's
lifecycle is exercised against a fake ``llama-server`` (a small Python HTTP server written below,
answering /health and /completion and echoing what it was asked). One test runs the real binary
on stories260k, and is skipped only where no llama-server binary can be found.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import LLAMA2XS, STORIES

from specula import openmp
from specula.bench import llama_server
from specula.bench.config import MethodSpec, method_specs
from specula.bench.llama_server import LlamaServer, find_llama_server
from specula.bench.llamacpp import (
    LlamaCppRunner,
    completion_request,
    parse_completion,
    server_args,
    server_table,
    summarize_turns,
)
from specula.bench.report import markdown
from specula.cli import build_parser
from specula.errors import SpeculaError
from specula.sampling import SamplingParams

HEAD = Path(__file__).resolve().parent / "data" / "eagle3-stories260k"  # our EAGLE-3 head for stories260k

# ---------------------------------------------------------------- a fake llama-server

FAKE_SERVER = '''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
if "--version" in argv:
    print("version: 9.9.9-fake (build 1, commit fake)")
    sys.exit(0)
if os.environ.get("FAKE_LLAMA_MODE") == "crash":
    print("error: failed to load model 'nowhere.gguf'", flush=True)
    sys.exit(1)
if os.environ.get("FAKE_LLAMA_MODE") == "illegal-instruction":
    import signal
    print("llama threadpool init, n_threads = 2", flush=True)
    os.kill(os.getpid(), signal.SIGILL)
port = int(argv[argv.index("--port") + 1])

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.reply({"status": "ok"})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        # the prompt's last id + 1, + 2, ...; the end-of-text id 2 once the prompt ends in 7
        n = request["n_predict"]
        tokens = [request["prompt"][-1] + i + 1 for i in range(n)]
        stop = "limit"
        if request["prompt"][-1] == 7:
            tokens, stop = tokens[:2] + [2], "eos"
        timings = {"prompt_n": len(request["prompt"]), "prompt_ms": 10.0, "predicted_n": len(tokens),
                   "predicted_ms": 40.0 * len(tokens), "predicted_per_second": 25.0}
        if "-md" in argv:
            timings.update(draft_n=len(tokens), draft_n_accepted=len(tokens) // 2)
        self.reply({"content": "", "tokens": tokens, "stop_type": stop, "timings": timings,
                    "request": request, "argv": argv, "spin_count": os.environ.get("GOMP_SPINCOUNT")})

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def fake_binary(tmp_path) -> Path:
    path = tmp_path / "bin" / "llama-server"
    path.parent.mkdir()
    path.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    path.chmod(0o755)
    return path


@pytest.fixture
def started(monkeypatch) -> list:
    """Every process the llama-server module starts, to check that none outlives its user."""
    processes = []
    real = subprocess.Popen

    def recording(*args, **kwargs):
        processes.append(real(*args, **kwargs))
        return processes[-1]

    monkeypatch.setattr(llama_server.subprocess, "Popen", recording)
    return processes


# ---------------------------------------------------------------- the request


def test_greedy_request_sends_our_token_ids_and_asks_for_the_argmax_with_nothing_cached():
    body = completion_request([1, 5, 9], 64, SamplingParams(0.0), seed=3)
    assert body["prompt"] == [1, 5, 9] and body["n_predict"] == 64
    assert body["temperature"] == 0.0  # llama.cpp's temperature sampler keeps only the argmax at <= 0
    assert body["samplers"] == ["temperature", "top_k", "top_p"]
    assert body["cache_prompt"] is False and body["return_tokens"] is True and body["stream"] is False
    assert body["min_p"] == 0.0 and body["repeat_penalty"] == 1.0 and body["dry_multiplier"] == 0.0
    json.dumps(body)  # what goes over the wire


def test_sampling_request_carries_our_temperature_top_k_top_p_and_seed():
    body = completion_request([1], 8, SamplingParams(0.7, top_k=20, top_p=0.9), seed=11)
    assert (body["temperature"], body["top_k"], body["top_p"], body["seed"]) == (0.7, 20, 0.9, 11)


# ---------------------------------------------------------------- the answer


def answer(tokens, stop_type="limit", **timings):
    base = {"prompt_n": 4, "prompt_ms": 20.0, "predicted_n": len(tokens), "predicted_ms": 80.0,
            "predicted_per_second": 1000.0 * len(tokens) / 80.0}
    return {"tokens": tokens, "stop_type": stop_type, "timings": {**base, **timings}}


def test_answer_gives_token_ids_llama_cpp_time_and_stop_reason():
    result = parse_completion(answer([5, 6, 7, 8]), eos_ids={2}, client_wall=0.125)
    assert result.token_ids == [5, 6, 7, 8]
    assert result.wall_time == pytest.approx(0.1)  # llama.cpp's prefill + decode, not the HTTP round trip
    assert result.stop_reason == "max_new_tokens" and result.cycles == 4
    kept = result.extra["llamacpp"]
    assert kept["client_wall_time"] == 0.125 and kept["predicted_n"] == 4 and kept["predicted_ms"] == 80.0
    assert parse_completion(answer([5, 2], "eos"), {2}, 0.1).stop_reason == "eos"


def test_draft_counters_give_cycles():
    result = parse_completion(answer(list(range(10, 20)), draft_n=12, draft_n_accepted=6), {2}, 0.1)
    assert result.cycles == 10 - 6  # each cycle adds one target token to its accepted drafts


@pytest.mark.parametrize("broken, fragment", [
    ({"content": "hi", "timings": {"prompt_ms": 1, "predicted_ms": 1}}, "no token ids"),
    ({"tokens": [1, 2], "stop_type": "limit"}, "no timings"),
])
def test_answers_without_tokens_or_timings_are_refused(broken, fragment):
    with pytest.raises(SpeculaError, match=fragment):
        parse_completion(broken, {2}, 0.1)


def test_record_and_report_show_llama_cpp_own_rates():
    turns = [{"llamacpp": {"predicted_n": 10, "predicted_ms": 100.0, "prompt_ms": 5.0, "client_wall_time": 0.2,
                           "draft_n": 8, "draft_n_accepted": 6}},
             {"llamacpp": {"predicted_n": 30, "predicted_ms": 300.0, "prompt_ms": 5.0, "client_wall_time": 0.4,
                           "draft_n": 12, "draft_n_accepted": 4}}]
    summary = summarize_turns(turns)
    assert summary["decode_tokens_per_s"] == pytest.approx(100.0) and summary["draft_n_accepted"] == 10
    assert summarize_turns([{"token_ids": [1]}]) is None  # our rows have no llama.cpp numbers
    records = [{"question": "q", "method": "llamacpp", "temperature": 0.0, "new_tokens": 40, "llamacpp": summary},
               {"question": "q", "method": "vanilla", "temperature": 0.0, "new_tokens": 40}]
    table = server_table(records)
    row = table["0"]["llamacpp"]
    assert set(table["0"]) == {"llamacpp"}
    assert row["decode_tokens_per_s"] == pytest.approx(100.0)
    assert row["client_tokens_per_s"] == pytest.approx(40 / 0.6) and row["draft_acceptance"] == pytest.approx(0.5)
    results = {"settings": {"target": "t", "dtype": "float32", "device": "cpu", "threads": 1, "max_new_tokens": 4,
                            "top_k": 0, "top_p": 1.0, "seed": 0, "data": ["d"], "methods": {}},
               "records": [], "aggregates": {"0": {}}, "llamacpp": table}
    assert "| llamacpp | 1 | 100.0 | 66.7 | 20 | 50% |" in markdown(results)


# ---------------------------------------------------------------- options and the command line


def test_llamacpp_rows_are_methods_with_checked_options(tmp_path):
    specs = method_specs(["vanilla", "llamacpp", "ours-draft"], {"ours-draft": {
        "method": "llamacpp-draft", "draft": str(LLAMA2XS), "draft_max": 4, "spec_type": "draft-simple"}})
    assert [s.is_llamacpp for s in specs] == [False, True, True]
    assert specs[2].options == {"draft_max": 4, "spec_type": "draft-simple"}


@pytest.mark.parametrize("tables, fragment", [
    ({"llamacpp": {"draft_max": 3}}, "does not take option"),
    ({"llamacpp": {"draft": "x.gguf"}}, "takes no draft"),
    ({"llamacpp-draft": {}}, "needs a draft"),
    ({"llamacpp-draft": {"draft": "d.gguf", "draft_max": 0}}, "draft_max must be a whole number >= 1"),
    ({"llamacpp-draft": {"draft": "d.gguf", "draft_p_min": 2}}, r"draft_p_min must be a number in \[0, 1\]"),
    ({"llamacpp-draft": {"draft": "d.gguf", "spec_type": "ngram-mod"}}, "spec_type must be one of"),
])
def test_bad_llamacpp_options_are_refused(tables, fragment):
    with pytest.raises(SpeculaError, match=fragment):
        method_specs(list(tables), tables)


def test_server_arguments_pin_threads_context_one_slot_and_no_cache():
    args = server_args(Path("t.gguf"), threads=2, context=512)

    def value(flag):
        return args[args.index(flag) + 1]

    assert value("-m") == "t.gguf" and value("-t") == value("-tb") == "2" and value("-c") == "512"
    assert value("-np") == "1" and value("--cache-ram") == "0" and "--no-cache-prompt" in args
    assert "-md" not in args
    args = server_args(Path("t.gguf"), 2, 512, Path("d.gguf"), {"draft_max": 5, "spec_type": "draft-eagle3"})
    text = " ".join(args)
    assert "-md d.gguf" in text and "--spec-type draft-eagle3" in text and "--spec-draft-n-max 5" in text
    assert "-td 2" in text


def test_binary_comes_from_the_flag_then_the_environment_then_path(tmp_path, fake_binary, monkeypatch):
    for name in llama_server.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SpeculaError, match="llama-server was not found: pass --llama-server PATH"):
        find_llama_server()
    assert find_llama_server(fake_binary) == fake_binary.resolve()
    assert find_llama_server(fake_binary.parent) == fake_binary.resolve()  # a folder holding it
    with pytest.raises(SpeculaError, match="--llama-server .*nowhere: no executable llama-server"):
        find_llama_server(tmp_path / "nowhere")
    monkeypatch.setenv("SPECULA_LLAMA_SERVER", str(fake_binary))
    assert find_llama_server() == fake_binary.resolve()
    monkeypatch.setenv("SPECULA_LLAMA_SERVER", str(tmp_path / "gone"))
    with pytest.raises(SpeculaError, match=r"\$SPECULA_LLAMA_SERVER .*gone"):
        find_llama_server()  # a named binary that is missing is an error, not a silent fallback
    monkeypatch.delenv("SPECULA_LLAMA_SERVER")
    monkeypatch.setenv("PATH", str(fake_binary.parent))
    assert find_llama_server() == fake_binary.resolve()


def run_command(*argv) -> int:
    args = build_parser().parse_args([str(a) for a in argv])
    return args.handler(args)


def test_bench_with_only_llamacpp_rows_and_no_binary_fails_before_loading_anything(tmp_path, monkeypatch):
    for name in llama_server.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "a", "category": "c", "prompt": "Once upon a time"}) + "\n")
    out = tmp_path / "out"
    with pytest.raises(SpeculaError, match="llama-server was not found"):
        run_command("bench", "--target", STORIES, "--methods", "llamacpp", "--data", questions,
                    "--out", out, "--no-profile")
    assert not out.exists()


def test_bench_skips_llamacpp_rows_with_one_line_when_no_binary_is_installed(tmp_path, monkeypatch, capsys):
    from specula.cli.bench import bench_settings

    for name in llama_server.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "a", "category": "c", "prompt": "Once upon a time"}) + "\n")
    args = build_parser().parse_args(["bench", "--target", str(STORIES), "--methods", "vanilla,llamacpp",
                                      "--data", str(questions), "--out", str(tmp_path / "out"), "--no-profile"])
    settings = bench_settings(args)
    assert [spec.label for spec in settings.methods] == ["vanilla"]
    printed = capsys.readouterr().err.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("specula: skipping llamacpp: ")


def test_bench_with_a_named_binary_that_is_missing_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_LLAMA_SERVER", str(tmp_path / "nowhere" / "llama-server"))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "a", "category": "c", "prompt": "Once upon a time"}) + "\n")
    with pytest.raises(SpeculaError, match="no executable llama-server there"):
        run_command("bench", "--target", STORIES, "--methods", "vanilla,llamacpp", "--data", questions,
                    "--out", tmp_path / "out", "--no-profile")


def test_config_names_the_binary_and_the_command_records_it(tmp_path, fake_binary):
    from specula.cli.bench import bench_settings

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "a", "category": "c", "prompt": "Once upon a time"}) + "\n")
    config = tmp_path / "bench.toml"
    config.write_text(f'[bench]\nllama_server = "{fake_binary}"\nmethods = ["vanilla", "llamacpp"]\n')
    args = build_parser().parse_args(["bench", "--config", str(config), "--target", str(STORIES), "--data",
                                      str(questions), "--out", str(tmp_path / "out"), "--no-profile"])
    settings = bench_settings(args)
    assert settings.llama_server == str(fake_binary.resolve())
    assert f"--llama-server {fake_binary.resolve()}" in settings.command


# ---------------------------------------------------------------- the server's lifecycle (fake binary)


def test_server_starts_on_a_free_port_answers_and_is_stopped(fake_binary, started):
    with LlamaServer(fake_binary, ["-m", "model.gguf", "-t", "1"]) as server:
        reply = server.post("/completion", {"prompt": [1, 3], "n_predict": 2})
        assert reply["tokens"] == [4, 5]
        assert reply["argv"][-4:] == ["--host", "127.0.0.1", "--port", str(server.port)]
    assert len(started) == 1 and started[0].poll() is not None


@pytest.mark.parametrize("ours, user, seen", [(True, None, None), (False, "1000", "1000"),
                                               (False, "300000", "300000")])
def test_server_waits_as_its_user_chose_not_as_specula_does(fake_binary, started, monkeypatch, ours, user, seen):
    # A policy of Specula's own (set when the user chose none) is not llama.cpp's: the former passive one cost it
    # 2/3 of its speed.
    monkeypatch.setattr(openmp, "set_by_specula", ours)
    monkeypatch.setenv("GOMP_SPINCOUNT", str(openmp.SPIN_COUNT) if ours else user)
    with LlamaServer(fake_binary, []) as server:
        assert server.post("/completion", {"prompt": [1], "n_predict": 1})["spin_count"] == seen


def test_server_is_stopped_when_its_user_is_interrupted(fake_binary, started):
    with pytest.raises(KeyboardInterrupt), LlamaServer(fake_binary, []):
        raise KeyboardInterrupt
    assert started and all(p.poll() is not None for p in started)


def test_a_server_that_dies_at_start_is_one_error_quoting_its_output(fake_binary, started, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash")
    with pytest.raises(SpeculaError, match="llama-server did not start .*: it exited with status 1; its last "
                                           "output: error: failed to load model 'nowhere.gguf'"):
        with LlamaServer(fake_binary, ["-m", "nowhere.gguf"]):
            pass
    assert len(started) == 1  # no retry: only a lost race for the port is retried


def test_a_server_killed_by_an_illegal_instruction_says_so_and_how_to_build_one_that_runs(fake_binary, started,
                                                                                          monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_MODE", "illegal-instruction")
    with pytest.raises(SpeculaError, match="it was killed by SIGILL .*README's llama.cpp section.*threadpool init"):
        with LlamaServer(fake_binary, ["-m", "model.gguf"]):
            pass


def test_runner_sends_each_turn_and_reads_the_answer(fake_binary, started, tmp_path):
    target = SimpleNamespace(eos_token_ids={2}, max_length=512)
    spec = MethodSpec("llamacpp", "llamacpp")
    runner = LlamaCppRunner(spec, target, str(fake_binary), str(STORIES), threads=1)  # stories260k -> F32 GGUF
    try:
        assert runner.version.startswith("version: 9.9.9-fake")
        result = runner.run([1, 40, 41], 3, SamplingParams(0.0), seed=0)
        assert result.token_ids == [42, 43, 44] and result.stop_reason == "max_new_tokens"
        assert result.wall_time == pytest.approx((10.0 + 120.0) / 1000)
        result = runner.run([1, 7], 5, SamplingParams(0.0), seed=0)
        assert result.token_ids == [8, 9, 2] and result.stop_reason == "eos"
    finally:
        runner.close()
    assert started[-1].poll() is not None


def test_bench_stops_its_servers_when_interrupted(fake_binary, started, tmp_path, monkeypatch):
    from specula.bench import suite

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "run_question", interrupted)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": "a", "category": "c", "prompt": "Once upon a time"}) + "\n")
    with pytest.raises(KeyboardInterrupt):
        run_command("bench", "--target", STORIES, "--methods", "llamacpp", "--data", questions, "--threads", 1,
                    "--max-new-tokens", 4, "--out", tmp_path / "out", "--no-profile", "--no-progress",
                    "--llama-server", fake_binary)
    servers = [p for p in started if "--port" in p.args]
    assert servers and all(p.poll() is not None for p in servers)


# ---------------------------------------------------------------- the real llama-server on stories260k


def _real_binary() -> Path | None:
    try:
        return find_llama_server()
    except SpeculaError:
        return None


REAL = _real_binary()


@pytest.mark.skipif(REAL is None, reason="llama.cpp's llama-server is not installed (set SPECULA_LLAMA_SERVER="
                                         "/path/to/llama-server, or put it on PATH, to run this test)")
def test_real_llama_server_rows_on_stories260k(tmp_path, started):
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in [
        {"question_id": "lily", "category": "story", "turns": ["Once upon a time", "Then"]},
        {"question_id": "tom", "category": "story", "prompt": "Tom and his dog went to the park"}]))
    out = tmp_path / "out"
    assert run_command("bench", "--target", STORIES, "--methods", "vanilla,llamacpp,llamacpp-draft,eagle3-head",
                       "--option", f"llamacpp-draft.draft={LLAMA2XS}", "--option", "llamacpp-draft.draft_max=3",
                       "--option", "eagle3-head.method=llamacpp-draft", "--option", f"eagle3-head.draft={HEAD}",
                       "--option", "eagle3-head.spec_type=draft-eagle3",
                       "--data", questions, "--temperature", "0,1", "--max-new-tokens", 24, "--threads", 1,
                       "--dtype", "float32", "--out", out, "--no-profile", "--no-progress",
                       "--llama-server", REAL) == 0
    results = json.loads((out / "results.json").read_text())
    greedy = results["aggregates"]["0"]
    for label in ("llamacpp", "llamacpp-draft", "eagle3-head"):
        # the same F32 weights in llama.cpp: equal to our vanilla, or different only at floating-point near-ties
        assert (greedy[label]["overall"]["greedy_divergences"] or {"real": 0})["real"] == 0, label
    assert greedy["llamacpp"]["overall"]["tau"] == 1.0
    assert greedy["llamacpp-draft"]["overall"]["tau"] > 1.0  # llama2xs drafts tokens stories260k accepts
    assert greedy["eagle3-head"]["overall"]["tau"] > 1.0  # our head, exported to GGUF, drafts in llama.cpp
    for record in results["records"]:
        if record["method"].startswith("llamacpp"):
            assert record["llamacpp"]["predicted_n"] == record["new_tokens"] > 0
    assert "llama.cpp's own timings" in (out / "results.md").read_text()
    servers = [p for p in started if "--port" in p.args]
    assert len(servers) == 3 and all(p.poll() is not None for p in servers)
