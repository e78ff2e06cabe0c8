"""`specula chat`'s conversation loop: read a message, stream the answer, keep the history.

A plain function over text streams, so a pipe, a terminal and a test drive it alike.
"""

from __future__ import annotations

import sys
from typing import TextIO

from specula.api import Speculator
from specula.chat.template import has_chat_template
from specula.decoding import GenerationStats
from specula.errors import SpeculaError

EXIT_COMMANDS = ("/exit", "/bye")
CLEAR_COMMAND = "/clear"


def run_chat(speculator: Speculator, input_stream: TextIO | None = None, output_stream: TextIO | None = None,
             system: str | None = None, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | None = None, error_stream: TextIO | None = None) -> int:
    """Read user messages line by line, stream each answer, keep the conversation; returns 0 at /exit or EOF.

    After each answer one line gives tokens/s and τ (dim on a terminal). ``/clear``
    forgets the conversation. A turn that fails (e.g. too long for the context)
    prints one error line and the conversation goes on without it.
    """
    reader = input_stream or sys.stdin
    out = output_stream or sys.stdout
    err = error_stream or sys.stderr
    if not has_chat_template(speculator.tokenizer):
        raise SpeculaError(f"{speculator.target.name} has no chat template; use `specula generate` for plain text")
    interactive, dim = _isatty(reader), _isatty(out)
    start = [{"role": "system", "content": system}] if system is not None else []
    history = list(start)
    if interactive:
        out.write(_dim(f"chatting with {speculator.target.name} ({speculator.method}); "
                       f"{CLEAR_COMMAND} forgets the conversation, {EXIT_COMMANDS[0]} or Ctrl-D ends it", dim) + "\n")
    while True:
        try:
            line = _read_line(reader, out, interactive)
        except UnicodeDecodeError as error:  # a strictly decoded stream (`specula chat` reads with surrogateescape)
            print(f"specula: error: the message is not valid UTF-8 text ({error.reason})", file=err)
            continue
        if line is None or line.strip() in EXIT_COMMANDS:
            return 0
        message = line.strip()
        if not message:
            continue
        if message == CLEAR_COMMAND:
            history = list(start)
            continue
        history.append({"role": "user", "content": message})
        stats, ids = GenerationStats(), []
        try:
            # Encoding is part of the turn: a message the template or tokenizer refuses (not UTF-8, too long for
            # the context) is one error line, and the conversation goes on without it.
            _fit_context(speculator, history, max_new_tokens)
            for chunk in speculator.stream(messages=history, max_new_tokens=max_new_tokens, temperature=temperature,
                                           top_p=top_p, top_k=top_k, seed=seed, stats=stats):
                ids.extend(chunk.token_ids)
                out.write(chunk.text)
                out.flush()
        except SpeculaError as error:
            history.pop()
            print(f"specula: error: {' '.join(str(error).split())}", file=err)
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the chat
            if not interactive:
                raise
            stats.stop_reason = "interrupted"
        history.append({"role": "assistant", "content": speculator.tokenizer.decode(ids, skip_special_tokens=True)})
        out.write("\n" + _dim(f"{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, "
                              f"τ {stats.tau:.2f} ({speculator.method}, {stats.stop_reason})", dim) + "\n")
        out.flush()


def _fit_context(speculator: Speculator, history: list[dict], max_new_tokens: int) -> None:
    """Drop the oldest exchanges (never the system message or the newest message) until the answer fits."""
    first = 1 if history[0]["role"] == "system" else 0
    while len(history) - first > 1:
        needed = len(speculator.encode(messages=history)) + max_new_tokens
        if needed <= speculator.target.max_length:
            return
        del history[first:first + 2]


def _read_line(reader: TextIO, out: TextIO, interactive: bool) -> str | None:
    """One line of input, or None at end of input (Ctrl-D, or Ctrl-C at the prompt)."""
    try:
        if interactive and reader is sys.stdin and out is sys.stdout:
            return input(">>> ")  # readline editing and history
        if interactive:
            out.write(">>> ")
            out.flush()
        line = reader.readline()
        return line if line else None
    except (EOFError, KeyboardInterrupt):
        if interactive:
            out.write("\n")
        return None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _dim(text: str, enabled: bool) -> str:
    return f"\033[2m{text}\033[0m" if enabled else text
