"""A fixed corpus of the target's own earlier answers, for the suffix drafter to draft from (issue 42).

A 135M chat model says the same phrases again and again ("Here's a", "In conclusion,", "I hope this helps"), also
in a conversation's first turn, where the conversation itself has nothing to copy yet. The answers the target wrote
for the head-training capture (`specula train data`) are exactly such text: this index holds them, and the suffix
drafter proposes what most often followed the longest phrase of the current answer found in them
(`SuffixDrafter`; measured in docs/suffix.md, "The answer corpus").

The corpus is read-only and may be large (a million tokens), so it is not a `SuffixTrie` (about 72 bytes per node
and depth nodes per token) but a sorted list of every position's window: ``order`` [n] sorts the positions of the
concatenated texts by the ``depth`` tokens that start there. The positions whose window begins with a phrase form
one contiguous run of ``order``, in which the token after the phrase is sorted too, so the runs of a phrase's
continuations are sub-runs found by binary search: the trie's nodes, counts and recency without building it.
`Occurrences` gives a run the interface of a trie node, so `best_continuations` drafts from both the same way
(tests/test_answer_corpus.py checks that both give the same drafts for the same texts).

The file (safetensors, format `FORMAT`): ``tokens`` (uint16 where the ids fit, else int32), the texts one after
another, each followed by the ``separator`` of the metadata (the dtype's largest value); ``tokenizer``, the
tokenizer's fingerprint (`specula.runtime.tokenizer.tokenizer_fingerprint`). The sorted windows are not in the file:
sorting them takes ~0.15 s for 1.2M tokens (~0.9 s for SmolLM2's bundled 3.5M), so the first load
keeps them in the cache (`index_path`: two ``.npy`` files named by a hash of the tokens and the depth) and later
loads map them. A damaged or missing copy is rebuilt; a wrong one could only change drafts, never the output.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specula.drafters.suffix_index import NO_CANDIDATES, Candidates, best_continuations
from specula.errors import SpeculaError
from specula.files.outputs import atomic_write
from specula.runtime.model_source import cache_dir
from specula.runtime.tokenizer import tokenizer_fingerprint

FORMAT = "specula-answer-corpus"
INDEX_VERSION = b"1"  # of the cached sorted windows' layout: a change here names new files


class AnswerCorpus:
    """Every window of ``depth`` tokens of fixed texts, sorted: what followed each phrase, how often and where.

    ``stream`` [n] (integers): the texts one after another, each ended by the value ``separator`` (larger than
    every token id). Memory: ``depth`` sorted columns of n tokens (2 bytes each where the ids fit in 16 bits, else
    4) and the order (4 bytes each): 29 MB for a 1.2M-token corpus at depth 10 (81 MB for SmolLM2's bundled 3.5M)."""

    def __init__(self, stream: np.ndarray, depth: int, separator: int, tokenizer: str = "",
                 index: tuple[np.ndarray, np.ndarray] | None = None):
        if depth < 2:
            raise ValueError(f"an answer corpus needs depth >= 2, got {depth}")
        self.depth, self.separator, self.tokenizer = depth, separator, tokenizer
        self.size = int(stream.shape[0])
        # order [n] int32 and columns [depth, n]: the windows sorted (`sort_windows`), or given as built before.
        self.order, self.columns = index if index is not None else sort_windows(stream, depth, separator)

    @classmethod
    def from_texts(cls, texts: Sequence[Sequence[int]], depth: int, tokenizer: str = "") -> AnswerCorpus:
        top = max((max(text) for text in texts if len(text)), default=0)
        separator = int(np.iinfo(np.uint16).max if top < np.iinfo(np.uint16).max else np.iinfo(np.int32).max)
        stream = [token for text in texts for token in (*text, separator)]
        return cls(np.asarray(stream, dtype=np.int64), depth, separator, tokenizer)

    @property
    def texts(self) -> int:
        return int((self.columns[0] == self.separator).sum())

    # ---------------------------------------------------------------- drafting

    def occurrences(self, phrase: Sequence[int], top: int | None = None) -> Occurrences | None:
        """The run of windows that begin with ``phrase`` (at most ``depth`` tokens), or None if it never occurs.
        ``top``: how many continuations of a run `Occurrences.ranked_children` returns at most (None: all)."""
        lo, hi, kind = 0, self.size, self.columns.dtype.type
        for j, token in enumerate(phrase):
            if not 0 <= token < self.separator:
                return None  # no id the texts hold (and never their separator)
            column, token = self.columns[j, lo:hi], kind(token)  # of the column's dtype: numpy would copy the column
            lo, hi = lo + int(column.searchsorted(token, "left")), lo + int(column.searchsorted(token, "right"))
            if lo == hi:
                return None
        return Occurrences(self, int(phrase[-1]), lo, hi, len(phrase), top)

    def match(self, context: Sequence[int], longest: int, top: int | None = None) -> list[Occurrences]:
        """The runs of the last 1, 2, … tokens of ``context`` that occur, at most ``longest`` (`SuffixTrie.match`)."""
        found = []
        for k in range(1, min(longest, len(context), self.depth - 1) + 1):
            run = self.occurrences(context[len(context) - k:], top)
            if run is None:
                break  # a longer phrase ends with this one, so it is absent too
            found.append(run)
        return found

    def propose(self, context: Sequence[int], longest: int, **draft) -> Candidates:
        """`best_continuations` of the newest tokens of ``context`` (none found: `NO_CANDIDATES`)."""
        # A draft of b nodes takes at most b children of any node, the first b in the ranking, so a run's
        # continuations past its b best are never looked at (hundreds follow a comma).
        matched = self.match(context, longest, draft.get("budget"))
        return best_continuations(matched, **draft) if matched else NO_CANDIDATES

    # ---------------------------------------------------------------- files

    def save(self, path: str | Path) -> None:
        """Write the texts (not the sorted windows: they are rebuilt at load) to ``path``, whole or not at all."""
        stream = np.empty(self.size, dtype=self.columns.dtype)
        stream[self.order] = self.columns[0]
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        save_file({"tokens": torch.from_numpy(stream)}, partial,
                  metadata={"format": FORMAT, "version": "1", "tokenizer": self.tokenizer,
                            "separator": str(self.separator)})
        partial.replace(path)

    @classmethod
    def load(cls, path: str | Path, depth: int) -> AnswerCorpus:
        """An answer corpus file (`save`), indexed ``depth`` tokens deep (the longest phrase matched plus the
        deepest continuation drafted)."""
        try:
            with safe_open(path, "pt") as file:
                metadata = file.metadata() or {}
                tokens = file.get_tensor("tokens") if "tokens" in file.keys() else None
        except Exception as err:  # noqa: BLE001 - missing, unreadable or not safetensors: one clear line
            raise SpeculaError(f"cannot read the answer corpus {path}: {err}") from None
        if metadata.get("format") != FORMAT or tokens is None or tokens.ndim != 1 or "separator" not in metadata:
            raise SpeculaError(f"{path} is not an answer corpus ({FORMAT}, version 1)")
        stream, separator = tokens.numpy(), int(metadata["separator"])
        return cls(stream, depth, separator, metadata.get("tokenizer", ""), cached_index(stream, depth, separator))


def column_dtype(separator: int) -> type:
    """The sorted columns' integer type: uint16 where the ``separator`` (larger than every id) fits, else int32."""
    return np.uint16 if separator <= np.iinfo(np.uint16).max else np.int32


def sort_windows(stream: np.ndarray, depth: int, separator: int) -> tuple[np.ndarray, np.ndarray]:
    """(order int32 [n]: the positions of ``stream`` [n] sorted by the ``depth`` tokens starting there; columns
    [depth, n]: the token j places into each sorted window, of `column_dtype`)."""
    size, dtype = int(stream.shape[0]), column_dtype(separator)
    # Windows past the end read separators: no phrase runs over the end of the last text.
    padded = np.concatenate([stream.astype(dtype), np.full(depth, separator, dtype)])
    order = np.lexsort([padded[j:j + size] for j in reversed(range(depth))]).astype(np.int32)
    # columns[j]: the token j places into each sorted window. The windows that begin with a phrase of k tokens
    # are one run, sorted by their (k+1)-th token: each narrowing is a binary search in a column's slice.
    return order, np.stack([padded[order + j] for j in range(depth)])


def index_path(stream: np.ndarray, depth: int, separator: int) -> Path:
    """The cached sorted windows of ``stream`` at ``depth`` (``<key>-order.npy`` beside ``<key>-columns.npy``)."""
    digest = hashlib.sha256(INDEX_VERSION + b"%d %d " % (depth, separator))
    digest.update(np.ascontiguousarray(stream).tobytes())
    return cache_dir() / "answer-index" / digest.hexdigest()[:32]


def cached_index(stream: np.ndarray, depth: int, separator: int) -> tuple[np.ndarray, np.ndarray]:
    """`sort_windows`, mapped from the cache where an earlier load kept it, else sorted now and kept (a cache that
    cannot be written costs only the sort)."""
    base = index_path(stream, depth, separator)
    order_file, columns_file = base.with_name(base.name + "-order.npy"), base.with_name(base.name + "-columns.npy")
    size, dtype = int(stream.shape[0]), column_dtype(separator)
    try:
        order, columns = np.load(order_file, mmap_mode="r"), np.load(columns_file, mmap_mode="r")
        if (order.shape == (size,) and order.dtype == np.int32 and columns.shape == (depth, size)
                and columns.dtype == dtype):
            # Plain arrays over the mapped files: every slice of a np.memmap pays for the subclass (a draft's
            # lookups 175-200 us against 101 us, SmolLM2's corpus, 2,000 random phrases).
            return order.view(np.ndarray), columns.view(np.ndarray)
    except (OSError, ValueError):  # none yet, or truncated: sorted again below
        pass
    order, columns = sort_windows(stream, depth, separator)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        # columns first, order last: a load finds order only where columns were written whole before it.
        atomic_write(columns_file, lambda tmp: _save_array(tmp, columns))
        atomic_write(order_file, lambda tmp: _save_array(tmp, order))
    except (OSError, SpeculaError):
        pass
    return order, columns


def _save_array(path: str, array: np.ndarray) -> None:
    with open(path, "wb") as handle:  # a file object: np.save given a name would append ".npy" to it
        np.save(handle, array)


_LOADED: dict[tuple[str, int], AnswerCorpus] = {}  # one copy per file and depth in a process (bench, serve)


def load_answers(path: str | Path, tokenizer, depth: int) -> AnswerCorpus:
    """The answer corpus at ``path`` (loaded once per process), checked to be made with ``tokenizer``'s ids."""
    key = (str(Path(path).resolve()), depth)
    corpus = _LOADED.get(key)
    if corpus is None:
        corpus = _LOADED[key] = AnswerCorpus.load(path, depth)
    if corpus.tokenizer and corpus.tokenizer != tokenizer_fingerprint(tokenizer):
        raise SpeculaError(f"the answer corpus {path} was made with another tokenizer than this target's")
    return corpus


class Occurrences:
    """The windows that begin with one phrase (``order[lo:hi]``), as `best_continuations` reads a trie node: the
    phrase's last ``token``, its ``count``, the newest occurrence (``last``) and the runs of its continuations
    (`ranked_children`), the ``top`` most frequent of them (None: all)."""

    __slots__ = ("corpus", "token", "lo", "hi", "length", "top", "last")

    def __init__(self, corpus: AnswerCorpus, token: int, lo: int, hi: int, length: int, top: int | None,
                 last: int = -1):
        self.corpus, self.token, self.lo, self.hi, self.length, self.top = corpus, token, lo, hi, length, top
        self.last = last  # where the newest occurrence starts: the trie's recency, for ties between siblings

    @property
    def count(self) -> int:
        return self.hi - self.lo

    @property
    def kids(self) -> Occurrences | None:
        """Not None when some occurrence is followed by a token within the depth (a trie node's children)."""
        if self.length >= self.corpus.depth:
            return None
        return self if self.corpus.columns[self.length, self.lo] != self.corpus.separator else None  # sorted last

    def ranked_children(self) -> tuple[list[Occurrences], int]:
        """(the ``top`` continuations, most frequent first and then the most recent, as a trie node ranks its
        children; the total count of all of them)."""
        corpus = self.corpus
        if self.length >= corpus.depth:
            return [], 0
        following = corpus.columns[self.length, self.lo:self.hi]
        starts = np.concatenate([[0], np.flatnonzero(np.diff(following)) + 1])
        ends = np.concatenate([starts[1:], [len(following)]])
        if following[starts[-1]] == corpus.separator:  # the texts that end here: no continuation
            starts, ends = starts[:-1], ends[:-1]
        if len(starts) == 0:
            return [], 0
        counts = ends - starts
        newest = np.maximum.reduceat(corpus.order[self.lo:self.hi], starts)
        ranked = np.lexsort((newest, counts))[::-1][:self.top]
        return [Occurrences(corpus, int(following[starts[i]]), self.lo + int(starts[i]), self.lo + int(ends[i]),
                            self.length + 1, self.top, int(newest[i])) for i in ranked.tolist()], int(counts.sum())
