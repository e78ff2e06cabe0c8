"""Deciding which draft tokens the target keeps.

Both rules walk the tree from the root and return the accepted path plus one
token the target adds itself (the bonus token), so every cycle yields at least
one token.

- Greedy (temperature 0): follow the child whose token equals the target's
  argmax; the output is exactly greedy decoding of the target.
- Speculative sampling (temperature > 0): at each node the children are tried
  in turn. A child x drawn from q is accepted with probability min(1, p(x)/q(x));
  on rejection p becomes norm(max(0, p - q)) and the next child is tried against
  it (multi-round speculative sampling, as in SpecInfer and EAGLE). A child
  chosen deterministically is a point-mass proposal: accepted with probability
  p(x), else p(x) is set to 0 and p renormalised. When every child is rejected
  the bonus token is drawn from what is left of p. For a chain this is exactly
  Leviathan et al.'s rule; every step is a valid speculative sampling step, so
  the output is distributed as the target's for any tree shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specula.sampling import SamplingParams, probabilities, sample
from specula.tree import DraftTree


@dataclass
class Acceptance:
    """Result of verifying one draft tree.

    accepted_nodes: tree node indices from the root (0) to the last accepted draft node.
    next_token:     the token the target contributes after the accepted path.
    """

    accepted_nodes: list[int]
    next_token: int

    @property
    def accepted_drafts(self) -> int:
        return len(self.accepted_nodes) - 1


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Acceptance:
    """Longest path matching the target's argmax. ``target_logits`` [n, V]."""
    best = torch.argmax(target_logits, dim=-1).tolist()
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        match = next((c for c in tree.children(node) if tokens[c] == best[node]), None)
        if match is None:
            return Acceptance(path, best[node])
        node = match
        path.append(node)


def accept_speculative(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                       generator: torch.Generator | None) -> Acceptance:
    """Lossless multi-round speculative sampling over ``tree``. ``target_logits`` [n, V]."""
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        p = probabilities(target_logits[node], params)
        moved = False
        for child in tree.children(node):
            x = tokens[child]
            u = torch.rand((), generator=generator, device=p.device)
            q = None if tree.draft_probs is None else tree.draft_probs[child].to(p.device)
            if u * (1.0 if q is None else q[x]) < p[x]:
                moved = True
                break
            p = residual(p, q, x)
        if not moved:
            return Acceptance(path, sample(p, generator))
        node = child
        path.append(node)


def residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """What a rejected draft token ``x`` leaves of ``p`` [V]: norm(max(0, p - q)), or for a point-mass
    proposal (``q`` None) p with p(x) set to 0 and renormalised."""
    if q is None:
        p = p.clone()
        p[x] = 0.0
    else:
        left = torch.clamp(p - q, min=0.0)
        # Zero residual mass happens only when p == q, where rejection has probability 0.
        if left.sum() > 0:
            p = left
    return p / p.sum()


class Acceptor:
    """Picks the rule from the sampling params; lossless at every temperature."""

    lossless = True

    def __call__(self, tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> Acceptance:
        if params.greedy:
            return accept_greedy(tree, target_logits)
        return accept_speculative(tree, target_logits, params, generator)
