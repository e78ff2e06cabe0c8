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

import copy
import math

import torch

from specula.drafters.eagle_growth import DraftedNodes, LevelStep, assemble, first_frontier, greedy_children
from specula.errors import SpeculaError
from specula.heads.base import DraftHead
from specula.runtime.compiled_step import HeadStep, warm_up_blocks
from specula.runtime.target import ForwardOutput, Target
from specula.runtime.weights import quantize_every_linear
from specula.sampling import SamplingParams, probabilities, sample_rows
from specula.tree import DraftTree

# EAGLE-1's static tree per device type and the EAGLE-2/3 budgets (total_tokens / depth / top_k): the papers'
# GPU settings; on a CPU one draft node, the best measured on the reference target (docs/defaults.md).
GPU_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0]]
STATIC_TREES = {"cuda": GPU_CHOICES, "cpu": [[0]]}
CUDA_DYNAMIC = {"total_tokens": 60, "depth": 6, "top_k": 10}
CPU_DYNAMIC = {"total_tokens": 1, "depth": 1, "top_k": 1}
EAGLE2_BUDGETS = {"cuda": CUDA_DYNAMIC, "cpu": CPU_DYNAMIC}
# Head-cache slots past the context for a tree's pairs and a padded block's rows (GPU_CHOICES: 10 pairs; the GPU
# dynamic budgets: 5 and 7 levels of 10; with 64 padding rows at most 134).
DRAFT_SLOTS = 256
EAGLE3_BUDGETS = {"cuda": {"total_tokens": 60, "depth": 8, "top_k": 10}, "cpu": CPU_DYNAMIC}


def budget_device(device: torch.device) -> str:
    """The key of the default budgets and static trees a target on ``device`` drafts with: the papers' GPU settings
    on CUDA, the CPU's everywhere else."""
    return "cuda" if device.type == "cuda" else "cpu"


def check_head_fits(head: DraftHead, hidden_size: int, vocab_size: int) -> None:
    """An EAGLE or EAGLE-3 head drafts only for a target of its hidden size and vocabulary."""
    if head.hidden_size != hidden_size:
        raise SpeculaError(f"EAGLE head hidden size {head.hidden_size} does not fit the target's {hidden_size}")
    head_vocab = head.config.get("vocab_size", vocab_size)
    if head_vocab != vocab_size:
        raise SpeculaError(f"EAGLE head vocabulary {head_vocab} does not fit the target's {vocab_size}")


def root_children_tree(root: torch.Tensor, tokens: torch.Tensor, log_confidences: torch.Tensor,
                       draft_probs: torch.Tensor | None) -> DraftTree:
    """A tree of depth 1: the root [1] and its children ``tokens`` [k] with the draft's log-confidences [k] in them;
    ``draft_probs`` [k + 1, V] (a zero row for the root) or None for chosen, not sampled, children."""
    confidences = torch.cat([torch.ones(1), log_confidences.float().exp().cpu()])
    return DraftTree(torch.cat([root, tokens]), [-1] + [0] * tokens.shape[0], draft_probs, confidences)


class EagleDrafter:
    """Drafts trees with any `DraftHead` (EAGLE-1 or EAGLE-3).

    ``budgets`` gives the dynamic tree's default total_tokens/depth/top_k per device type ("cuda", "cpu"),
    `STATIC_TREES` the static tree's default ``choices``.
    """

    def __init__(self, target: Target, head: DraftHead, dynamic: bool, name: str | None = None,
                 choices: list[list[int]] | None = None, total_tokens: int | None = None,
                 depth: int | None = None, top_k: int | None = None, budgets: dict | None = None,
                 min_confidence: float | None = None):
        check_head_fits(head, target.config.hidden_size, target.vocab_size)
        self.name = name or ("eagle2" if dynamic else "eagle")
        self.target = target
        self.head = head.to(device=target.device, dtype=target.dtype).attach(target)
        # Drafting follows the target's weight format: the head's numbers only change what is proposed.
        quantize_every_linear(self.head, target.weights)
        # A compiled target's drafter compiles its head's steps too (after quantizing: the graph calls the
        # format's kernels).
        self.head_step = HeadStep(self.head, target.compiled, target.device)
        self.features = head.feature_request()
        self.embed = target.model.get_input_embeddings()
        self.dynamic = dynamic
        device = budget_device(target.device)
        budget = (budgets or EAGLE2_BUDGETS)[device]
        self.total_tokens = total_tokens or budget["total_tokens"]
        self.depth = depth or budget["depth"]
        self.top_k = top_k or budget["top_k"]
        # EAGLE-2's node value as a stop rule: no level grows under a layer whose best path is less likely.
        self.min_confidence = budget.get("min_confidence", 0.0) if min_confidence is None else min_confidence
        self.choices = sorted(choices or STATIC_TREES[device], key=lambda path: (len(path), path))
        self._plans: dict[int, list[dict]] = {}  # static tree growth per depth (`_static_plan`)
        if min(self.total_tokens, self.depth, self.top_k) < 1:
            raise SpeculaError("eagle2 needs total_tokens, depth and top_k >= 1")
        # Checked here, not mid-generation: the tokens a head can draft bound the children per node.
        draftable = int(getattr(head, "draft_vocab_size", target.vocab_size))
        widest = self.top_k if dynamic else 1 + max(path[-1] for path in self.choices)
        if widest > draftable:
            what = f"top_k {self.top_k}" if dynamic else f"a tree rank of {widest - 1}"
            raise SpeculaError(f"{what} asks for more children per node than the {draftable} tokens the head drafts")
        # Room past the context for the drafted pairs: a static tree's nodes, or a dynamic tree's depth - 1 levels
        # of top_k pairs (`grow_level` writes level l at committed + l * top_k ...), and a padded block's rows.
        # One size for every budget up to `DRAFT_SLOTS`: the allocation is a compiled graph's shape, and drafters
        # of several budgets in one process (a sweep, a bench) then share their graphs (with a size per budget
        # they met dynamo's recompile limit and ran eager: 0.6x vanilla).
        drafted = max(self.total_tokens, self.depth * self.top_k, len(self.choices))
        self.cache = head.new_cache(target.max_length + max(DRAFT_SLOTS, drafted + 64))
        self.level_step = LevelStep(self.head, self.embed, target.compiled, target.device)
        self.pending: torch.Tensor | None = None  # target features not yet paired with their next token

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        self.cache.truncate(0)
        self.pending = self.head.target_features(target_out)

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        # Features not yet fed to the head pile up while no drafting is asked for (depth 0: a batched server
        # whose budget says drafting does not pay); the next draft feeds them all in one head step.
        features = self.head.target_features(target_out)
        self.pending = features if self.pending is None else torch.cat([self.pending, features])

    def warm_up(self, max_block: int) -> None:
        """Compile now the head steps a generation meets (nothing unless the head step is compiled): the catch-up
        step over every padded size of up to ``max_block`` pairs, plain and with the greedy one-level top tokens,
        and a greedy tree level (a dynamic tree's), so that no timed draft pays for a compilation. A static tree's
        deeper levels still compile when met.
        Leaves the target's and the head's caches empty."""
        if self.head_step.graph is None:
            return
        target = self.target
        token = torch.zeros(1, dtype=torch.long, device=target.device)
        feature = self.head.target_features(target.prefill(token, self.features))  # [1, F]
        target.reset()
        embed = self.embed(token)
        self.cache.truncate(0)
        predicted = self.head_step(feature, embed, torch.zeros(1, dtype=torch.long, device=target.device),
                                   self.cache, None)
        self.cache.commit()  # a prefix: a compiled step never runs into an empty cache
        grows = self.dynamic and self.depth > 1
        # A plain catch-up, the greedy one-level draft's and a grown tree's (its root's top_k children).
        tops = {0, max(self._one_level_ranks()) + 1} | ({self.top_k} if grows else set())
        for size in warm_up_blocks(target.device, max_block):
            positions = torch.arange(1, 1 + size, device=target.device)
            for top in sorted(tops):
                self.head_step(feature.expand(size, -1), embed.expand(size, -1), positions, self.cache, None, top=top)
                self.cache.truncate(1)
        if grows:  # the one graph every greedy tree level runs
            root = token.expand(self.top_k)
            self.level_step(self.cache, first_frontier(root, torch.zeros(self.top_k), predicted, self.depth), 1, 0,
                            None)
        self.cache.truncate(0)
        self.pending = None

    def fork(self) -> EagleDrafter:
        other = copy.copy(self)  # the head and the static plans are shared; the state is its KV cache and pending
        other.cache = self.head.new_cache(self.cache.capacity)
        other.pending = None
        return other

    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        self._params, self._generator = params, generator
        depth = min(self.depth if self.dynamic else max(map(len, self.choices)), max_depth)
        if depth <= 0:
            return DraftTree.root_only(int(context[-1]), device=context.device)
        # Catch up: pair each new feature f_i with t_{i+1}; the last pair ends with the root.
        count = self.pending.shape[0]
        start = self.cache.length
        positions = torch.arange(start, start + count, device=context.device)
        embeds = self.embed(context[-count:])
        root_children = None
        if params.greedy and (depth == 1 or self.dynamic):
            # The root's children straight from the head's top tokens, in the same (compiled) call as the step.
            ranks = self._one_level_ranks() if depth == 1 else list(range(self.top_k))
            predicted, *root_children = self.head_step(self.pending, embeds, positions, self.cache, None,
                                                       top=max(ranks) + 1)
        else:
            predicted = self.head_step(self.pending, embeds, positions, self.cache, None)
        self.pending = None
        self.cache.commit()
        if depth == 1 and root_children:
            return self._one_level(*root_children, ranks, context[-1:])
        if depth == 1 and self.dynamic:  # sampled (T > 0): the root's children alone, without growing a tree
            return self._sampled_one_level(predicted[-1:], context[-1:])
        root_feature = predicted[-1:]
        committed = self.cache.length
        try:
            if self.dynamic:
                nodes = self._grow(root_feature, depth, root_children)
            else:
                nodes = self._grow_static(root_feature, depth)
        finally:
            self.cache.truncate(committed)
        return nodes.as_tree(int(context[-1]))

    # ---------------------------------------------------------------- tree growth

    def _one_level_ranks(self) -> list[int]:
        """The ranks of the root's children a greedy tree of depth 1 keeps: what growing and reranking would
        keep (a dynamic tree: its top min(top_k, total_tokens) children, best first; a static one: the ranks its
        depth-1 paths name)."""
        return (list(range(min(self.top_k, self.total_tokens))) if self.dynamic
                else [path[0] for path in self.choices if len(path) == 1])

    def _one_level(self, tokens: torch.Tensor, log_confidences: torch.Tensor, ranks: list[int],
                   root: torch.Tensor) -> DraftTree:
        """A greedy tree of depth 1 (the CPU default) from the head's top tokens [1, max(ranks) + 1] after the
        root [1] and their log-probabilities, without the growing and reranking bookkeeping (~0.3 ms of small
        tensor operations per draft on a CPU)."""
        if ranks != list(range(len(ranks))):
            tokens, log_confidences = tokens[:, ranks], log_confidences[:, ranks]
        return root_children_tree(root, tokens[0], log_confidences[0], None)

    def _sampled_one_level(self, root_feature: torch.Tensor, root: torch.Tensor) -> DraftTree:
        """A dynamic tree of depth 1 at T > 0 (the CPU default budget): the root's top_k children drawn from the
        head's q [1, V] and the first total_tokens of them kept, the tree `_grow` and `DraftedNodes.as_tree` give
        (the same draws, nodes and distributions) without their bookkeeping (~0.5 ms of small tensor operations per
        draft on a CPU, a sixth of merged eagle3's time at T=1)."""
        tokens, log_confidences, q = self._children(root_feature, self.top_k)
        keep = min(self.top_k, self.total_tokens)
        draft_probs = torch.cat([torch.zeros_like(q), q.expand(keep, -1)])
        return root_children_tree(root, tokens[0, :keep], log_confidences[0, :keep], draft_probs)

    def _children(self, features: torch.Tensor, count: int):
        """``count`` child tokens per row of predicted features [rows, H]: (tokens, log-confidences, q or None).

        Greedy decoding takes the head's top ``count``. At temperature > 0 the children are drawn i.i.d. from
        the head's distribution warped like the target's (q), which the acceptor then accepts with
        min(1, p/q): far more often than a point-mass top-k guess is accepted with p(x).
        """
        if self._params.greedy:
            return greedy_children(self.head)(features, count)
        # Drawn over the tokens the head can draft (EAGLE-3: its draft vocabulary, a sixth of SmolLM2's), the
        # distribution then widened with zeros to the target's vocabulary for the acceptor.
        logits, ids = self.head.drafted_logits(features)
        q = probabilities(logits, self._params)
        uniforms = torch.rand(q.shape[0], count, generator=self._generator, device=q.device)
        drawn = sample_rows(q, uniforms)  # i.i.d. draws from each row of q (`specula.sampling`)
        confidences = torch.log(q.gather(-1, drawn))
        if ids is None:
            return drawn, confidences, q
        return ids[drawn], confidences, q.new_zeros(q.shape[0], self.target.vocab_size).index_copy_(1, ids, q)

    def _feed(self, nodes: DraftedNodes, frontier: torch.Tensor, parent_features: torch.Tensor, fed: torch.Tensor,
              committed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the pairs of ``frontier`` nodes [F] through the head after the ``fed`` ones (node indices in
        head-cache order); returns (their predicted features [F, H], the new ``fed``)."""
        fed = torch.cat([fed, frontier])
        # Each new pair sees every committed pair and the pairs of its own ancestors (itself included).
        mask = torch.ones(frontier.shape[0], committed + fed.shape[0], dtype=torch.bool, device=fed.device)
        mask[:, committed:] = nodes.ancestors[frontier][:, fed]
        positions = committed + nodes.depths[frontier] - 1
        out = self.head_step(parent_features, self.embed(nodes.tokens[frontier]), positions, self.cache,
                             mask[None, None], own_features=True)
        self.cache.commit()
        return out, fed

    def _grow(self, root_feature: torch.Tensor, depth: int, root_children: list | None) -> DraftedNodes:
        """EAGLE-2: expand the most valuable nodes level by level (`grow_level`), then keep the best
        ``total_tokens``. ``root_children``: the root's top_k (tokens, log-confidences) [1, top_k] from the
        catch-up step (greedy), or None to draw them here."""
        committed, k, device = self.cache.length, self.top_k, root_feature.device
        tokens, confidences, q = (*root_children, None) if root_children else self._children(root_feature, k)
        # The lineage sized for the drafter's full depth, also when the end of the answer cuts the tree: one shape.
        frontier = first_frontier(tokens[0], confidences[0], root_feature, self.depth)
        children = None if self._params.greedy else self._children
        levels = []
        floor = math.log(self.min_confidence) if self.min_confidence > 0 else None
        for level in range(depth - 1):
            if floor is not None and float(frontier.values.max()) < floor:  # one host read a level, with a floor
                break
            child_tokens, values, level_q, after = self.level_step(self.cache, frontier, committed, level, children)
            levels.append((frontier, child_tokens, values, level_q))
            frontier = after
        nodes = assemble(tokens[0], confidences[0].float(), levels, q, k)
        if not self._params.greedy:
            # Sampled siblings must stay i.i.d. draws from q for the acceptor to be lossless, so none may
            # be dropped for its value: keep nodes in creation order (sample order within siblings).
            return nodes.subset(torch.arange(min(len(nodes), self.total_tokens), device=device))
        # Rerank by value, ties toward shallower then earlier nodes. A child's value never exceeds its
        # parent's, so the best nodes include every kept node's ancestors.
        order = torch.argsort(nodes.depths, stable=True)
        order = order[torch.argsort(-nodes.values[order], stable=True)]
        return nodes.subset(order[: self.total_tokens])

    def _grow_static(self, root_feature: torch.Tensor, depth: int) -> DraftedNodes:
        """EAGLE-1: children of each node by rank, as listed in ``choices`` (a plan fixed per depth)."""
        committed, device = self.cache.length, root_feature.device
        plan = self._static_plan(depth)
        nodes = DraftedNodes.empty(device)
        # Row 0: the root's feature; row i + 1: the predicted feature of node i, once it is fed.
        features = root_feature.new_zeros(1 + sum(level["rows"].numel() for level in plan), root_feature.shape[-1])
        features[0] = root_feature[0]
        fed = torch.empty(0, dtype=torch.long, device=device)
        for level in plan:
            parents = level["parents"].to(device)  # [P] node indices (-1: the root) whose children are drafted
            inputs = features[parents + 1]
            ranked, confidences, q = self._children(inputs, level["widest"])
            rows, ranks = level["rows"].to(device), level["ranks"].to(device)  # per new node: parent row, rank
            new = nodes.add(ranked[rows, ranks], parents[rows], confidences[rows, ranks], q, rows)
            expand = level["expand"].to(device)  # which new nodes have children further down
            if expand.numel():
                frontier = new[expand]
                predicted, fed = self._feed(nodes, frontier, inputs[rows[expand]], fed, committed)
                features[frontier + 1] = predicted
        return nodes

    def _static_plan(self, depth: int) -> list[dict]:
        """Per level of the static tree cut at ``depth``: the parent nodes [P] whose children are drafted,
        for each new node its parent's row among them and its rank, the widest rank + 1, and which new
        nodes are expanded (fed) for the next level. Node indices follow creation order."""
        if depth not in self._plans:
            paths: list[tuple[int, ...]] = []  # sorted by (length, path); a path whose parent is absent is dropped
            for path in (tuple(p) for p in self.choices if len(p) <= depth):
                if len(path) == 1 or path[:-1] in paths:
                    paths.append(path)
            index = {path: i for i, path in enumerate(paths)}
            plan = []
            for level in range(1, depth + 1):
                new = [p for p in paths if len(p) == level]
                if not new:
                    break
                parents = sorted({index.get(p[:-1], -1) for p in new})
                row_of = {parent: row for row, parent in enumerate(parents)}
                deeper = {p[:level] for p in paths if len(p) > level}
                plan.append({"parents": torch.tensor(parents),
                             "rows": torch.tensor([row_of[index.get(p[:-1], -1)] for p in new]),
                             "ranks": torch.tensor([p[-1] for p in new]),
                             "widest": 1 + max(p[-1] for p in new),
                             "expand": torch.tensor([i for i, p in enumerate(new) if p in deeper], dtype=torch.long)})
            self._plans[depth] = plan
        return self._plans[depth]
