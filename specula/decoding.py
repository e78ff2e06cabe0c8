"""The decode loop: draft → verify → accept → commit, the same for every method.

The target's prefill produces the first new token by itself (counted as one
cycle). Each later cycle asks the drafter for a tree rooted at the newest
token, verifies the whole tree in one target forward, keeps the accepted path
in the KV cache and emits the accepted drafts plus the target's own next token.
τ = new tokens / cycles, so plain decoding has τ = 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from specula.acceptance import Acceptor
from specula.draft_budget import DepthCaps, DraftBudget
from specula.drafters.base import Drafter
from specula.errors import SpeculaError
from specula.runtime.compiled_step import WARM_UP_BLOCK
from specula.runtime.packed import Block
from specula.runtime.target import ForwardOutput, Target
from specula.sampling import SamplingParams, make_generator, pick_token
from specula.tree import DraftTree

DRAFT_MARGIN = 64  # KV slots reserved beyond prompt + new tokens for the last cycle's draft tree
RESERVE_AHEAD = 1024  # new tokens' KV slots reserved up front at most (the cache grows past them on demand)


@dataclass
class GenerationStats:
    """Per-call counters. Times are wall-clock seconds.

    With ``record_nodes=True`` (off by default, so plain decoding pays nothing) ``nodes`` gets one
    list per verify cycle, aligned with ``accepted_lengths``: a ``(confidence, accepted, depth)``
    tuple for each *tested* draft node, i.e. each node whose parent lies on the accepted path (the
    root included) — the nodes the acceptor actually judged. ``accepted`` says whether the node is
    itself on the accepted path; ``confidence`` is the drafter's probability of the node's token
    given its parent (`DraftTree.node_confidences`), NaN when the drafter does not know it.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    cycles: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # accepted drafts per cycle (prefill excluded)
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes proposed per cycle (root excluded)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    stop_reason: str = ""
    record_nodes: bool = False
    nodes: list[list[tuple[float, bool, int]]] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward, counting the target's own token (1.0 for vanilla)."""
        return self.new_tokens / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """The tokens after the prompt's own (the first, from the prefill) over the time after the prefill: what
        llama.cpp reports as its eval rate, so the two compare like with like (0.0 when nothing was decoded)."""
        decoding = self.total_time - self.prefill_time
        return (self.new_tokens - 1) / decoding if self.new_tokens > 1 and decoding > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "cycles": self.cycles,
            "tau": round(self.tau, 4), "tokens_per_s": round(self.tokens_per_s, 2),
            "accepted_lengths": self.accepted_lengths, "tree_sizes": self.tree_sizes,
            "prefill_time": round(self.prefill_time, 5), "draft_time": round(self.draft_time, 5),
            "verify_time": round(self.verify_time, 5), "total_time": round(self.total_time, 5),
            "stop_reason": self.stop_reason,
            **({"nodes": self.nodes} if self.record_nodes else {}),
        }


class Sequence:
    """One generation as a state machine, so that one loop serves a single stream and a batch alike.

    `block` says what the target must run next (the prompt first, then each cycle's draft tree);
    `advance` takes the target's output for that block, accepts, commits, and returns the new tokens.
    Between the two the caller runs the forward: `stream_tokens` alone, a batched engine packed with
    other sequences' blocks (`specula.runtime.packed.forward_packed`). ``target`` is this sequence's own (its KV cache).
    ``budget`` (`specula.draft_budget.DraftBudget`, shared by every sequence it plans for) caps how deep each cycle
    drafts and learns from what each cycle's draft won; None drafts as deep as the drafter likes.
    """

    def __init__(self, target: Target, drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int,
                 params: SamplingParams, seed: int | None = None, stop_on_eos: bool = True,
                 acceptor: Acceptor | None = None, stats: GenerationStats | None = None,
                 budget: DraftBudget | None = None):
        prompt = prompt.to(target.device)
        if prompt.ndim != 1 or prompt.numel() == 0:
            raise SpeculaError("the prompt is empty")
        if prompt.numel() >= target.max_length:
            raise SpeculaError(
                f"the prompt has {prompt.numel()} tokens; the context limit of {target.name} is {target.max_length}"
            )
        if max_new_tokens < 1:
            raise SpeculaError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.target, self.drafter, self.prompt = target, drafter, prompt
        self.max_new_tokens, self.params = max_new_tokens, params
        self.acceptor = acceptor or Acceptor()
        self.stats = stats if stats is not None else GenerationStats()
        self.generator = make_generator(seed, target.device)
        self.eos = target.eos_token_ids if stop_on_eos else set()
        self.stats.prompt_tokens = int(prompt.numel())
        self.context: torch.Tensor | None = None  # prompt + new tokens, once the prompt has run
        self._tree: DraftTree | None = None
        self.budget = budget
        self.draft_cap: int | None = None  # the depth cap the current draft was pruned to (None: uncapped)
        self.draft_chain_only = False  # whether it was pruned to its main chain too
        self._drafted: list[int] = []  # nodes per depth of the draft being verified, for the budget
        self._draft_seconds = 0.0  # the time its proposal took, for the budget
        self._alone = True  # whether the draft being verified runs alone in its forward (its seconds are its own)
        self._probe: int | None = None  # one level past the last cap, when the last draft was accepted whole at it
        self._started = self._proposed = 0.0

    @property
    def done(self) -> bool:
        return bool(self.stats.stop_reason)

    @property
    def draft_kind(self) -> str:
        """The kind of the draft the next `advance` verifies (`DraftTree.kind`; "" for the prompt or a root)."""
        return "" if self._tree is None else self._tree.kind

    @property
    def nodes_per_depth(self) -> list[int]:
        """Draft nodes at depth 1, 2, … of the tree the next `advance` verifies ([] for the prompt or a root)."""
        if self._tree is None:
            return []
        depths = self._tree.depths
        return [depths.count(d) for d in range(1, max(depths) + 1)]

    def block(self, max_depth: int | None = None, kind_depth: Mapping[str, int | None] | None = None,
              batch: int = 1) -> Block:
        """The next forward: the whole prompt (from an empty cache) first, then a draft tree no deeper than
        ``max_depth`` (None: as deep as the drafter proposes; 0: the root alone, a plain decoding step), and
        no deeper than ``kind_depth[kind]`` for a draft of a kind listed there (`DraftTree.kind`). The cap that
        applied is ``draft_cap``. With a ``budget`` and neither cap given, the budget's caps for ``batch``
        sequences sharing the forward apply, which may also keep only the draft's main chain (``draft_chain_only``)."""
        tick = time.perf_counter()
        if self.context is None:
            self._started = tick
            # The KV cache for this generation in one allocation (it grows on demand past it, e.g. a wide tree),
            # at most `RESERVE_AHEAD` new tokens' worth: a server request without max_tokens may ask for the
            # whole context, 377 MB of SmolLM2 cache per sequence.
            self.target.reset()
            ahead = min(self.max_new_tokens, RESERVE_AHEAD)
            self.target.reserve(self.prompt.numel() + ahead + DRAFT_MARGIN)
            return Block(self.prompt, None, None, self.drafter.features, last_logits_only=True)
        # Never draft past the token budget or the context: a tree of depth d yields at most d + 1 tokens
        # (d drafts and the target's bonus token), and the context already holds the uncommitted root,
        # so d + 1 new tokens fit only if d <= max_length - len(context) - 1. The verify forward itself
        # needs one cache slot per tree node: the root's and the drafts' (`room`).
        target, stats = self.target, self.stats
        room = target.max_length - target.length
        caps, probe = DepthCaps(max_depth, dict(kind_depth or {})), None
        if self.budget is not None and max_depth is None and kind_depth is None:
            caps, probe = self.budget.caps(batch), self._probe
        max_depth = caps.deepest if probe is None or caps.deepest is None else max(caps.deepest, probe)
        self._alone = batch == 1
        depth = min(self.max_new_tokens - stats.new_tokens - 1, target.max_length - len(self.context) - 1)
        tree = self.drafter.propose(self.context, depth if max_depth is None else min(depth, max_depth),
                                    self.params, self.generator)
        self.draft_cap, self.draft_chain_only = caps.cap(tree.kind)
        if probe is not None and self.draft_cap is not None:
            # The last draft was accepted whole at its cap: this one may go a level deeper, so that the budget
            # learns whether the next level pays (a cap hides it: its acceptance is measured only when drafted).
            self.draft_cap = max(self.draft_cap, probe)
        self._tree = tree.prune(depth if self.draft_cap is None else min(depth, self.draft_cap), room,
                                self.draft_chain_only)
        self._proposed = time.perf_counter()
        self._draft_seconds = self._proposed - tick
        stats.draft_time += self._draft_seconds
        tree = self._tree
        if self.budget is not None:
            self._drafted = self.nodes_per_depth
        return Block(tree.tokens, tree.ancestor_mask(), tree.depths, self.drafter.features)

    def advance(self, out: ForwardOutput) -> list[int]:
        """Take the target's output for the last `block`; returns the new token ids (sets ``stats.stop_reason``
        when the generation is over)."""
        target, stats = self.target, self.stats
        if self.context is None:
            target.commit()
            first = pick_token(out.logits[-1], self.params, self.generator)
            self.drafter.start(self.prompt, out)
            stats.prefill_time = time.perf_counter() - self._started
            stats.cycles, stats.new_tokens = 1, 1
            self.context = torch.cat([self.prompt, torch.tensor([first], device=target.device)])
            new = [first]
        else:
            tree = self._tree
            result = self.acceptor(tree, out.logits, self.params, self.generator)
            target.commit(result.accepted_nodes)
            self.drafter.observe(tree.tokens[result.accepted_nodes], out.select(result.accepted_nodes))
            verify_seconds = time.perf_counter() - self._proposed
            stats.verify_time += verify_seconds
            if self.budget is not None:
                chain, path = tree.main_chain(), result.accepted_nodes[1:]
                on_chain = 0  # the main chain's nodes accepted: how far the accepted path follows it
                while on_chain < min(len(chain), len(path)) and path[on_chain] == chain[on_chain]:
                    on_chain += 1
                self.budget.observe(self._drafted, result.accepted_drafts, self._draft_seconds, cap=self.draft_cap,
                                    kind=tree.kind, chain=(len(chain), on_chain), chain_only=self.draft_chain_only,
                                    verify_seconds=verify_seconds if self._alone else None)
                cap = self.draft_cap
                self._probe = cap + 1 if cap and result.accepted_drafts >= cap else None
            new = tree.tokens[result.accepted_nodes[1:]].tolist() + [result.next_token]
            new = _clip(new, self.eos, min(self.max_new_tokens - stats.new_tokens,
                                           target.max_length - len(self.context)))
            self.context = torch.cat([self.context, torch.tensor(new, device=target.device)])
            stats.cycles += 1
            stats.new_tokens += len(new)
            stats.accepted_lengths.append(result.accepted_drafts)
            stats.tree_sizes.append(len(tree) - 1)
            if stats.record_nodes:
                stats.nodes.append(node_records(tree, result.accepted_nodes))
            self._tree = None
        stats.stop_reason = _stop_reason(new, self.eos, stats.new_tokens, self.max_new_tokens, len(self.context),
                                         target)
        stats.total_time = time.perf_counter() - self._started
        return new


def stream_tokens(target: Target, drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int,
                  params: SamplingParams, seed: int | None = None, stop_on_eos: bool = True,
                  acceptor: Acceptor | None = None, stats: GenerationStats | None = None,
                  budget: DraftBudget | None = None) -> Iterator[list[int]]:
    """Yield the new token ids of each cycle. ``prompt`` is int64 [P]; ``stats`` is filled in as it runs; ``budget``
    caps each cycle's draft (see `Sequence`)."""
    sequence = Sequence(target, drafter, prompt, max_new_tokens, params, seed, stop_on_eos, acceptor, stats, budget)
    while not sequence.done:
        yield sequence.advance(sequence.block().run(target))


def warm_up(target: Target, drafter: Drafter, max_block: int = WARM_UP_BLOCK) -> None:
    """Compile now what a run of ``drafter`` on a compiled ``target`` will meet (the target's blocks of up to
    ``max_block`` tokens with the drafter's features, and the drafter's own compiled steps where it has a
    ``warm_up``), so that no timed question or served request pays for a compilation. Nothing unless compiled."""
    if not target.compiled:
        return
    target.warm_up(max_block, drafter.features)
    drafter_warm_up = getattr(drafter, "warm_up", None)  # drafters that compile steps of their own (a head's)
    if drafter_warm_up is not None:
        drafter_warm_up(max_block)


def node_records(tree: DraftTree, accepted_nodes: list[int]) -> list[tuple[float, bool, int]]:
    """(confidence, accepted, depth) of each node whose parent is on the accepted path, in node order.

    ``accepted_nodes`` runs from the root (0) to the last accepted node. Nodes under a rejected
    node were never judged, so they say nothing about acceptance and are left out.
    """
    on_path = set(accepted_nodes)
    tested = [i for i in range(1, len(tree)) if tree.parents[i] in on_path]
    if not tested:
        return []
    confidences = tree.node_confidences(tested) or [math.nan] * len(tested)
    depths = tree.depths
    return [(c, i in on_path, depths[i]) for c, i in zip(confidences, tested, strict=True)]


def _clip(new: list[int], eos: set[int], budget: int) -> list[int]:
    """Cut ``new`` after the first EOS and to at most ``budget`` tokens."""
    for i, token in enumerate(new):
        if token in eos:
            new = new[: i + 1]
            break
    return new[:budget]


def _stop_reason(new: list[int], eos: set[int], produced: int, max_new_tokens: int, length: int,
                 target: Target) -> str:
    if new and new[-1] in eos:
        return "eos"
    if produced >= max_new_tokens:
        return "max_new_tokens"
    if length >= target.max_length:
        return "context_length"
    return ""


def generate_tokens(target: Target, drafter: Drafter, prompt: torch.Tensor, max_new_tokens: int,
                    params: SamplingParams, seed: int | None = None, stop_on_eos: bool = True,
                    acceptor: Acceptor | None = None, record_nodes: bool = False,
                    budget: DraftBudget | None = None) -> tuple[list[int], GenerationStats]:
    """Run the loop to the end; returns (new token ids, stats). ``record_nodes``: see `GenerationStats`; ``budget``:
    see `Sequence`."""
    stats = GenerationStats(record_nodes=record_nodes)
    tokens: list[int] = []
    for chunk in stream_tokens(target, drafter, prompt, max_new_tokens, params, seed, stop_on_eos,
                               acceptor, stats, budget):
        tokens.extend(chunk)
    return tokens, stats
