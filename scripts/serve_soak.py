"""A soak test of `specula serve`: many clients for many minutes, normal, hostile and cancelled requests mixed.

Starts `specula serve` on a free 127.0.0.1 port (as `serve_load.py` does), then ``--clients`` threads send
requests until ``--minutes`` have passed. Each client cycles through three kinds:
- normal: a streamed chat completion through the official `openai` client; it must finish with tokens;
- hostile: a request the server must refuse with a 4xx, never a 5xx (malformed JSON, an unknown role, a
  prompt far longer than the context, a bad sampling value, an empty message list, a body that stops short of
  its Content-Length and stalls: a 408 after the server's body timeout);
- cancelled: a streamed completion the client closes after its first chunk.
Every 5 s it samples the server's resident memory. It prints, and writes to ``--out`` as JSON, the count
of each kind, the failures (a normal request without tokens, any 5xx, a hostile request not refused, a
transport error), p50/p95 latency of normal requests, and RSS at the start, the end and its growth.
Not part of the test suite (it runs for minutes):

    .venv/bin/python scripts/serve_soak.py --minutes 30 --clients 16 --weights q4_1 --out runs/soak.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from openai import OpenAI
from serve_load import QUESTIONS, free_port, one_request, percentile, start_server, wait_healthy

HOSTILE = (
    ("malformed JSON", b'{"model": "x", "messages": [', "application/json"),
    ("unknown role", {"messages": [{"role": "bogus", "content": "hi"}], "max_tokens": 4}, None),
    ("prompt beyond the context", {"messages": [{"role": "user", "content": "word " * 200_000}], "max_tokens": 4},
     None),
    ("bad temperature", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, None),
    ("no messages", {"messages": [], "max_tokens": 4}, None),
    ("body shorter than its Content-Length", b'{"model": "x", "messages": [{"role": "user"', "slow"),
)


def hostile_request(http: httpx.Client, port: int, index: int, model: str) -> dict:
    """One request the server must refuse: {"ok": a 4xx came back, "status", "what"}."""
    what, body, content_type = HOSTILE[index % len(HOSTILE)]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        if content_type == "slow":
            return {**stalled_body(port, body), "what": what}
        if isinstance(body, bytes):
            response = http.post(url, content=body, headers={"content-type": content_type})
        else:
            response = http.post(url, json={"model": model, **body})
        return {"ok": 400 <= response.status_code < 500, "status": response.status_code, "what": what}
    except httpx.HTTPError as err:
        return {"ok": False, "status": None, "what": what, "error": f"{type(err).__name__}: {err}"[:200]}


def stalled_body(port: int, part: bytes, promised: int = 4096) -> dict:
    """A client that promises ``promised`` body bytes, sends ``part`` and waits: the server must answer 408 once
    its body timeout (30 s by default) passes, without a worker or the model waiting on it meanwhile."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {promised}\r\nconnection: close\r\n\r\n").encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as connection:
            connection.sendall(head + part)
            reply = connection.recv(64).decode("latin-1")
        status = int(reply.split()[1]) if reply.startswith("HTTP/") else None
        return {"ok": status is not None and 400 <= status < 500, "status": status}
    except (OSError, ValueError, IndexError) as err:
        return {"ok": False, "status": None, "error": f"{type(err).__name__}: {err}"[:200]}


def cancelled_request(client: OpenAI, model: str, prompt: str) -> dict:
    """A streamed completion closed after its first chunk: ok unless the server failed before that chunk."""
    try:
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=64, stream=True)
        next(iter(stream))
        stream.close()
        return {"ok": True}
    except Exception as err:  # counted and reported, never a crash of the soak
        return {"ok": False, "error": f"{type(err).__name__}: {err}"[:200]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--method", default="eagle3")
    p.add_argument("--weights", default="auto")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--serve-option", action="append", default=[], metavar="ARG",
                   help="an extra argument for specula serve (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, help="write the summary here as JSON")
    args = p.parse_args()
    if args.minutes <= 0 or args.clients < 1:
        p.error("--minutes must be > 0 and --clients >= 1")
    prompts = [json.loads(line)["turns"][0] for line in QUESTIONS.read_text().splitlines() if line.strip()]
    port = free_port()
    server = start_server(args.method, args.weights, port, args.serve_option)
    try:
        wait_healthy(port, server, args.ready_timeout)
        model = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none").models.list().data[0].id
        memory = psutil.Process(server.pid)
        rss: list[tuple[float, float]] = []
        results: dict[str, list[dict]] = {"normal": [], "hostile": [], "cancelled": []}
        lock, start = threading.Lock(), time.monotonic()
        deadline = start + 60 * args.minutes
        counter = itertools.count()

        def client_loop(number: int) -> None:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)
            with httpx.Client(timeout=120) as http:
                for turn in itertools.count():
                    if time.monotonic() >= deadline:
                        return
                    index = next(counter)
                    kind = ("normal", "normal", "hostile", "cancelled")[(number + turn) % 4]
                    prompt = prompts[index % len(prompts)]
                    if kind == "normal":
                        found = one_request(client, model, prompt, args.max_tokens)
                    elif kind == "hostile":
                        found = hostile_request(http, port, index, model)
                    else:
                        found = cancelled_request(client, model, prompt)
                    with lock:
                        results[kind].append(found)

        threads = [threading.Thread(target=client_loop, args=(n,), daemon=True) for n in range(args.clients)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            rss.append((time.monotonic() - start, memory.memory_info().rss / 2**20))
            time.sleep(5)
        rss.append((time.monotonic() - start, memory.memory_info().rss / 2**20))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except Exception:  # a server that does not drain is killed; the summary says how it ended
            server.kill()
    latencies = [r["latency_s"] for r in results["normal"] if r["ok"]]
    failures = [{"kind": kind, **r} for kind, found in results.items() for r in found if not r["ok"]]
    summary = {
        "minutes": args.minutes, "clients": args.clients, "method": args.method, "weights": args.weights,
        "requests": {kind: len(found) for kind, found in results.items()},
        "failures": len(failures), "failure_examples": failures[:10],
        "hostile_statuses": sorted({r["status"] for r in results["hostile"] if r.get("status")}),
        "latency_p50_s": percentile(latencies, 0.5), "latency_p95_s": percentile(latencies, 0.95),
        "rss_start_mib": rss[0][1], "rss_end_mib": rss[-1][1], "rss_max_mib": max(m for _, m in rss),
        "rss_growth": rss[-1][1] / rss[0][1] - 1,
        # after the first minute: the caches and slots a full batch allocates once are in place
        "rss_growth_after_first_minute": rss[-1][1] / next((m for t, m in rss if t >= 60), rss[-1][1]) - 1,
        "server_exit": server.returncode,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**summary, "rss": rss}, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
