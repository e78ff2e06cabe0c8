"""`suffix`: SuffixDecoding-style drafting from what followed the newest phrase before.

Two indexes are searched (`specula.drafters.suffix_index`): this generation's own text (prompt and answer
so far, a `SuffixTrie` grown each cycle) and, when enabled, a `SuffixCorpus` of the process's earlier
generations. In each, the longest suffix of the context (at most ``max_match`` tokens) that occurred
before with a continuation is found; the continuations are ranked by how often each followed, and a
draft of at most ``ceil(spec_factor · match)`` nodes is grown best first (a tree where two continuations
are both likely, else a chain). The index whose draft has the higher expected accepted length wins.

Drafts are point masses (``draft_probs`` None), which the lossless acceptor already handles at T > 0.

Who sees which earlier text (the corpus scope):
- A drafter built by `specula.load` / `build_speculator` with ``corpus=False`` (the default) has no
  scope: nothing outlives a generation, nothing is shared.
- ``corpus=True``: every generation of the process (the Speculator's own drafter and all its forks, so in
  `specula serve` every client) reads and writes one shared scope. This is the operator's opt-in,
  set with ``--suffix-corpus`` (or ``corpus=True`` in Python, ``corpus = true`` in a bench config).
- `SuffixDrafter.for_client(name)`: a fork bound to ``name``'s own scope of the same corpus. Code that
  knows its clients (a server with one API key per client) gives each request the fork of its client;
  clients never read each other's text. The drafted tokens never change the output (lossless), so
  what sharing would leak is timing, and retention of text in memory: both stay within a scope.
A fork (`fork`, what batched serving makes per slot) keeps its parent's scope only when it is the shared
one: a slot serves many clients one after another, and the server cannot tell them apart.
"""

from __future__ import annotations

import torch

from specula.drafters.answer_corpus import AnswerCorpus
from specula.drafters.suffix_index import NO_CANDIDATES, Candidates, SuffixCorpus, SuffixTrie, best_continuations
from specula.errors import SpeculaError
from specula.runtime.target import FeatureRequest, ForwardOutput
from specula.sampling import SamplingParams
from specula.tree import DraftTree

SHARED_SCOPE = "shared"
# Draft nodes a cycle takes from the answer corpus. Replayed on MT-bench's greedy q4_1 answers with SmolLM2's
# corpus (docs/suffix.md, "The answer corpus"), 2 and 4 gave the same tau and 8 cost more in verification.
ANSWER_NODES = 2
MAX_MATCH = 8  # the longest phrase matched by default (the answer corpus is indexed MAX_MATCH + ANSWER_NODES deep)


class SuffixDrafter:
    """Drafts from a suffix index of the current generation and, optionally, of earlier ones.

    num_tokens:   draft nodes per cycle at most.
    max_match:    longest phrase matched (tokens); the index depth is max_match + num_tokens.
    spec_factor:  draft nodes allowed per matched token (a longer match drafts more).
    min_prob:     smallest path probability a draft node may have.
    tree:         False drafts chains only.
    corpus:       the process-wide corpus object (shared by forks), or None for none.
    scope:        the corpus scope this drafter reads and writes (None: none).
    answers:      a fixed corpus of the target's own answers (`AnswerCorpus`), or None.
    answer_nodes: draft nodes per cycle at most when the draft comes from ``answers``: its phrases are common
                  ones, right less often than an earlier phrase of the same conversation.
    """

    name = "suffix"
    features = FeatureRequest()

    def __init__(self, num_tokens: int = 8, max_match: int = MAX_MATCH, spec_factor: float = 4.0, min_prob: float = 0.1,
                 tree: bool = True, corpus: SuffixCorpus | None = None, scope: str | None = None,
                 answers: AnswerCorpus | None = None, answer_nodes: int = ANSWER_NODES):
        if num_tokens < 1 or max_match < 1:
            raise SpeculaError("suffix needs num_tokens >= 1 and max_match >= 1")
        if spec_factor <= 0 or not 0 <= min_prob <= 1:
            raise SpeculaError("suffix needs spec_factor > 0 and 0 <= min_prob <= 1")
        if scope is not None and corpus is None:
            raise SpeculaError("a suffix corpus scope needs a corpus")
        self.num_tokens, self.max_match, self.spec_factor = num_tokens, max_match, spec_factor
        self.min_prob, self.tree = min_prob, tree
        self.corpus, self.scope = corpus, scope
        self.answers, self.answer_nodes = answers, answer_nodes
        self.depth = max_match + num_tokens
        self._reset()

    def _reset(self) -> None:
        self.index = SuffixTrie(self.depth)  # this generation's prompt and answer so far
        self._open: list = []  # the index's nodes of the newest 1, 2, … tokens (`SuffixTrie.extend`)
        self._indexed = 0  # context tokens in the index (the first ones of _text)
        self._prompt_length = 0
        self._text: list[int] = []  # the context as ids, for the corpus at the generation's end

    # ---------------------------------------------------------------- the Drafter protocol

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        """A new generation: the previous one (if any) goes into the corpus, this one's index starts empty."""
        self.flush()
        self._prompt_length = int(prompt.numel())

    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        """A point-mass tree rooted at ``context[-1]`` ([T] ids so far) from the better of the two indexes."""
        root = int(context[-1])
        if len(context) < len(self._text):  # not the generation this index holds: start over
            self._reset()
        self._text.extend(context[len(self._text):].tolist())
        if max_depth <= 0:
            # No draft this cycle (a server's budget at a large batch): the index catches up when drafting resumes,
            # so a sequence that never drafts never pays ~50 us a token for it.
            return DraftTree.root_only(root, device=context.device)
        self._open = self.index.extend(self._open, self._text[self._indexed:])
        self._indexed = len(self._text)
        draft = {"budget": self.num_tokens, "max_depth": max_depth, "min_prob": self.min_prob,
                 "spec_factor": self.spec_factor, "tree": self.tree}
        best, source = best_continuations(self._open[:self.max_match], **draft), "conversation"
        if self.scope is not None:
            tail = self._text[-self.max_match:]
            other = self.corpus.propose(self.scope, tail, self.max_match, **draft)
            if other.score > best.score:
                best, source = other, "earlier conversations"
        nodes = min(self.num_tokens, self.answer_nodes)
        if self.answers is not None and best.score < nodes:  # a draft of n nodes scores at most n: else unbeatable
            other = self.answers.propose(self._text[-self.max_match:], self.max_match, **{**draft, "budget": nodes})
            if other.score > best.score:
                best, source = other, "answers"
        return _tree(root, best, source, context.device)

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        pass  # the next propose reads the committed tokens from its context

    def fork(self) -> SuffixDrafter:
        """Same options and corpus, its own index; the shared scope is kept, a client's is not (see module)."""
        scope = self.scope if self.scope == SHARED_SCOPE else None
        return self._copy(scope)

    # ---------------------------------------------------------------- the corpus

    def for_client(self, client: str) -> SuffixDrafter:
        """A fork reading and writing only ``client``'s scope of this drafter's corpus."""
        if self.corpus is None:
            raise SpeculaError("this suffix drafter has no corpus: build it with build_suffix_drafter or pass one")
        if not client or client == SHARED_SCOPE:
            raise SpeculaError(f"a client name must be non-empty and not {SHARED_SCOPE!r}")
        return self._copy(f"client:{client}")

    def flush(self) -> None:
        """Put the finished generation's answer (with the prompt's last ``max_match`` tokens, so that its
        opening can be matched) into the corpus scope, and forget it here."""
        answer_from = max(0, self._prompt_length - self.max_match)
        if self.scope is not None and len(self._text) > self._prompt_length:
            self.corpus.add(self.scope, self._text[answer_from:])
        self._reset()

    def _copy(self, scope: str | None) -> SuffixDrafter:
        return SuffixDrafter(self.num_tokens, self.max_match, self.spec_factor, self.min_prob, self.tree,
                             self.corpus, scope, self.answers, self.answer_nodes)


def draft_kind(source: str, match: int) -> str:
    """The kind of a draft (`DraftTree.kind`): where it was found and how long a phrase matched, in the buckets
    whose first-draft acceptance differs (SmolLM2 q4_1, MT-bench first turns: from this conversation 0.19 / 0.48 /
    0.62-0.66 / 0.59-1.0 after a match of 1 / 2 / 3-4 / 5+ tokens, from the answer corpus 0.12 / 0.22 / 0.28-0.37 /
    0.38-0.56; docs/suffix.md, "Kinds of draft")."""
    bucket = "1" if match <= 1 else "2" if match == 2 else "3-4" if match <= 4 else "5+"
    return f"{source} match {bucket}"


def _tree(root: int, candidates: Candidates, source: str, device: torch.device) -> DraftTree:
    if candidates is NO_CANDIDATES or not candidates.tokens:
        return DraftTree.root_only(root, device=device)
    tokens = torch.tensor([root, *candidates.tokens], dtype=torch.long, device=device)
    return DraftTree(tokens, [-1, *candidates.parents], confidences=torch.tensor([1.0, *candidates.probs]),
                     kind=draft_kind(source, candidates.match))


def build_suffix_drafter(num_tokens: int = 8, max_match: int = MAX_MATCH, spec_factor: float = 4.0,
                         min_prob: float = 0.1, tree: bool = True, corpus: bool = False, corpus_nodes: int = 1 << 18,
                         answers: AnswerCorpus | None = None) -> SuffixDrafter:
    """The drafter `specula.load(method="suffix")` uses: a corpus object of ``corpus_nodes`` nodes (about
    `NODE_BYTES` each) always exists for `for_client`; ``corpus`` True shares it across every generation;
    ``answers`` the target's own answers (read-only, shared by every fork: never the clients' text)."""
    depth = max_match + num_tokens
    if corpus_nodes < depth:
        raise SpeculaError(f"suffix corpus_nodes must be >= max_match + num_tokens ({depth}), got {corpus_nodes}")
    store = SuffixCorpus(corpus_nodes, depth)
    return SuffixDrafter(num_tokens, max_match, spec_factor, min_prob, tree, store,
                         SHARED_SCOPE if corpus else None, answers)
