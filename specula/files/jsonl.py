"""Reading JSONL files line by line with errors that name the line, for every loader in the package."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator

from specula.errors import SpeculaError


def json_lines(lines: Iterable[str], describe: Callable[[int], str]) -> Iterator[tuple[int, str, object]]:
    """(line number, ``describe(number)``, parsed value) for every non-blank line; bad JSON raises SpeculaError."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = describe(number)
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise SpeculaError(f"{where}: not valid JSON ({err.msg})") from err
        yield number, where, value
