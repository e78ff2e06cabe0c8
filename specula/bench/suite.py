"""`specula bench`: methods side by side on question sets, measured fairly, written to --out.

Fairness: one process and one target load for every method; a warm-up
generation per method first; the thread count fixed and recorded; for each
temperature, questions in order and, for each question, every method in turn
(A B C A B C ...) so that machine drift hits them alike; wall time around
whole generations only.

Each (question, method, temperature) record is appended to ``results.json``
as soon as it is done; rerunning the same command resumes, skipping finished
records. Record fields: question, dataset, category, subcategory, method,
temperature, seed, turns (per turn: prompt_tokens, cut_tokens, token_ids,
new_tokens, wall_time, cycles, draft/verify/prefill time, accepted_lengths,
stop_reason), and totals new_tokens, wall_time, tokens_per_s, cycles, tau,
draft_time, verify_time, depth_tried, depth_accepted (per cycle, n-α),
node_depth_tried, node_depth_accepted (per tested draft node), calibration,
rss_mb, cuda_peak_mb, repetition; at T=0 for methods other than the baseline, divergence (None when
equal to the baseline, else where and why it differs: `specula.bench.divergences`). Records written
before a field existed lack it and count as "no data" for it, so older results.json files still resume.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

import specula
from specula.bench.config import MethodSpec
from specula.bench.divergences import annotate_divergences
from specula.bench.llamacpp import LlamaCppRunner, server_table, summarize_turns
from specula.bench.metrics import add_counts, aggregate, merge_calibration, repetition
from specula.bench.questions import Question
from specula.bench.report import write_report
from specula.bench.runners import make_runner, max_rss_mb, rss_mb
from specula.chat.template import conversation_ids
from specula.decoding import warm_up
from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_text
from specula.gguf.cache import file_sha256
from specula.methods import METHODS, default_draft
from specula.runtime.compiled_step import WARM_UP_BLOCK
from specula.runtime.heap import long_lived_objects_frozen
from specula.runtime.target import Target
from specula.runtime.weights import resolve_weights
from specula.sampling import SamplingParams

RESULTS_VERSION = 1
# Settings that must match for a resumed run to be comparable with what is already in results.json.
RESUME_KEYS = ("target", "dtype", "weights", "compile", "device", "threads", "max_new_tokens", "max_prompt_tokens",
               "seed", "top_k", "top_p")


@dataclass
class BenchSettings:
    target: str
    methods: list[MethodSpec]
    data: list[str]
    questions: list[Question]
    out: Path
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    max_new_tokens: int = 128
    seed: int = 0
    dtype: str = "auto"
    weights: str = "auto"  # the target's linear weights (`specula.runtime.weights`), for every method alike
    compile: bool = False  # the target's steps through torch.compile (`Target.compile`), for our methods alike
    device: str = "cpu"
    threads: int | None = None
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_tokens: int | None = None
    warmup_tokens: int = 16
    categories: list[str] | None = None
    limit: int | None = None
    profile: dict | None = None
    progress: bool = True
    command: str = ""
    llama_server: str | None = None  # the llama-server binary of llama.cpp rows


def question_seed(seed: int, uid: str, turn: int, temperature: float) -> int:
    """A seed per (question, turn, temperature), the same in every run and for every method."""
    return (seed * 1_000_003 + zlib.crc32(f"{uid}#{turn}#{temperature:g}".encode())) % 2**31


def results_path(out: Path) -> Path:
    return Path(out) / "results.json"


def read_results(out: Path) -> dict | None:
    path = results_path(out)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeculaError(f"cannot resume from {path}: {err} (move it away to start over)") from err
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise SpeculaError(f"cannot resume from {path}: it has no 'records' list (move it away to start over)")
    if not all(isinstance(r, dict) for r in data["records"]) or not isinstance(data.get("settings", {}), dict):
        raise SpeculaError(f"cannot resume from {path}: its records or settings are not JSON objects "
                           "(move it away to start over)")
    for index, record in enumerate(data["records"]):
        problem = record_problem(record)
        if problem:
            raise SpeculaError(f"cannot resume from {path}: record {index} is not a bench record ({problem}); "
                               "move it away to start over")
    return data


# What a resumed record must hold for the report to be computed from it (`run_question` writes these and more).
RECORD_FIELDS = {"question": str, "method": str, "temperature": (int, float), "turns": list,
                 "new_tokens": int, "wall_time": (int, float), "tokens_per_s": (int, float)}


def record_problem(record: dict) -> str | None:
    """Why ``record`` cannot be one `run_question` wrote (a missing or mistyped field), or None."""
    for key, kind in RECORD_FIELDS.items():
        value = record.get(key)
        if value is None:
            return f"no '{key}'"
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"'{key}' is {type(value).__name__}"
    for turn in record["turns"]:
        if not isinstance(turn, dict) or not isinstance(turn.get("token_ids"), list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in turn["token_ids"]):
            return "a turn without a list of token ids"
    return None


def dumps_results(data: dict) -> str:
    """JSON with one record per line (token ids included), everything else indented."""
    parts = []
    for key, value in data.items():
        if key == "records":
            body = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in value)
            parts.append(f'"records": [\n{body}\n ]' if value else '"records": []')
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value, indent=1)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


def write_json(path: Path, data: dict) -> None:
    """Write atomically, so an interrupted run never leaves a truncated results.json."""
    atomic_write_text(path, dumps_results(data))


def record_key(record: dict) -> tuple[str, str, float]:
    return record["question"], record["method"], float(record["temperature"])


def draft_digest(spec: MethodSpec, target: str | Path) -> str | None:
    """SHA-256 over the files of the draft ``spec`` runs with (a bundled head when it names none), or None.

    Part of a method's settings, so that a head retrained in place (same path, new weights) is not taken
    for the one an earlier run in this output directory measured: resuming is then refused.
    """
    draft = spec.draft
    if draft is None and spec.method in METHODS and METHODS[spec.method].draft:  # not transformers/llama.cpp rows
        draft = default_draft(target, spec.method)
    if draft is None or not Path(draft).exists():
        return None
    path = Path(draft)
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}:{file_sha256(file)};".encode())
    return digest.hexdigest()


def check_resumable(previous: dict, settings: dict) -> None:
    """Refuse to mix records measured under other settings or other method options into one report."""
    if not previous.get("records"):
        return  # nothing measured yet: nothing to mix with
    before = previous.get("settings", {})
    for key in RESUME_KEYS:
        if key in before and before[key] != settings[key]:
            raise SpeculaError(f"results.json in the output directory was measured with {key}={before[key]!r}, "
                               f"this run has {key}={settings[key]!r}; use another --out to compare")
    for label, spec in settings["methods"].items():
        old = before.get("methods", {}).get(label)
        if old is not None and old != spec:
            raise SpeculaError(f"method '{label}' had other options in the earlier run ({json.dumps(old)}); "
                               "give this configuration another label or use another --out")


def environment(settings: BenchSettings, target) -> dict:
    import transformers

    return {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "specula": specula.__version__, "machine": platform.machine(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "profile": settings.profile.get("path") if settings.profile else None,
    }


def _turn_dict(prompt_len: int, cut: int, result) -> dict:
    return {
        "prompt_tokens": prompt_len, "cut_tokens": cut, "token_ids": result.token_ids,
        "new_tokens": len(result.token_ids), "wall_time": result.wall_time, "cycles": result.cycles,
        "draft_time": result.draft_time, "verify_time": result.verify_time, "prefill_time": result.prefill_time,
        "accepted_lengths": result.accepted_lengths, "stop_reason": result.stop_reason, **result.extra,
    }


def run_question(runner, spec: MethodSpec, question: Question, tokenizer, temperature: float,
                 settings: BenchSettings, max_prompt_tokens: int) -> dict:
    """Every turn of one question with one method; the model's own answers go back into the context."""
    params = SamplingParams(temperature, settings.top_k, settings.top_p)
    answers: list[str] = []
    turns, results = [], []
    for i in range(len(question.turns)):
        ids, cut = conversation_ids(tokenizer, list(question.turns[: i + 1]), answers, max_prompt_tokens)
        result = runner.run(ids, settings.max_new_tokens, params, question_seed(settings.seed, question.uid, i,
                                                                                temperature))
        answers.append(tokenizer.decode(result.token_ids, skip_special_tokens=True))
        turns.append(_turn_dict(len(ids), cut, result))
        results.append(result)
    new_tokens = sum(t["new_tokens"] for t in turns)
    wall = sum(t["wall_time"] for t in turns)
    known_cycles = all(r.cycles is not None for r in results)
    cycles = sum(r.cycles for r in results) if known_cycles else None
    timed = all(r.draft_time is not None for r in results)
    depths = [r for r in results if r.depth_tried is not None]
    tried, hits, node_tried, node_hits = [], [], [], []
    for r in depths:
        tried, hits = add_counts(tried, r.depth_tried), add_counts(hits, r.depth_accepted)
        node_tried = add_counts(node_tried, r.node_depth_tried or [])
        node_hits = add_counts(node_hits, r.node_depth_accepted or [])
    peaks = [r.cuda_peak_mb for r in results if r.cuda_peak_mb is not None]
    server = summarize_turns(turns)  # llama.cpp rows: its own decode rate, client wall time, draft counters
    return {
        "question": question.uid, "dataset": question.dataset, "category": question.category,
        "subcategory": question.subcategory, "method": spec.label, "temperature": temperature,
        "seed": settings.seed, "turns": turns, "new_tokens": new_tokens, "wall_time": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else 0.0, "cycles": cycles,
        "tau": new_tokens / cycles if cycles else None,
        "draft_time": sum(r.draft_time for r in results) if timed else None,
        "verify_time": sum(r.verify_time for r in results) if timed else None,
        "depth_tried": tried if depths else None, "depth_accepted": hits if depths else None,
        "node_depth_tried": node_tried if depths else None, "node_depth_accepted": node_hits if depths else None,
        "calibration": merge_calibration(r.calibration for r in results),
        "rss_mb": rss_mb(), "cuda_peak_mb": max(peaks) if peaks else None,
        "repetition": repetition([t for turn in turns for t in turn["token_ids"]]),
    } | ({"llamacpp": server} if server else {})


def run_bench(settings: BenchSettings) -> dict:
    """Run (or resume) the benchmark; writes results.json, results.md and the plots; returns the results.

    Runners that hold a resource (llama.cpp's server) are closed on the way out, on errors and Ctrl-C too.
    """
    with contextlib.ExitStack() as resources:
        return _run_bench(settings, resources)


def _run_bench(settings: BenchSettings, resources: contextlib.ExitStack) -> dict:
    from tqdm import tqdm

    out = Path(settings.out)
    if out.exists() and not out.is_dir():
        raise SpeculaError(f"--out {out} is a file, not a directory")
    if out.is_dir() and ((out / "config.json").exists() or any(out.glob("*.safetensors"))):
        raise SpeculaError(f"--out {out} holds a model or draft head; bench writes only its own results")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    threads = torch.get_num_threads()
    previous = read_results(out) if out.is_dir() else None

    rss_before = rss_mb()
    # auto: the format calibration chose in the profile this run uses (none with --no-profile: float32).
    weights = resolve_weights(settings.weights, settings.profile, settings.device)
    target = Target.load(settings.target, dtype=settings.dtype, device=settings.device, weights=weights)
    if settings.compile:
        target.compile()
    target_rss = rss_mb() - rss_before
    dtype_name = str(target.dtype).removeprefix("torch.")
    runners, load_rss = {}, {}
    for spec in settings.methods:
        before = rss_mb()
        if spec.is_llamacpp:
            runners[spec.label] = LlamaCppRunner(spec, target, settings.llama_server, settings.target, threads)
            resources.callback(runners[spec.label].close)
        else:
            runners[spec.label] = make_runner(spec, target, settings.dtype)
        load_rss[spec.label] = round(rss_mb() - before, 1)
    # Every method sees the same prompts, so they must fit the smallest context of all models in the run.
    context, smallest = target.max_length, target.name
    for runner in runners.values():
        draft = runner.draft_model
        if draft is not None and draft.max_length < context:
            context, smallest = draft.max_length, f"{draft.name} (draft of {runner.spec.label})"
    max_prompt_tokens = settings.max_prompt_tokens or context - settings.max_new_tokens - 1
    if max_prompt_tokens < 1 or max_prompt_tokens + settings.max_new_tokens > context - 1:
        raise SpeculaError(f"prompts of up to {max_prompt_tokens} tokens plus max_new_tokens "
                           f"{settings.max_new_tokens} do not fit the {context}-token context of {smallest}")
    run_settings = {
        "target": target.name, "target_path": str(settings.target),
        "dtype": dtype_name, "weights": target.weights, "compile": settings.compile, "device": str(target.device),
        "threads": threads,
        "max_new_tokens": settings.max_new_tokens, "max_prompt_tokens": max_prompt_tokens, "seed": settings.seed,
        "top_k": settings.top_k, "top_p": settings.top_p, "temperatures": settings.temperatures,
        "data": settings.data, "categories": settings.categories, "limit": settings.limit,
        "methods": {spec.label: {**spec.as_dict(), "draft_sha256": draft_digest(spec, settings.target)}
                    for spec in settings.methods},
    }
    # Created only now that every method has been built: a rejected option or model leaves nothing behind.
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpeculaError(f"cannot create output directory {out}: {err}") from err
    records: list[dict] = []
    if previous is not None:
        check_resumable(previous, run_settings)
        records = list(previous["records"])
        methods_before = previous.get("settings", {}).get("methods", {})
        run_settings["methods"] = {**methods_before, **run_settings["methods"]}
    done = {record_key(r) for r in records}
    work = [(t, q, spec) for t in settings.temperatures for q in settings.questions for spec in settings.methods
            if (q.uid, spec.label, float(t)) not in done]

    if work:
        if target.compiled:  # no timed question may pay for compiling a block size (~2 min each, cold)
            for spec in settings.methods:
                drafter = getattr(runners[spec.label], "drafter", None)
                if drafter is not None:
                    if settings.progress:
                        print(f"compiling the steps of {spec.label} (target blocks of up to "
                              f"{WARM_UP_BLOCK} tokens)", file=sys.stderr, flush=True)
                    warm_up(target, drafter, WARM_UP_BLOCK)
        # Warm-up: one short generation per method and temperature (not recorded).
        first = settings.questions[0]
        ids, _ = conversation_ids(target.tokenizer, [first.turns[0]], [], max_prompt_tokens)
        for t in settings.temperatures:
            for spec in settings.methods:
                runners[spec.label].run(ids, min(settings.warmup_tokens, settings.max_new_tokens),
                                        SamplingParams(t, settings.top_k, settings.top_p), settings.seed)

    results = {"version": RESULTS_VERSION, "command": settings.command, "settings": run_settings,
               "environment": environment(settings, target), "target_load_rss_mb": round(target_rss, 1),
               "method_load_rss_mb": {**(previous or {}).get("method_load_rss_mb", {}), **load_rss},
               "records": records}
    servers = {label: f"{r.binary} ({r.version})" for label, r in runners.items() if hasattr(r, "version")}
    if servers:
        results["environment"]["llama_server"] = servers
    path = results_path(out)
    bar = tqdm(total=len(work), desc="bench", unit="run", disable=not settings.progress, file=sys.stderr,
               dynamic_ncols=True)
    try:
        with long_lived_objects_frozen():  # no timed question pays for collecting the startup's objects
            for temperature, question, spec in work:
                bar.set_postfix_str(f"T={temperature:g} {spec.label} {question.uid}", refresh=False)
                record = run_question(runners[spec.label], spec, question, target.tokenizer, temperature, settings,
                                      max_prompt_tokens)
                records.append(record)
                results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                write_json(path, results)
                bar.update(1)
    finally:
        bar.close()
    labels = list(run_settings["methods"])
    hf_labels = [label for label, spec in run_settings["methods"].items() if spec["method"].startswith("hf")]
    results["peak_rss_mb"] = round(max_rss_mb(), 1)
    baseline = _baseline_label(run_settings["methods"])
    annotate_divergences(records, target, {q.uid: q for q in settings.questions}, baseline, max_prompt_tokens)
    results["aggregates"] = aggregate(records, labels, baseline=baseline, hf_methods=hf_labels)
    llamacpp = server_table(records)
    if llamacpp:
        results["llamacpp"] = llamacpp
    write_json(path, results)
    write_report(results, out)
    return results


def _baseline_label(methods: dict[str, dict]) -> str:
    """The label speedups are measured against: 'vanilla' if present, else the first method running vanilla."""
    if "vanilla" in methods:
        return "vanilla"
    return next((label for label, spec in methods.items() if spec["method"] == "vanilla"), "vanilla")
