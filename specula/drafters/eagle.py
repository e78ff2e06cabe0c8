"""`eagle` and `eagle2`: drafting trees with an EAGLE head over the target's features.

The head keeps its own KV cache of (feature f_i, token t_{i+1}) pairs for the
committed text. Each cycle it first catches up on the pairs of the tokens the
target just committed (their features come from the verification pass), which
predicts the feature of the root and so the first draft layer. It then grows a
tree: expanding a node feeds the pair (predicted feature of its parent, its
token) through the head, attending to the committed pairs and the node's own
ancestors, and the target's LM head turns the prediction into the next layer.
Draft entries are discarded from the head's cache after every cycle.

- `eagle` (EAGLE-1) grows a static tree given as paths of child ranks
  ("choices", as Medusa writes them): [[0], [1], [0, 0]] means the top-2 tokens
  after the root and the top token after the best one.
- `eagle2` (EAGLE-2) grows a dynamic tree: a node's value is the product of draft
  confidences on its path; each of `depth` steps expands the `top_k` most valuable
  nodes of the newest layer, and finally the `total_tokens` most valuable drafted
  nodes are kept (ties toward shallower nodes), which always form a connected tree.

At temperature 0 children are the head's top-ranked tokens. At temperature > 0
they are drawn i.i.d. from the head's distribution warped like the target's, and
the acceptor's multi-round rule keeps the output exactly target-distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specula.errors import SpeculaError
from specula.heads.base import DraftHead
from specula.sampling import SamplingParams, probabilities
from specula.target import ForwardOutput, Target
from specula.tree import DraftTree
from specula.weights import quantize_every_linear

# A small static tree for CPUs, where verifying a node costs far more than on a GPU (see README).
DEFAULT_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0]]
# EAGLE-2 tree budgets: the paper's GPU setting, and the one measured best on a 2-core CPU
# (pycoder-25m with its EAGLE head, 8 code prompts x 96 tokens: 10/5/2 gave 1.41x, 16/5/4 1.10x,
# 60/6/10 0.79x; verifying and drafting wide trees costs far more here than on a GPU).
CUDA_DYNAMIC = {"total_tokens": 60, "depth": 6, "top_k": 10}
CPU_DYNAMIC = {"total_tokens": 10, "depth": 5, "top_k": 2}
EAGLE2_BUDGETS = {"cuda": CUDA_DYNAMIC, "cpu": CPU_DYNAMIC}
# EAGLE-3: the paper's GPU setting (depth 8, same node budget), and on a 2-core CPU the best measured
# (pycoder-25m with its EAGLE-3 head, 8 code prompts x 96 tokens, interleaved: 10/5/2 1.43x, 8/8/1 1.40x,
# 14/6/2 1.38x, 10/8/2 1.29x, 12/8/2 1.21x, 16/8/3 1.15x; deeper trees raise tau but cost more than they save).
EAGLE3_BUDGETS = {"cuda": {"total_tokens": 60, "depth": 8, "top_k": 10},
                  "cpu": {"total_tokens": 10, "depth": 5, "top_k": 2}}


@dataclass
class _Node:
    token: int
    parent: int  # index among drafted nodes, -1 for a child of the root
    depth: int
    value: float  # log of the product of draft confidences on the path
    slot: int = -1  # row of this node's pair in the head cache block, once fed
    q: torch.Tensor | None = None  # the distribution the token was sampled from (None: chosen by rank)


class EagleDrafter:
    """Drafts trees with any `DraftHead` (EAGLE-1 or EAGLE-3).

    ``budgets`` gives the dynamic tree's default total_tokens/depth/top_k per device type ("cuda", "cpu").
    """

    def __init__(self, target: Target, head: DraftHead, dynamic: bool, name: str | None = None,
                 choices: list[list[int]] | None = None, total_tokens: int | None = None,
                 depth: int | None = None, top_k: int | None = None, budgets: dict | None = None):
        if head.hidden_size != target.config.hidden_size:
            raise SpeculaError(f"EAGLE head hidden size {head.hidden_size} does not fit the target's "
                               f"{target.config.hidden_size}")
        head_vocab = head.config.get("vocab_size", target.vocab_size)
        if head_vocab != target.vocab_size:
            raise SpeculaError(f"EAGLE head vocabulary {head_vocab} does not fit the target's {target.vocab_size}")
        self.name = name or ("eagle2" if dynamic else "eagle")
        self.target = target
        self.head = head.to(device=target.device, dtype=target.dtype).attach(target)
        # Drafting follows the target's weight format: the head's numbers only change what is proposed.
        quantize_every_linear(self.head, target.weights)
        self.features = head.feature_request()
        self.embed = target.model.get_input_embeddings()
        self.dynamic = dynamic
        budget = (budgets or EAGLE2_BUDGETS)["cuda" if target.device.type == "cuda" else "cpu"]
        self.total_tokens = total_tokens or budget["total_tokens"]
        self.depth = depth or budget["depth"]
        self.top_k = top_k or budget["top_k"]
        self.choices = sorted(choices or DEFAULT_CHOICES, key=lambda path: (len(path), path))
        if min(self.total_tokens, self.depth, self.top_k) < 1:
            raise SpeculaError("eagle2 needs total_tokens, depth and top_k >= 1")
        # Checked here, not mid-generation: the tokens a head can draft bound the children per node.
        draftable = int(getattr(head, "draft_vocab_size", target.vocab_size))
        widest = self.top_k if dynamic else 1 + max(path[-1] for path in self.choices)
        if widest > draftable:
            what = f"top_k {self.top_k}" if dynamic else f"a tree rank of {widest - 1}"
            raise SpeculaError(f"{what} asks for more children per node than the {draftable} tokens the head drafts")
        self.cache = head.new_cache(target.max_length + self.total_tokens + 64)
        self.pending: torch.Tensor | None = None  # target features not yet paired with their next token

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        self.cache.truncate(0)
        self.pending = self.head.target_features(target_out)

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        self.pending = self.head.target_features(target_out)

    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        self._params, self._generator = params, generator
        # Catch up: pair each new feature f_i with t_{i+1}; the last pair ends with the root.
        count = self.pending.shape[0]
        start = self.cache.length
        positions = torch.arange(start, start + count, device=context.device)
        predicted = self.head.step(self.pending, self.embed(context[-count:]), positions, self.cache, None)
        self.cache.commit()
        root_feature = predicted[-1:]
        committed = self.cache.length
        depth = min(self.depth if self.dynamic else max(map(len, self.choices)), max_depth)
        if depth <= 0:
            return DraftTree.root_only(int(context[-1]), device=context.device)
        try:
            nodes = self._grow(root_feature, depth) if self.dynamic else self._grow_static(root_feature, depth)
        finally:
            self.cache.truncate(committed)
        return _as_tree(int(context[-1]), nodes, context.device)

    # ---------------------------------------------------------------- tree growth

    def _log_probs(self, features: torch.Tensor) -> torch.Tensor:
        return self.head.token_log_probs(features)

    def _children(self, log_probs: torch.Tensor, count: int):
        """``count`` child tokens per row of log_probs [rows, V]: (tokens, log-confidences, q or None).

        Greedy decoding takes the top ``count``. At temperature > 0 the children are drawn i.i.d. from
        the head's distribution warped like the target's (q), which the acceptor then accepts with
        min(1, p/q): far more often than a point-mass top-k guess is accepted with p(x).
        """
        if self._params.greedy:
            best = torch.topk(log_probs, count, dim=-1)
            return best.indices, best.values, None
        q = probabilities(log_probs, self._params)
        tokens = torch.multinomial(q, count, replacement=True, generator=self._generator)
        return tokens, torch.log(q.gather(-1, tokens)), q

    def _feed(self, nodes: list[_Node], frontier: list[int], parent_features: torch.Tensor,
              fed: list[int], committed: int) -> torch.Tensor:
        """Run the pairs of ``frontier`` nodes through the head; returns their predicted features [len, H]."""
        device = parent_features.device
        tokens = torch.tensor([nodes[i].token for i in frontier], device=device)
        positions = torch.tensor([committed + nodes[i].depth - 1 for i in frontier], device=device)
        # Each new pair sees every committed pair and the pairs of its own ancestors.
        block = len(fed) + len(frontier)
        mask = torch.ones(len(frontier), committed + block, dtype=torch.bool, device=device)
        mask[:, committed:] = False
        for row, index in enumerate(frontier):
            nodes[index].slot = len(fed) + row
            ancestor = index
            while ancestor >= 0:
                mask[row, committed + nodes[ancestor].slot] = True
                ancestor = nodes[ancestor].parent
        out = self.head.step(parent_features, self.embed(tokens), positions, self.cache, mask[None, None],
                             own_features=True)
        self.cache.commit()
        fed.extend(frontier)
        return out

    def _grow(self, root_feature: torch.Tensor, depth: int) -> list[_Node]:
        """EAGLE-2: expand the most valuable nodes layer by layer, then keep the best ``total_tokens``."""
        committed = self.cache.length
        tokens, confidences, q = self._children(self._log_probs(root_feature), self.top_k)
        nodes = [_Node(int(t), -1, 1, float(v), q=None if q is None else q[0])
                 for v, t in zip(confidences[0], tokens[0], strict=True)]
        frontier = list(range(len(nodes)))
        frontier_inputs = root_feature.expand(len(frontier), -1)
        fed: list[int] = []
        for _ in range(depth - 1):
            predicted = self._feed(nodes, frontier, frontier_inputs, fed, committed)
            tokens, confidences, q = self._children(self._log_probs(predicted), self.top_k)
            values = torch.tensor([nodes[i].value for i in frontier], device=confidences.device)
            totals = (values[:, None] + confidences).flatten()
            first_child = len(nodes)
            for row, parent in enumerate(frontier):
                for col in range(self.top_k):
                    nodes.append(_Node(int(tokens[row, col]), parent, nodes[parent].depth + 1,
                                       float(totals[row * self.top_k + col]), q=None if q is None else q[row]))
            # Only the top_k most valuable new nodes are expanded further.
            chosen = torch.topk(totals, self.top_k).indices.tolist()
            frontier = [first_child + c for c in chosen]
            frontier_inputs = predicted[[c // self.top_k for c in chosen]]
        if not self._params.greedy:
            # Sampled siblings must stay i.i.d. draws from q for the acceptor to be lossless, so none may
            # be dropped for its value: keep nodes in creation order (sample order within siblings).
            return _subset(nodes, list(range(min(len(nodes), self.total_tokens))))
        # Rerank: a child's value never exceeds its parent's, so the best nodes (ties: shallower first)
        # include every kept node's ancestors.
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].value, nodes[i].depth, i))
        return _subset(nodes, order[: self.total_tokens])

    def _grow_static(self, root_feature: torch.Tensor, depth: int) -> list[_Node]:
        """EAGLE-1: children of each node by rank, as listed in ``choices``."""
        committed = self.cache.length
        paths = [tuple(p) for p in self.choices if len(p) <= depth]
        index_of: dict[tuple[int, ...], int] = {}
        nodes: list[_Node] = []
        features = {(): root_feature[0]}
        fed: list[int] = []
        for level in range(1, depth + 1):
            parents = sorted({p[:-1] for p in paths if len(p) == level and p[:-1] in features})
            if not parents:
                break
            widest = 1 + max(p[-1] for p in paths if len(p) == level)
            ranked, confidences, q = self._children(self._log_probs(torch.stack([features[p] for p in parents])),
                                                    widest)
            new = []
            for row, parent in enumerate(parents):
                for path in (p for p in paths if len(p) == level and p[:-1] == parent):
                    token = int(ranked[row, path[-1]])
                    parent_index = index_of.get(parent, -1)
                    base = nodes[parent_index].value if parent_index >= 0 else 0.0
                    value = base + float(confidences[row, path[-1]])
                    index_of[path] = len(nodes)
                    nodes.append(_Node(token, parent_index, level, value, q=None if q is None else q[row]))
                    new.append(path)
            if level < depth and any(len(p) > level for p in paths):
                expandable = [p for p in new if any(q[:level] == p and len(q) > level for q in paths)]
                if expandable:
                    inputs = torch.stack([features[p[:-1]] for p in expandable])
                    predicted = self._feed(nodes, [index_of[p] for p in expandable], inputs, fed, committed)
                    features.update(zip(expandable, predicted, strict=True))
        return nodes


def _subset(nodes: list[_Node], keep: list[int]) -> list[_Node]:
    """The kept nodes in depth order with parents re-indexed (every kept node's parent is kept)."""
    keep = sorted(keep, key=lambda i: (nodes[i].depth, i))
    new_index = {old: new for new, old in enumerate(keep)}
    return [_Node(nodes[i].token, new_index.get(nodes[i].parent, -1), nodes[i].depth, nodes[i].value, q=nodes[i].q)
            for i in keep]


def _as_tree(root: int, nodes: list[_Node], device: torch.device) -> DraftTree:
    """DraftTree with the root as node 0 and drafted node i as node i + 1 (parents come first)."""
    tokens = torch.tensor([root] + [n.token for n in nodes], dtype=torch.long, device=device)
    draft_probs = None
    if nodes and nodes[0].q is not None:
        draft_probs = torch.stack([torch.zeros_like(nodes[0].q)] + [n.q for n in nodes])
    # A node's value is the log of its path's confidence product: the step from its parent is its own.
    confidences = torch.tensor([1.0] + [math.exp(n.value - (nodes[n.parent].value if n.parent >= 0 else 0.0))
                                        for n in nodes])
    return DraftTree(tokens, [-1] + [n.parent + 1 for n in nodes], draft_probs, confidences)
