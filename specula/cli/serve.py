"""`specula serve`: an OpenAI-compatible HTTP server (chat completions, completions, models, health, metrics)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from specula.cli.common import (
    PROG,
    add_method_arguments,
    add_model_arguments,
    method_options,
    number_in,
    positive_int,
)
from specula.decoding import warm_up
from specula.draft_budget import DEFAULT_MAX_BATCH, parse_budget_table
from specula.errors import SpeculaError
from specula.methods import DEFAULT_TARGET, build_speculator
from specula.runtime.compiled_step import WARM_UP_BLOCK
from specula.runtime.heap import long_lived_objects_frozen
from specula.runtime.profile import load_profile
from specula.serve import BODY_TIMEOUT_S

API_KEY_ENV = "SPECULA_API_KEY"


port_number = number_in(int, 0, 65535, "a port number")
body_seconds = number_in(float, 1.0, 3600.0, "a number of seconds")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI API (chat completions, completions)",
                              description="Serve one target and decoding method over an OpenAI-compatible HTTP API: "
                                          "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics. "
                                          "Up to --max-batch requests decode together (one target forward per "
                                          "cycle for all of them); the rest wait in a queue.")
    add_model_arguments(p, DEFAULT_TARGET)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=port_number, default=8000, help="(default: %(default)s)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 requests (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                   help="requests that may wait for the decoder; more get HTTP 429 (default: %(default)s)")
    p.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH, metavar="N",
                   help="requests decoded together; more wait in the queue (default: %(default)s)")
    p.add_argument("--draft-budget", type=budget_table, metavar="B:D,...",
                   help="deepest draft per sequence by batch size, e.g. 1:8,4:2,8:0 (default: chosen from the "
                        "measured verify cost and the acceptance seen on served requests)")
    p.add_argument("--max-tokens-limit", type=positive_int, metavar="N",
                   help="largest max_tokens a request may ask for (default: the model's context)")
    p.add_argument("--body-timeout", type=body_seconds, default=BODY_TIMEOUT_S, metavar="SECONDS",
                   help="a request body must arrive whole within this; a slower one gets HTTP 408 "
                        "(default: %(default)s)")
    p.add_argument("--model-name", metavar="NAME", help="the model id clients send (default: the target's name)")
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info",
                   help="uvicorn's log level (default: %(default)s)")
    add_method_arguments(p)
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    if args.api_key is not None and not args.api_key.strip():
        raise SpeculaError("--api-key must not be empty")
    if args.model_name is not None and not args.model_name.strip():
        raise SpeculaError("--model-name must not be empty")
    try:  # the server's libraries load only for this command
        from specula.serve import ServeSettings, bind_socket, create_app, serve
    except ImportError as err:
        raise SpeculaError(f"specula serve needs fastapi, uvicorn and prometheus-client ({err}); "
                           "pip install fastapi uvicorn prometheus-client") from err
    if args.api_key is None and not is_loopback(args.host):
        print(f"{PROG}: warning: listening on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    if args.compile and args.max_batch != 1:
        raise SpeculaError("--compile decodes one sequence at a time (batched steps run eager): add --max-batch 1")
    sock = bind_socket(args.host, args.port)  # a port in use is refused before minutes of loading
    try:
        speculator = build_speculator(args.target, method=args.method, draft=args.draft, dtype=args.dtype,
                                      device=args.device, profile=not args.no_profile, weights=args.weights,
                                      compile=args.compile, **method_options(args))
        if speculator.target.compiled:  # before serving: no request should wait for a compilation
            print(f"{PROG}: compiling the target's steps (blocks of up to {WARM_UP_BLOCK} tokens; about a minute "
                  "the first time on a small CPU)", file=sys.stderr, flush=True)
            warm_up(speculator.target, speculator.drafter, WARM_UP_BLOCK)
        settings = ServeSettings(model_name=args.model_name, api_key=args.api_key, max_queue=args.max_queue,
                                 max_tokens_limit=args.max_tokens_limit, max_batch=args.max_batch,
                                 draft_budget=args.draft_budget, body_timeout_s=args.body_timeout,
                                 verify_curve=None if args.no_profile else profile_curve(speculator.target))
        with long_lived_objects_frozen():  # no request pays for collecting the startup's objects
            serve(create_app(speculator, settings), host=args.host, port=args.port, log_level=args.log_level,
                  sock=sock)
    finally:  # also when loading fails: main() may run inside a larger program
        sock.close()
    return 0


def budget_table(text: str) -> dict[int, int]:
    try:
        return parse_budget_table(text)
    except SpeculaError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def profile_curve(target) -> dict[int, float] | None:
    """The verify-cost curve `specula calibrate` measured for this target, if it was measured eager (as packed
    batches run) with the weight format now loaded (else the server measures its own when it starts)."""
    measured = load_profile(target.name)
    if (not measured or measured.get("weights") != target.weights or measured.get("compile")
            or not measured.get("verify_cost_s")):
        return None
    return {int(n): float(t) for n, t in measured["verify_cost_s"].items()}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
