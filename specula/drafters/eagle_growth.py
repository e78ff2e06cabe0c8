"""How an EAGLE drafter's tree grows: the drafted nodes as tensors, and EAGLE-2's level step at fixed shapes.

A dynamic tree (EAGLE-2) grows by repeating one level: the newest layer's ``top_k`` most valuable nodes (the
frontier) go through the head as (parent's predicted feature, own token) pairs, attending to the committed pairs
and to their own ancestors' pairs; each gets its ``top_k`` likeliest children, valued by the log of their path's
confidence product; the ``top_k`` most valuable children become the next frontier. Every level has the same
shapes: k pairs at position committed + level, written to the head-cache slots after the earlier levels' pairs.
So a whole level (embedding, head step, top tokens, values, the frontier's choice, its attention mask and
positions) is one function of tensors, `grow_level`, which a compiled drafter runs as one graph for every level:
no Python bookkeeping and no host sync per level, the tree read back once it is final.

Eager, the same level was ~25 small operations around the head step and its top tokens (SmolLM2's EAGLE-3 head
in q4_1, compiled target, one thread: a level cost 1.0-2.2 ms on top of the first node, of which the head step
0.75 ms and the top tokens 0.57 ms).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specula.runtime.compiled_step import allocate_whole, bucket, graph_function
from specula.runtime.precompiled import Precompiled
from specula.runtime.static_cache import SlotBlock, StaticKVCache
from specula.tree import DraftTree

# children(predicted [k, H], count) -> (tokens [k, count], log-confidences [k, count], q [k, V] or None)
Children = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


@dataclass
class DraftedNodes:
    """Drafted nodes (the root excluded) as tensors, in creation order (parents before children).

    tokens, parents (-1: child of the root), depths (1 for the root's children): int64 [N];
    values: float32 [N], log of the product of draft confidences on the path;
    ancestors: bool [N, N], row i marks i and its drafted ancestors (a static tree's growth keeps it; a dynamic
    one's levels mask with their frontier's lineage instead, `grow_level`), or None;
    q_index: int64 [N], row of ``q_rows`` each token was sampled from (sampling only).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    values: torch.Tensor
    ancestors: torch.Tensor | None
    q_index: torch.Tensor
    q_rows: list[torch.Tensor]

    @classmethod
    def empty(cls, device: torch.device) -> DraftedNodes:
        long = torch.empty(0, dtype=torch.long, device=device)
        return cls(long, long, long, torch.empty(0, device=device), torch.empty(0, 0, dtype=torch.bool, device=device),
                   long, [])

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def add(self, tokens: torch.Tensor, parents: torch.Tensor, log_confidences: torch.Tensor,
            q: torch.Tensor | None, q_rows: torch.Tensor) -> torch.Tensor:
        """Append children ``tokens`` [M] of ``parents`` [M] (-1: the root), each with the log of the draft's
        confidence in it given its parent [M]; q [R, V] and q_rows [M] say which distribution each was sampled
        from. Returns the new nodes' indices [M]."""
        n, m = len(self), tokens.shape[0]
        device = tokens.device
        is_child = parents >= 0
        parent_depths = torch.where(is_child, self.depths[parents.clamp(min=0)] if n else 0, 0)
        parent_values = torch.where(is_child, self.values[parents.clamp(min=0)] if n else 0, 0.0)
        grown = torch.zeros(n + m, n + m, dtype=torch.bool, device=device)
        grown[:n, :n] = self.ancestors
        if n:
            grown[n:, :n] = self.ancestors[parents.clamp(min=0)] & is_child[:, None]
        grown[n:, n:] = torch.eye(m, dtype=torch.bool, device=device)
        self.ancestors = grown
        if q is not None:
            offset = sum(rows.shape[0] for rows in self.q_rows)
            self.q_rows.append(q)
            self.q_index = torch.cat([self.q_index, q_rows + offset])
        self.tokens = torch.cat([self.tokens, tokens])
        self.parents = torch.cat([self.parents, parents])
        self.depths = torch.cat([self.depths, parent_depths + 1])
        self.values = torch.cat([self.values, (parent_values + log_confidences).float()])
        return torch.arange(n, n + m, device=device)

    def subset(self, keep: torch.Tensor) -> DraftedNodes:
        """The nodes ``keep`` (every kept node's parent kept too) in (depth, creation) order, parents re-indexed."""
        keep = keep.sort().values
        keep = keep[torch.argsort(self.depths[keep], stable=True)]
        new_index = torch.full((len(self),), -1, dtype=torch.long, device=keep.device)
        new_index[keep] = torch.arange(keep.shape[0], device=keep.device)
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], -1)
        q_index = self.q_index[keep] if self.q_rows else self.q_index
        ancestors = None if self.ancestors is None else self.ancestors[keep][:, keep]
        return DraftedNodes(self.tokens[keep], parents, self.depths[keep], self.values[keep], ancestors, q_index,
                            self.q_rows)

    def as_tree(self, root: int) -> DraftTree:
        """DraftTree with the root as node 0 and drafted node i as node i + 1 (one host transfer: the parents)."""
        device = self.tokens.device
        tokens = torch.cat([torch.tensor([root], dtype=torch.long, device=device), self.tokens])
        draft_probs = None
        if self.q_rows and len(self):
            q = torch.cat(self.q_rows)[self.q_index]
            draft_probs = torch.cat([torch.zeros_like(q[:1]), q])
        # A node's value is the log of its path's confidence product: the step from its parent is its own.
        parent_values = torch.where(self.parents >= 0, self.values[self.parents.clamp(min=0)], 0.0)
        confidences = torch.cat([torch.ones(1), torch.exp(self.values - parent_values).cpu()])
        parents = [-1] + (self.parents + 1).tolist()
        return DraftTree(tokens, parents, draft_probs, confidences)


@dataclass
class Frontier:
    """The k nodes a level expands, all at the same depth (the level + 1).

    rows: int64 [k], each node's index among the layer it was chosen from (the root's children, or the previous
    level's k * k children); tokens int64 [k]; values float32 [k] (log path confidence); inputs [k, H], the predicted
    feature each node's pair is fed with (its parent's); lineage bool [k, F], the head-cache slots after the
    committed pairs (F = (depth - 1) * k, level l's pairs at l * k ...) holding the node's fed ancestors' pairs
    and, once fed, its own.
    """

    rows: torch.Tensor
    tokens: torch.Tensor
    values: torch.Tensor
    inputs: torch.Tensor
    lineage: torch.Tensor


def greedy_children(head) -> Children:
    """The head's top tokens as each row's children (greedy drafting: no distributions)."""
    return lambda predicted, count: (*head.top_tokens(predicted, count), None)


def grow_level(head, embed: torch.nn.Module, cache: StaticKVCache, frontier: Frontier, committed: torch.Tensor,
               level: torch.Tensor, end: torch.Tensor, rows: int, children: Children | None = None):
    """One level of an EAGLE-2 tree: feed ``frontier``'s k pairs through ``head`` and choose the next frontier.

    committed: 0-d int64, the head cache's committed pairs; level: 0-d int64, how many levels were fed before
    (the frontier's pairs go to slots committed + level * k ...); end: 0-d int64 on the CPU, the last slot this
    block writes + 1; rows: k padded to the compiled step's bucket (padding rows attend only to themselves and
    write slots the next level overwrites). ``children``: how each node's k children are chosen (None: the
    head's top tokens, `greedy_children`). The cache must be allocated past the tree (`allocate_whole`).

    Returns (children's tokens [k * k] row-major by parent, their values [k * k], the distributions they were
    drawn from [k, V] or None, the next `Frontier`).
    """
    k, device = frontier.tokens.shape[0], frontier.tokens.device
    fed = frontier.lineage.shape[1]
    first = committed + level * k  # this level's first head-cache slot
    indices = first + torch.arange(rows, device=device)
    # What each row sees over the whole allocation: the committed pairs, then its lineage; a padding row itself.
    offsets = torch.arange(cache.allocated, device=device) - committed
    lineage = frontier.lineage[:, offsets.clamp(0, fed - 1)] & (offsets >= 0) & (offsets < fed)
    mask = torch.cat([lineage | (offsets < 0), indices[k:, None] == offsets[None] + committed])
    pad = rows - k
    inputs = torch.cat([frontier.inputs, frontier.inputs.new_zeros(pad, frontier.inputs.shape[1])])
    tokens = torch.cat([frontier.tokens, frontier.tokens.new_zeros(pad)])
    positions = (committed + level).expand(rows)  # every frontier node is at depth level + 1
    predicted = head.step(inputs, embed(tokens), positions, cache, mask[None, None], own_features=True,
                          slots=SlotBlock(indices, end))[:k]
    child_tokens, log_confidences, q = (children or greedy_children(head))(predicted, k)
    values = (frontier.values[:, None] + log_confidences.float()).flatten()
    chosen = torch.topk(values, k).indices  # only the k most valuable children are expanded further
    parents = chosen // k
    own = torch.arange(fed, device=device)[None] == (first - committed + k + torch.arange(k, device=device))[:, None]
    lineage = frontier.lineage[parents] | own
    next_frontier = Frontier(chosen, child_tokens.flatten()[chosen], values[chosen], predicted[parents], lineage)
    return child_tokens.flatten(), values, q, next_frontier


def first_frontier(tokens: torch.Tensor, log_confidences: torch.Tensor, root_feature: torch.Tensor,
                   depth: int) -> Frontier:
    """The root's k children (tokens, log-confidences [k]) as the first level's frontier, for a tree of ``depth``
    levels: each node's pair is fed with the root's predicted feature [1, H] and sees its own slot."""
    k = tokens.shape[0]
    lineage = torch.eye(k, (depth - 1) * k, dtype=torch.bool, device=tokens.device)
    # Contiguous, as every later level's are: a compiled level's graph is specialised to its inputs' strides.
    return Frontier(torch.arange(k, device=tokens.device), tokens.contiguous(), log_confidences.float().contiguous(),
                    root_feature.expand(k, -1).contiguous(), lineage)


def assemble(root_tokens: torch.Tensor, root_values: torch.Tensor, levels: list, root_q: torch.Tensor | None,
             k: int) -> DraftedNodes:
    """The drafted nodes of a grown dynamic tree, in creation order: the root's k children (tokens, values [k],
    drawn from ``root_q`` [1, V] or chosen), then each level's k * k children (``levels``: per level, the
    `Frontier` it expanded and `grow_level`'s tokens, values and q)."""
    device = root_tokens.device
    tokens, values, parents, depths = [root_tokens], [root_values], [torch.full((k,), -1, device=device)], [1]
    q_rows = [] if root_q is None else [root_q]
    q_index = [torch.zeros(k, dtype=torch.long, device=device)]
    layer_start = 0  # index of the first node of the layer the frontier was chosen from
    for level, (frontier, child_tokens, child_values, q) in enumerate(levels):
        tokens.append(child_tokens)
        values.append(child_values)
        parents.append((layer_start + frontier.rows).repeat_interleave(k))
        depths.append(level + 2)
        q_index.append(torch.arange(k, device=device).repeat_interleave(k) + 1 + level * k)
        if q is not None:
            q_rows.append(q)
        layer_start += k if level == 0 else k * k
    counts = torch.tensor([t.shape[0] for t in tokens], device=device)
    depths = torch.tensor(depths, device=device).repeat_interleave(counts)
    return DraftedNodes(torch.cat(tokens), torch.cat(parents), depths, torch.cat(values), None,
                        torch.cat(q_index) if q_rows else q_index[0][:0], q_rows)


def _level_graph(head, embed, cache, rows_from, tokens, values, inputs, lineage, committed, level, end, rows):
    """`grow_level` with greedy children, its `Frontier`s as tensors (what a compiled graph takes and gives)."""
    frontier = Frontier(rows_from, tokens, values, inputs, lineage)
    child_tokens, child_values, _, after = grow_level(head, embed, cache, frontier, committed, level, end, rows)
    return child_tokens, child_values, after.rows, after.tokens, after.values, after.inputs, after.lineage


class LevelStep:
    """A drafter's `grow_level`: with ``compile``, greedy levels run as one compiled graph (padded to the block
    buckets of the head's steps, `specula.runtime.compiled_step`); sampled levels, and every level of an eager
    drafter, run the same function eagerly."""

    def __init__(self, head, embed: torch.nn.Module, compile: bool, device: torch.device):
        self.head, self.embed = head, embed
        self.graph = Precompiled(graph_function(head, _level_graph, embed), device) if compile else None

    def __call__(self, cache: StaticKVCache, frontier: Frontier, committed: int, level: int,
                 children: Children | None):
        """`grow_level` for ``frontier`` after ``committed`` pairs and ``level`` fed levels."""
        k, device = frontier.tokens.shape[0], frontier.tokens.device
        compiled_level = self.graph is not None and children is None
        rows = bucket(k, device) if compiled_level else k
        if compiled_level:
            allocate_whole(cache)  # the allocation is a shape (the drafter's cache has room for every level)
        else:
            cache.reserve(committed + level * k + rows)
        end = torch.tensor(committed + level * k + rows)
        committed_at, level_at = (torch.tensor(value, device=device) for value in (committed, level))
        if not compiled_level:
            return grow_level(self.head, self.embed, cache, frontier, committed_at, level_at, end, rows, children)
        child_tokens, values, *after = self.graph(self.head, self.embed, cache, frontier.rows, frontier.tokens,
                                                  frontier.values, frontier.inputs, frontier.lineage, committed_at,
                                                  level_at, end, rows)
        return child_tokens, values, None, Frontier(*after)
