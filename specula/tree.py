"""Draft trees: the shape every drafter proposes and the target verifies in one pass.

Node 0 is the root: the newest committed token, which the target has not yet
processed (it is the target's own last sample). Every other node is a draft
token whose parent comes earlier in the node order, so any prefix of the nodes
is itself a tree. A chain is the tree whose node i has parent i - 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specula.errors import SpeculaError


@dataclass
class DraftTree:
    """A token tree.

    tokens:      int64 [n], ``tokens[0]`` is the root.
    parents:     list of n ints, ``parents[0] == -1`` and ``parents[i] < i``.
    draft_probs: float32 [n, V] or None. Row i (i > 0) is the distribution node i's
                 token was sampled from; row 0 is unused. None means every draft token
                 was chosen deterministically (argmax, top-k, lookup), which the lossless
                 acceptor treats as a point-mass proposal.
    confidences: float [n] or None. The drafter's probability of node i's token given its
                 parent (row 0 unused); only read by the benchmark's calibration plot.
    kind:        what sort of draft this is, for a drafter whose drafts differ in how often they
                 are accepted (the suffix drafter's source and match length, e.g. "conversation
                 match 3-4"); the server's draft budget learns each kind's acceptance. "" for one sort.
    """

    tokens: torch.Tensor
    parents: list[int]
    draft_probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None
    kind: str = ""
    _depths: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.parents) != self.tokens.shape[0]:
            raise ValueError("tokens and parents must have the same length")
        if self.parents[0] != -1 or any(not (0 <= p < i) for i, p in enumerate(self.parents) if i):
            raise ValueError(f"parents must satisfy parents[0] == -1 and 0 <= parents[i] < i: {self.parents}")

    @classmethod
    def root_only(cls, root: int, device: torch.device | str = "cpu") -> DraftTree:
        return cls(torch.tensor([root], dtype=torch.long, device=device), [-1])

    @classmethod
    def chain(cls, root: int, drafts: list[int], draft_probs: torch.Tensor | None = None,
              device: torch.device | str = "cpu", confidences: list[float] | None = None) -> DraftTree:
        """Root followed by ``drafts`` in a line; ``draft_probs`` [len(drafts), V] if sampled."""
        tokens = torch.tensor([root, *drafts], dtype=torch.long, device=device)
        if draft_probs is not None:
            draft_probs = torch.cat([torch.zeros_like(draft_probs[:1]), draft_probs], dim=0)
        node_confidences = None if confidences is None else torch.tensor([1.0, *confidences])
        return cls(tokens, list(range(-1, len(drafts))), draft_probs, node_confidences)

    def __len__(self) -> int:
        return len(self.parents)

    def node_confidences(self, nodes: list[int]) -> list[float] | None:
        """The drafter's probability of each of ``nodes``' tokens given its parent, or None if unknown.

        From ``confidences`` when the drafter set it, else from ``draft_probs[i, tokens[i]]``
        (sampled drafts); None for drafts with neither (prompt lookup).
        """
        if self.confidences is not None:
            confidences = torch.as_tensor(self.confidences)
            return confidences[nodes].float().tolist()
        if self.draft_probs is not None:
            device = self.draft_probs.device
            rows, tokens = torch.tensor(nodes, dtype=torch.long, device=device), self.tokens[nodes].to(device)
            return self.draft_probs[rows, tokens].float().tolist()
        return None

    @property
    def depths(self) -> list[int]:
        """Depth of each node; the root has depth 0."""
        if self._depths is None:
            depths = [0] * len(self)
            for i in range(1, len(self)):
                depths[i] = depths[self.parents[i]] + 1
            self._depths = depths
        return self._depths

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, len(self)) if self.parents[i] == node]

    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def ancestor_mask(self) -> torch.Tensor:
        """bool [n, n]: entry (i, j) is True when j is i itself or one of its ancestors."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            if i:
                mask[i] = mask[self.parents[i]]
            mask[i, i] = True
        return mask.to(self.tokens.device)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def main_chain(self) -> list[int]:
        """The root's first child, that node's first child, and so on (node indices, the root excluded): every
        drafter lists the likeliest child first (a head's top-k in order, a suffix match's best-first growth)."""
        chain = [0]
        for i in range(1, len(self)):
            if self.parents[i] == chain[-1]:
                chain.append(i)
        return chain[1:]

    def prune(self, max_depth: int, max_nodes: int, chain_only: bool = False) -> DraftTree:
        """Keep the nodes with depth <= max_depth, at most ``max_nodes`` of them (in node order), and only those of
        the `main_chain` when ``chain_only``.

        Node order puts parents first, so the kept set stays a connected tree.
        """
        nodes = [0, *self.main_chain()] if chain_only else range(len(self))
        depths = self.depths
        keep = [i for i in nodes if depths[i] <= max_depth][:max(1, max_nodes)]
        if len(keep) == len(self):
            return self
        # Kept nodes are a prefix-closed set: a node's parent is kept before it.
        new_index = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [new_index[self.parents[i]] for i in keep[1:]]
        probs = None if self.draft_probs is None else self.draft_probs[keep]
        confidences = None if self.confidences is None else self.confidences[keep]
        return DraftTree(self.tokens[keep], parents, probs, confidences, self.kind)


def check_rank_paths(paths: Sequence, label: str = "tree choices") -> list[tuple[int, ...]]:
    """Child-rank paths such as [[0], [1], [0, 0]] checked as one tree: a non-empty list of non-empty lists
    of ranks >= 0, no path twice, every path's parent listed. Returns them as tuples, in the given order.

    Both ways a static tree arrives share it: a method option (`specula.options.parse_tree`) and a Medusa
    head's saved choices (`specula.drafters.medusa.check_choices`)."""
    if not (isinstance(paths, (list, tuple)) and paths and all(
            isinstance(p, (list, tuple)) and p and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                                      for r in p) for p in paths)):
        raise SpeculaError(f"{label} must be a non-empty list of non-empty lists of ranks >= 0, "
                           "such as [[0],[1],[0,0]]")
    found = [tuple(p) for p in paths]
    present = set(found)
    if len(present) != len(found):
        raise SpeculaError(f"{label} lists a path twice")
    orphans = [list(p) for p in found if len(p) > 1 and p[:-1] not in present]
    if orphans:
        raise SpeculaError(f"{label}: paths {orphans[:3]} lack their parent paths")
    return found
