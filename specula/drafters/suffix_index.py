"""Suffix indexes over token ids: what followed each recent phrase, and how often.

`SuffixTrie` is a depth-bounded suffix trie: every substring of at most ``depth`` tokens of the texts
added is a path from the root, and each node counts the occurrences of its substring. The tokens that
followed a phrase are the children of the phrase's node, and a child's count over the sum of its
siblings' counts estimates how often that continuation followed (the SuffixDecoding idea; this is our
own structure and code).

Why a bounded trie and not a suffix tree or a suffix automaton: drafts never need more than a match of
a dozen tokens plus a dozen continuation tokens, and within that bound the trie gives, at every node,
the exact count of every continuation in O(1) (a suffix automaton needs a pass over its suffix links to
count occurrences, and cannot forget a text); a text is added *and removed* in O(len · depth) by the
same walk (counts up, counts down), which makes eviction exact; and appending one token to a growing
text updates at most ``depth`` nodes, which is all the per-request index does each cycle. A suffix tree
would store O(n) instead of O(n · depth) nodes, but online construction with deletion (Ukkonen plus
reference bookkeeping) costs far more Python per token. Memory is the price, so nodes are compact
(about 72 bytes each, one child kept inline) and the shared corpus is capped in nodes.

`SuffixCorpus` holds earlier texts of the process (finished generations) in one trie per scope, behind
a lock, with at most ``max_nodes`` nodes in all; the oldest texts are evicted first.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NODE_BYTES = 72  # measured with tracemalloc: a node with three slots, its child inline (CPython 3.11)


class _Node:
    """One substring: ``token`` ends it, ``count`` occurrences, ``last`` the clock of the newest one.

    ``kids`` is None (no continuation), the only child itself, or a dict token -> child: most nodes of a
    deep trie have one child, and a dict per node would cost four times the memory.
    """

    __slots__ = ("token", "count", "last", "kids")

    def __init__(self, token: int):
        self.token, self.count, self.last, self.kids = token, 0, 0, None

    def child(self, token: int) -> _Node | None:
        kids = self.kids
        if kids is None:
            return None
        if type(kids) is _Node:
            return kids if kids.token == token else None
        return kids.get(token)

    def children(self) -> Iterable[_Node]:
        kids = self.kids
        if kids is None:
            return ()
        return (kids,) if type(kids) is _Node else kids.values()

    def ranked_children(self) -> tuple[list[_Node], int]:
        """(the continuations, most frequent first and then the most recent; their total count)."""
        kids = list(self.children())
        return sorted(kids, key=lambda kid: (kid.count, kid.last), reverse=True), sum(kid.count for kid in kids)

    def attach(self, node: _Node) -> None:
        kids = self.kids
        if kids is None:
            self.kids = node
        elif type(kids) is _Node:
            self.kids = {kids.token: kids, node.token: node}
        else:
            kids[node.token] = node

    def detach(self, token: int) -> None:
        kids = self.kids
        if type(kids) is _Node:
            self.kids = None
            return
        del kids[token]
        if len(kids) == 1:
            self.kids = next(iter(kids.values()))


@dataclass
class Candidates:
    """A draft read from an index: nodes in best-first order, parents first.

    tokens[i] follows node parents[i] (0 is the root of the draft, the newest token; node i + 1 is
    tokens[i]); probs[i] is how often tokens[i] followed its parent's phrase (count over the siblings'
    total). ``match`` is how many of the newest tokens matched; ``score`` sums the path probabilities
    (the draft's expected accepted length if the estimates held).
    """

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match: int = 0
    score: float = 0.0


NO_CANDIDATES = Candidates([], [], [])


class SuffixTrie:
    """Every substring of at most ``depth`` tokens of the texts added, with occurrence counts."""

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"a suffix trie needs depth >= 2, got {depth}")
        self.depth = depth
        self.root = _Node(-1)
        self.nodes = 0  # root excluded
        self.clock = 0  # tokens ever added: the recency stamp of a node's newest occurrence

    def extend(self, active: list[_Node], tokens: Iterable[int]) -> list[_Node]:
        """Append ``tokens`` to a text whose open suffixes are ``active`` ([] for a new text).

        ``active[k - 1]`` is the node of the text's last k tokens (k <= depth). Every new substring that
        ends at a new token is counted once. Returns the new open suffixes.
        """
        root, limit = self.root, self.depth - 1
        for token in tokens:
            self.clock = clock = self.clock + 1
            grown = []
            for parent in (root, *active[:limit]):
                kids = parent.kids  # `_Node.child` inlined: this loop is the index's whole cost
                if kids is None:
                    node = parent.kids = _Node(token)
                    self.nodes += 1
                else:
                    node = kids.get(token) if type(kids) is dict else kids if kids.token == token else None
                    if node is None:
                        node = _Node(token)
                        parent.attach(node)
                        self.nodes += 1
                node.count += 1
                node.last = clock
                grown.append(node)
            active = grown
        return active

    def remove(self, tokens: Sequence[int]) -> None:
        """Forget one text added earlier (the same walk as `extend`, counting down; empty nodes go)."""
        root, limit = self.root, self.depth - 1
        active: list[_Node] = []
        for token in tokens:
            grown = []
            for parent in (root, *active[:limit]):
                node = parent.child(token)
                node.count -= 1
                if node.count == 0:
                    # Its descendants occur only inside this text too: they reach 0 on the next tokens,
                    # walked through the detached node, so every one is subtracted exactly once.
                    parent.detach(token)
                    self.nodes -= 1
                grown.append(node)
            active = grown

    def match(self, context: Sequence[int], longest: int) -> list[_Node]:
        """Nodes of the last 1, 2, … tokens of ``context`` present in the trie, at most ``longest``."""
        found = []
        for k in range(1, min(longest, len(context), self.depth - 1) + 1):
            node = self.root
            for token in context[len(context) - k:]:
                node = node.child(token)
                if node is None:
                    return found  # a longer suffix contains this one, so it is absent too
            found.append(node)
        return found


def best_continuations(matched: list[_Node], budget: int, max_depth: int, min_prob: float,
                       spec_factor: float, tree: bool) -> Candidates:
    """The draft grown from the longest matched phrase that has a continuation.

    ``matched[k - 1]`` is the node of the newest k tokens. At most ``min(budget, ceil(spec_factor · k))``
    nodes (a longer match earns a longer draft), none deeper than ``max_depth``, each with a path
    probability (product of the count ratios down to it) of at least ``min_prob``; nodes are taken
    best first, so a tree branches only where a second continuation is as likely as going deeper.
    ``tree`` False keeps only the most frequent child of each node (a chain).
    """
    for k in range(len(matched), 0, -1):
        if matched[k - 1].kids is not None:
            break
    else:
        return NO_CANDIDATES
    size = min(budget, max(1, int(-(-spec_factor * k // 1))))
    order = itertools.count()
    heap: list[tuple[float, int, _Node, int, float, int]] = []

    def push(node: _Node, index: int, prob: float, depth: int) -> None:
        if depth >= max_depth:
            return
        ranked, total = node.ranked_children()
        for kid in ranked if tree else ranked[:1]:
            ratio = kid.count / total
            if prob * ratio < min_prob:
                break  # ranked by count: the rest are rarer still
            heapq.heappush(heap, (-prob * ratio, next(order), kid, index, ratio, depth + 1))

    push(matched[k - 1], 0, 1.0, 0)
    out = Candidates([], [], [], match=k)
    while heap and len(out.tokens) < size:
        negative, _, node, parent, ratio, depth = heapq.heappop(heap)
        out.tokens.append(node.token)
        out.parents.append(parent)
        out.probs.append(ratio)
        out.score -= negative
        push(node, len(out.tokens), -negative, depth)
    return out


class SuffixCorpus:
    """Earlier texts of this process by scope, at most ``max_nodes`` trie nodes in all; thread-safe.

    A scope is a name (one client, or one shared name when the operator shares): each has its own trie,
    so a lookup in one scope never reads another's text. Texts go in whole and leave whole, oldest first,
    whatever their scope, once the nodes exceed ``max_nodes`` (about ``NODE_BYTES`` bytes each).
    """

    def __init__(self, max_nodes: int = 1 << 18, depth: int = 24):
        if max_nodes < depth:
            raise ValueError(f"a corpus needs max_nodes >= depth ({depth}), got {max_nodes}")
        self.max_nodes, self.depth = max_nodes, depth
        self._tries: dict[str, SuffixTrie] = {}
        self._texts: deque[tuple[str, list[int]]] = deque()
        self._lock = threading.Lock()

    def add(self, scope: str, tokens: Sequence[int]) -> None:
        """Remember ``tokens`` under ``scope``; a text longer than the cap allows keeps its end."""
        # A text of n tokens makes at most n · depth nodes, so this much of it always fits alone.
        tokens = list(tokens[-(self.max_nodes // self.depth):])
        if len(tokens) < 2:
            return
        with self._lock:
            trie = self._tries.get(scope)
            if trie is None:
                trie = self._tries[scope] = SuffixTrie(self.depth)
            trie.extend([], tokens)
            self._texts.append((scope, tokens))
            while self._nodes() > self.max_nodes:
                self._evict()

    def propose(self, scope: str, context: Sequence[int], longest: int, **draft) -> Candidates:
        """`best_continuations` of the newest tokens of ``context`` in ``scope``'s texts (none: empty)."""
        with self._lock:  # the nodes read here change under a concurrent add or eviction
            trie = self._tries.get(scope)
            if trie is None:
                return NO_CANDIDATES
            return best_continuations(trie.match(context, longest), **draft)

    def _nodes(self) -> int:
        return sum(trie.nodes for trie in self._tries.values())

    def _evict(self) -> None:
        scope, tokens = self._texts.popleft()
        trie = self._tries[scope]
        trie.remove(tokens)
        if trie.nodes == 0:
            del self._tries[scope]

    @property
    def nodes(self) -> int:
        with self._lock:
            return self._nodes()

    @property
    def texts(self) -> int:
        with self._lock:
            return len(self._texts)

    def scopes(self) -> list[str]:
        with self._lock:
            return list(self._tries)
