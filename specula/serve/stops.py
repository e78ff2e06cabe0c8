"""Stop strings over streamed text: cut at the first occurrence, never emitting part of one.

Text arrives in pieces, and a stop string can straddle two of them, so the end of
the text that could still grow into a stop string is held back until the next
piece decides it (as the OpenAI API does: the returned text excludes the stop string).
"""

from __future__ import annotations


class StopMatcher:
    """``push(piece) -> (text to emit, stopped)``; ``flush()`` returns what was held back once the text ends."""

    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, piece: str) -> tuple[str, bool]:
        text = self.pending + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:  # no stop string lies in emitted text (see below), so the first hit here is the first overall
            self.pending = ""
            return text[:min(hits)], True
        # Hold back the longest end of the text that is the start of a stop string: a stop string that
        # begins inside emitted text would have had to end in such a held-back suffix.
        hold = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])),
                   default=0)
        self.pending = text[len(text) - hold:]
        return text[:len(text) - hold], False

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest
