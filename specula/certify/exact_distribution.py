"""The target's exact sampling distribution after one prompt, computed once per distinct prefix of new tokens.

The distribution test needs p(. | prompt, x_1..x_j) for every prefix of every sampled sequence and of
every sequence in its chi-square cells. Those prefixes form a tree (samples share their first tokens),
so each distinct prefix is computed once: the prompt is prefilled once, then the tree of prefixes is
run as token trees on top of it (`Target.forward` with an ancestor mask, the way a verify pass runs a
draft tree), many prefixes per forward. Each tree node attends to the prompt and to its own ancestors
only, at position prompt length + depth, so its logits are the target's for exactly that prefix.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specula.sampling import SamplingParams, probabilities

MAX_BLOCK = 256  # tree nodes per forward: bounds the [n, V] logits and the [n, P + n] mask


class ExactDistribution:
    """p(. | prompt + prefix) for prefixes (tuples of new token ids), float32 [V] as `specula.sampling` draws.

    ``target``: a `Target`; its cache is taken over (the prompt prefilled): use no other cache operation on it
    between `compute` calls. ``forwards`` counts the target forwards spent, the prefill included.
    """

    def __init__(self, target, prompt: torch.Tensor, params: SamplingParams):
        self.target, self.params, self.prompt = target, params, prompt
        self.prompt_length = int(prompt.numel())
        logits = target.prefill(prompt.to(target.device)).logits[-1]
        self.rows: dict[tuple[int, ...], torch.Tensor] = {(): probabilities(logits, params)}
        self.forwards = 1

    def reattach(self) -> None:
        """Prefill the prompt again, after other work used the target's cache (the rows computed are kept)."""
        self.target.prefill(self.prompt.to(self.target.device))
        self.forwards += 1

    def __getitem__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        """The distribution after ``prompt + prefix``: [V] float32 (KeyError unless computed by `compute`)."""
        return self.rows[prefix]

    def compute(self, prefixes: Iterable[tuple[int, ...]]) -> None:
        """Compute every prefix of ``prefixes`` not known yet, as few token-tree forwards as fit."""
        missing = sorted({tuple(p) for p in prefixes} - self.rows.keys())
        budget = min(MAX_BLOCK, self.target.max_length - self.prompt_length)
        chunk: dict[tuple[int, ...], None] = {}  # insertion-ordered set of nodes: ancestors before descendants
        for prefix in missing:
            nodes = [prefix[:i] for i in range(1, len(prefix) + 1) if prefix[:i] not in chunk]
            if len(chunk) + len(nodes) > budget and chunk:
                self._forward(list(chunk))
                chunk = {}
                nodes = [prefix[:i] for i in range(1, len(prefix) + 1)]
            chunk.update(dict.fromkeys(nodes))
        if chunk:
            self._forward(list(chunk))

    def _forward(self, nodes: list[tuple[int, ...]]) -> None:
        """One forward over ``nodes`` (non-empty prefixes, each one's ancestors listed before it) as a tree."""
        index = {node: i for i, node in enumerate(nodes)}
        n, device = len(nodes), self.target.device
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, node in enumerate(nodes):
            for depth in range(1, len(node) + 1):  # the node itself and each of its ancestors in the block
                mask[i, index[node[:depth]]] = True
        tokens = torch.tensor([node[-1] for node in nodes], dtype=torch.long, device=device)
        depths = [len(node) - 1 for node in nodes]
        self.target.truncate(self.prompt_length)
        logits = self.target.forward(tokens, mask.to(device), depths).logits  # [n, V]
        self.target.commit([])  # nothing of the block stays in the cache
        self.forwards += 1
        probs = probabilities(logits, self.params)
        for node, row in zip(nodes, probs, strict=True):
            self.rows.setdefault(node, row)  # a known ancestor keeps its value: every lookup sees one number
