"""Prompts in the server's threads: a tokenizer per thread, and the fewest tokens a text can make.

Both keep one request from stalling the others: no lock is held while a prompt is tokenized, and a text too long
for the context is refused from its byte length before the tokenizer runs (`specula.serve.app.check_bytes_fit`).
"""

from __future__ import annotations

import copy
import threading


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes the text of one vocabulary entry takes: no token stands for more input bytes.

    Byte-level BPE spells each byte as one character of 1-2 UTF-8 bytes, SentencePiece a space as "▁" (3 bytes) and
    a byte-fallback token as "<0xNN>" (6), so a token's stored text is never shorter than the input it covers
    (a normalizer that deleted input characters would break this; those of causal LMs' tokenizers do not).
    """
    return max((len(token.encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab()), default=1) or 1


def fewest_tokens(texts: list[str], token_bytes: int) -> tuple[int, int]:
    """(UTF-8 bytes of ``texts``, the fewest tokens they can make when no token spells more than ``token_bytes``)."""
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    return size, -(-size // max(token_bytes, 1))


class ThreadTokenizers:
    """One copy of the tokenizer per thread that encodes prompts, made on the thread's first request.

    A fast tokenizer's encode may change its truncation settings in place, which fails while another thread is
    inside it; copies need no lock, so a long prompt never makes another request wait for the tokenizer.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.local = threading.local()
        self.copying = threading.Lock()  # held only while copying, never while encoding

    def get(self):
        mine = getattr(self.local, "tokenizer", None)
        if mine is None:
            with self.copying:
                mine = self.local.tokenizer = copy.deepcopy(self.tokenizer)
        return mine
