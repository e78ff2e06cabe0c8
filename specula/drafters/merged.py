"""Merged drafting: a head's tree and the suffix drafter's candidates verified as one tree.

The two drafters are right at different places: the head guesses the next token from the target's
features everywhere, while a suffix match (`specula.drafters.suffix`) copies a phrase the text has
said before, and is often right for several tokens at once, at no head cost. Each cycle both
propose; the suffix tree is grafted onto the head's: a suffix node whose parent already has a child
with its token is that child (its own children hang below it), any other suffix node is a new child.
The head's nodes keep their order, so a prefix of the merged tree is still the head's tree.

Lossless at every temperature with the usual acceptor: a suffix node is a point-mass proposal, written
as a one-hot row when the head's nodes carry sampled distributions (a one-hot q gives min(1, p(x)) and
the residual p with p(x) set to 0: exactly the point-mass rule). A suffix node that falls on a sampled
head node keeps the head's q (the head drew that token), so every node has one proposal, fixed before
the target's coins are thrown, and the multi-round rule stays valid whichever siblings sit beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specula.drafters.base import Drafter
from specula.runtime.target import ForwardOutput
from specula.sampling import SamplingParams
from specula.tree import DraftTree


def graft(head: DraftTree, suffix: DraftTree) -> DraftTree:
    """``suffix``'s nodes grafted onto ``head`` (both rooted at the same token); head nodes first.

    ``head.draft_probs`` [n, V] or None; ``suffix`` is point masses (``draft_probs`` None). Confidences
    (the drafter's probability of a node given its parent) come from each node's own drafter.
    """
    if len(suffix) == 1:
        return head
    if len(head) == 1 and head.draft_probs is None:
        return suffix  # nothing to graft onto, no distributions to widen
    tokens, parents = head.tokens.tolist(), list(head.parents)
    child_of: dict[tuple[int, int], int] = {}  # (parent, token) -> the first such node (sampled siblings may repeat)
    for node in range(len(tokens) - 1, 0, -1):
        child_of[(parents[node], tokens[node])] = node
    suffix_tokens = suffix.tokens.tolist()
    merged_index = [0]  # suffix node -> merged node
    new_nodes: list[int] = []  # suffix nodes that became merged nodes
    for node in range(1, len(suffix)):
        parent, token = merged_index[suffix.parents[node]], suffix_tokens[node]
        found = child_of.get((parent, token))
        if found is None:
            found = len(tokens)
            tokens.append(token)
            parents.append(parent)
            child_of[(parent, token)] = found
            new_nodes.append(node)
        merged_index.append(found)
    if not new_nodes:
        return head
    device = head.tokens.device
    draft_probs = head.draft_probs
    if draft_probs is not None:
        added = F.one_hot(suffix.tokens[new_nodes].to(draft_probs.device), draft_probs.shape[-1])
        draft_probs = torch.cat([draft_probs, added.to(draft_probs.dtype)])
    confidences = None
    if head.confidences is not None and suffix.confidences is not None:
        confidences = torch.cat([torch.as_tensor(head.confidences).float().cpu(),
                                 torch.as_tensor(suffix.confidences).float().cpu()[new_nodes]])
    return DraftTree(torch.tensor(tokens, dtype=torch.long, device=device), parents, draft_probs, confidences)


class MergedDrafter:
    """A head drafter (EAGLE, EAGLE-2, EAGLE-3) and a suffix drafter proposing one tree each cycle.

    It carries the head drafter's name and feature request: the method is still the head's, drafting more.
    """

    def __init__(self, head_drafter: Drafter, suffix_drafter: Drafter):
        self.head_drafter, self.suffix_drafter = head_drafter, suffix_drafter
        self.name = head_drafter.name
        self.features = head_drafter.features

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        self.head_drafter.start(prompt, target_out)
        self.suffix_drafter.start(prompt, target_out)

    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        """The head's tree with the suffix drafter's grafted on, rooted at ``context[-1]`` ([T] ids so far)."""
        head = self.head_drafter.propose(context, max_depth, params, generator)
        return graft(head, self.suffix_drafter.propose(context, max_depth, params, generator))

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        self.head_drafter.observe(accepted, target_out)
        self.suffix_drafter.observe(accepted, target_out)

    def warm_up(self, max_block: int) -> None:
        """The head drafter's compiled steps, compiled now (`specula.decoding.warm_up`)."""
        self.head_drafter.warm_up(max_block)

    def fork(self) -> MergedDrafter:
        return MergedDrafter(self.head_drafter.fork(), self.suffix_drafter.fork())
