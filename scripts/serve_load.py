"""A bounded load test of `specula serve`: throughput and latency against 1, 2, 4, 8, 16 concurrent clients.

For each method it starts `specula serve` on a free 127.0.0.1 port (never another host), waits for
/health, and at each concurrency C runs C client threads that each send ``--requests`` streamed chat
completions (MT-bench first turns, in turn) through the official `openai` client, then stops the server
with SIGTERM. Every request is bounded (``--max-tokens``) and so is the whole run. Per concurrency it
reports: requests, failures, the server's total completion tokens/s over the wall time of that level,
time to first token (first streamed content) and whole-request latency, p50 and p95.

With ``--rounds R`` (R > 1) every method's server starts first (idle servers take memory, no CPU) and each
round runs every level of every method in turn: on a machine whose speed drifts by 10–25 % between
minutes, the ratio of two methods measured side by side in a round is what holds; results.md adds the
medians over rounds and the median per-round ratio to the first method.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/serve_load.py --methods vanilla,pld --weights q4_1 \\
        --out docs/benchmarks/serve-smollm2
    .venv/bin/python scripts/serve_load.py --methods vanilla,suffix,plain=suffix \\
        --label-option=plain:--suffix-answers=none --rounds 2 --out runs/serve-answers   # two configurations

Writes ``results.json`` and ``results.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUESTIONS = REPO.parent / "shared" / "data" / "mt_bench" / "question.jsonl"
QUESTION_WARM_UP = "Say hello."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(method: str, weights: str, port: int, extra: list[str]) -> subprocess.Popen:
    command = [str(REPO / ".venv" / "bin" / "specula"), "serve", "--method", method, "--weights", weights,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra]
    environment = {k: v for k, v in os.environ.items() if k != "SPECULA_API_KEY"}  # the clients send no key
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sys.stderr, env=environment)


def wait_healthy(port: int, process: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"specula serve exited with status {process.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"specula serve was not ready after {timeout:.0f} s")


def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion: {ok, ttft_s, latency_s, tokens} (tokens from the usage chunk)."""
    start = time.perf_counter()
    first, tokens = None, 0
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0.0, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        if not tokens:  # every completion here has tokens, and its usage chunk says how many
            return {"ok": False, "error": "no usage chunk or no tokens", "latency_s": time.perf_counter() - start,
                    "tokens": 0}
        return {"ok": True, "ttft_s": first, "latency_s": time.perf_counter() - start, "tokens": tokens}
    except Exception as err:  # a failure is a result here, counted and reported, never a crash of the test
        return {"ok": False, "error": f"{type(err).__name__}: {err}"[:200],
                "latency_s": time.perf_counter() - start, "tokens": 0}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_level(port: int, prompts: list[str], concurrency: int, requests: int, max_tokens: int) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id  # the name the server answers to
    lock, counter = threading.Lock(), [0]

    def worker(_: int) -> list[dict]:
        results = []
        for _ in range(requests):
            with lock:
                prompt = prompts[counter[0] % len(prompts)]
                counter[0] += 1
            results.append(one_request(client, model, prompt, max_tokens))
        return results

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        records = [r for batch in pool.map(worker, range(concurrency)) for r in batch]
    wall = time.perf_counter() - start
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    latency = [r["latency_s"] for r in ok]
    return {"concurrency": concurrency, "requests": len(records), "failures": len(records) - len(ok),
            "tokens": sum(r["tokens"] for r in ok), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
            "latency_p50_s": percentile(latency, 0.5), "latency_p95_s": percentile(latency, 0.95),
            "errors": sorted({r["error"] for r in records if not r["ok"]})[:5]}


def table(results: dict) -> str:
    lines = ["| method | clients | requests | failures | tokens/s (server total) | TTFT p50 / p95 | "
             "latency p50 / p95 |", "|---|---|---|---|---|---|---|"]

    def s(value):
        return "–" if value is None else f"{value:.2f} s"

    for method, levels in results["methods"].items():
        for row in levels:
            label = method if "round" not in row else f"{method} (round {row['round'] + 1})"
            lines.append(f"| {label} | {row['concurrency']} | {row['requests']} | {row['failures']} | "
                         f"{row['tokens_per_s']:.1f} | {s(row['ttft_p50_s'])} / {s(row['ttft_p95_s'])} | "
                         f"{s(row['latency_p50_s'])} / {s(row['latency_p95_s'])} |")
    return "\n".join(lines)


def rounds_table(results: dict) -> str:
    """Medians over rounds per method and level, and each method's rate over the first method's in the same
    round and level (median of those ratios): the comparison a noisy machine leaves most intact."""
    lines = ["| method | clients | rounds | requests | failures | tokens/s median (min–max) | vs "
             f"{next(iter(results['methods']))} (median of per-round ratios) |", "|---|---|---|---|---|---|---|"]
    base = {(r["concurrency"], r["round"]): r["tokens_per_s"] for r in next(iter(results["methods"].values()))}
    for method, rows in results["methods"].items():
        for concurrency in dict.fromkeys(r["concurrency"] for r in rows):
            level = [r for r in rows if r["concurrency"] == concurrency]
            rates = [r["tokens_per_s"] for r in level]
            ratios = [r["tokens_per_s"] / base[concurrency, r["round"]] for r in level
                      if base.get((concurrency, r["round"]))]
            ratio = f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else "–"
            lines.append(f"| {method} | {concurrency} | {len(level)} | {sum(r['requests'] for r in level)} | "
                         f"{sum(r['failures'] for r in level)} | {statistics.median(rates):.1f} "
                         f"({min(rates):.1f}–{max(rates):.1f}) | {ratio} |")
    return "\n".join(lines)


def write_results(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    rounds = any("round" in r for rows in results["methods"].values() for r in rows)
    summary = f"{rounds_table(results)}\n\nEvery round:\n\n" if rounds else ""
    (out / "results.md").write_text(f"# specula serve under load\n\nCommand: `{results['command']}`\n\n"
                                    f"{summary}{table(results)}\n", encoding="utf-8")


@contextlib.contextmanager
def served(methods: list[str], args) -> Iterator[dict[str, int]]:
    """Servers for ``methods`` on free localhost ports, ready and warmed up: {method: port}; SIGTERM at exit."""
    servers: dict[str, tuple[int, subprocess.Popen]] = {}
    try:
        for label in methods:
            method, extra = args.labels.get(label, (label, []))
            port = free_port()
            servers[label] = port, start_server(method, args.weights, port, [*args.serve_option, *extra])
        for port, server in servers.values():
            wait_healthy(port, server, args.ready_timeout)
            run_level(port, [QUESTION_WARM_UP], 1, 1, 8)  # warm-up, not recorded
        yield {method: port for method, (port, _) in servers.items()}
    finally:
        for _, server in servers.values():
            server.send_signal(signal.SIGTERM)
        for _, server in servers.values():
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()


def measure(results: dict, method: str, port: int, prompts: list[str], concurrency: int, args,
            round_: int | None) -> None:
    """One level against one server, recorded (and written at once: a later failure keeps what was measured)."""
    row = run_level(port, prompts, concurrency, args.requests, args.max_tokens)
    if round_ is not None:
        row["round"] = round_
    results["methods"].setdefault(method, []).append(row)
    where = "" if round_ is None else f" (round {round_ + 1})"
    print(f"{method} x{concurrency}{where}: {row['tokens_per_s']:.1f} tokens/s, {row['failures']} failures",
          file=sys.stderr, flush=True)
    write_results(args.out, results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="vanilla,pld")
    p.add_argument("--weights", default="auto")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--requests", type=int, default=2, help="requests per client at each level (default: 2)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--serve-option", action="append", default=[], metavar="ARG",
                   help="extra argument for specula serve, e.g. --serve-option=--compile (repeatable)")
    p.add_argument("--label-option", action="append", default=[], metavar="LABEL:ARG",
                   help="extra argument for one --methods entry written LABEL=METHOD (a second configuration of a "
                        "method), e.g. --methods suffix,plain=suffix --label-option=plain:--suffix-answers=none")
    p.add_argument("--rounds", type=int, default=1,
                   help="with more than 1, every method's server starts first and each round runs every level "
                        "of every method in turn, so a slow spell of the machine hits all methods alike; the "
                        "table shows medians over rounds (default: 1, one method after another)")
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds to wait for /health")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text(encoding="utf-8").splitlines()]
    results = {"command": " ".join(sys.argv), "weights": args.weights, "max_tokens": args.max_tokens,
               "requests_per_client": args.requests, "serve_options": args.serve_option,
               "threads": os.environ.get("OMP_NUM_THREADS"), "methods": {}}
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    args.labels = {}  # label -> (method, its extra arguments)
    methods = []
    for entry in args.methods.split(","):
        label, _, method = entry.partition("=")
        methods.append(label)
        if method:
            args.labels[label] = method, []
    for option in args.label_option:
        label, _, argument = option.partition(":")
        if label not in args.labels or not argument:
            raise SystemExit(f"--label-option takes LABEL:ARG for a --methods entry LABEL=METHOD, got {option!r}")
        args.labels[label][1].append(argument)
    if args.rounds == 1:
        for method in methods:
            with served([method], args) as ports:
                for concurrency in levels:
                    measure(results, method, ports[method], prompts, concurrency, args, None)
    else:
        with served(methods, args) as ports:
            for round_ in range(args.rounds):
                for concurrency in levels:
                    for method in methods:
                        measure(results, method, ports[method], prompts, concurrency, args, round_)
    write_results(args.out, results)
    print((args.out / "results.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
