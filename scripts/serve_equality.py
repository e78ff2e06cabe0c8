"""Greedy answers through `specula serve` at several client counts against single-stream answers (issue 39).

For each method it starts `specula serve` (as `serve_load.py` does), sends the first turns of MT-bench
(``--questions``, greedy, ``--max-tokens``) at each concurrency in ``--concurrency`` (that many clients at once,
so that the server packs their sequences into shared steps), and compares every answer, token for token through
its text, with the same method's answer at one client and with vanilla's at one client. A lossless, row-invariant
server gives the same text whatever shares its steps. Not part of the test suite (it runs for minutes):

    .venv/bin/python scripts/serve_equality.py --methods vanilla,pld,eagle3 --weights q4_1 --out runs/serve-eq.json
    .venv/bin/python scripts/serve_equality.py --methods vanilla,sps --weights q4_1 \
        --serve-option sps:--draft=SmolLM2-135M-Instruct --serve-option sps:--draft-weights=int4
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI
from serve_load import QUESTIONS, free_port, start_server, wait_healthy


def answers(port: int, model: str, prompts: list[str], clients: int, max_tokens: int) -> list[str]:
    """Every prompt's greedy answer, ``clients`` requests at a time."""
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)

    def ask(prompt: str) -> str:
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0.0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(ask, prompts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="vanilla,pld,eagle3", help="comma-separated; vanilla is the reference")
    p.add_argument("--weights", default="auto")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, help="write the table here as JSON")
    p.add_argument("--serve-option", action="append", default=[], metavar="METHOD:ARG",
                   help="extra argument for that method's server, e.g. sps:--draft=SmolLM2-135M-Instruct (repeatable)")
    args = p.parse_args()
    extra: dict[str, list[str]] = {}
    for option in args.serve_option:
        method, _, argument = option.partition(":")
        if not argument:
            p.error(f"--serve-option takes METHOD:ARG, got {option!r}")
        extra.setdefault(method, []).append(argument)
    methods = args.methods.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    if "vanilla" not in methods or 1 not in levels:
        p.error("--methods must include vanilla and --concurrency 1: they are the references")
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    prompts = [row["turns"][0] for row in rows[:args.questions]]
    texts: dict[str, dict[int, list[str]]] = {}
    for method in ["vanilla"] + [m for m in methods if m != "vanilla"]:
        port = free_port()
        server = start_server(method, args.weights, port, extra.get(method, []))
        try:
            wait_healthy(port, server, args.ready_timeout)
            model = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none").models.list().data[0].id
            texts[method] = {c: answers(port, model, prompts, c, args.max_tokens) for c in levels}
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    reference = texts["vanilla"][1]
    table = {method: {c: {"same_as_one_client": sum(a == b for a, b in zip(by_level[c], by_level[1], strict=True)),
                          "same_as_vanilla": sum(a == b for a, b in zip(by_level[c], reference, strict=True))}
                      for c in levels}
             for method, by_level in texts.items()}
    print(f"{len(prompts)} MT-bench first turns, greedy, {args.max_tokens} tokens, --weights {args.weights}")
    print("method    clients  same as 1 client  same as vanilla (1 client)")
    for method, by_level in table.items():
        for c, counts in by_level.items():
            print(f"{method:9} {c:7}  {counts['same_as_one_client']:>7}/{len(prompts)}        "
                  f"{counts['same_as_vanilla']:>7}/{len(prompts)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"questions": len(prompts), "max_tokens": args.max_tokens,
                                        "weights": args.weights, "table": table, "texts": texts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
