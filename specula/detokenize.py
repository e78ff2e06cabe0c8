"""Incremental detokenization: the text each new chunk of tokens adds, in time linear in the answer.

Decoding the whole answer again on every chunk costs O(n²) over an answer of n
tokens. Instead (as vLLM and `transformers`' TextStreamer do) only a short
window is decoded: the tokens since ``prefix`` — the start of the last emitted
piece, kept so that tokenizers which change a token's text by what precedes it
(SentencePiece's leading spaces) see that context — with and without the new
tokens. Text ending in U+FFFD is an incomplete multi-byte character and is held
back until the tokens that complete it arrive. `finish` emits whatever is left so
that the pieces always add up to ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations


class IncrementalDecoder:
    """Turns token-id chunks into text deltas. ``push(ids) -> str``; ``finish() -> str`` at the end."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the window decoded for context
        self.read = 0  # tokens whose text has been emitted
        self.emitted = 0  # characters emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        delta = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.emitted += len(delta)
        return delta

    def finish(self) -> str:
        """The rest of the text (held-back characters); one full decode, once per answer."""
        full = self._decode(self.ids)
        rest = full[self.emitted:]
        self.emitted = len(full)
        return rest
