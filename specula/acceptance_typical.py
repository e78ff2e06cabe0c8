"""Medusa's typical acceptance (Medusa-2 paper, section 2.3.1) — LOSSY, opt-in only.

At temperature > 0 a draft token x under a node is accepted when the target's
probability of it there is "typical":

    p(x) > min(ε, δ · exp(−H(p)))        ε = posterior_threshold (0.09), δ = posterior_alpha (0.3)

where p is the target's distribution at the node (after temperature, top-k and
top-p, as the target samples) and H(p) its entropy. Of the root-to-node paths
whose every token passes, the deepest is kept (ties: the highest sum of log p),
as Medusa does; the target then adds one token sampled from its own p at the end
of the path (Medusa's default "fast" mode takes the argmax there instead).

This is NOT lossless: it accepts any plausible token, not each token with
exactly the probability the target would have produced it, so the output is not
distributed as the target's (tests/test_medusa.py shows the distribution test
rejecting it). It trades exactness for longer accepted paths. At temperature 0
it is exactly greedy matching, as in Medusa, and so lossless there.
"""

from __future__ import annotations

import math

import torch

from specula.acceptance import Acceptance, Acceptor, accept_greedy
from specula.errors import SpeculaError
from specula.sampling import SamplingParams, probabilities, sample
from specula.tree import DraftTree

POSTERIOR_THRESHOLD = 0.09  # ε, Medusa's default
POSTERIOR_ALPHA = 0.3  # δ, Medusa's default (about sqrt(ε))


class TypicalAcceptor:
    """Typical acceptance with the `Acceptor` call signature. ``lossless`` is False: never the default."""

    lossless = False
    name = "typical"

    def __init__(self, posterior_threshold: float = POSTERIOR_THRESHOLD, posterior_alpha: float = POSTERIOR_ALPHA):
        if not 0.0 < posterior_threshold <= 1.0:
            raise SpeculaError(f"the typical-acceptance threshold must be in (0, 1], got {posterior_threshold}")
        if not posterior_alpha > 0.0:
            raise SpeculaError(f"the typical-acceptance alpha must be > 0, got {posterior_alpha}")
        self.posterior_threshold = posterior_threshold
        self.posterior_alpha = posterior_alpha

    def thresholds(self, probs: torch.Tensor) -> torch.Tensor:
        """min(ε, δ·exp(−H(p))) for each row of ``probs`` [n, V]."""
        entropy = torch.special.entr(probs).sum(-1)
        return torch.clamp(self.posterior_alpha * torch.exp(-entropy), max=self.posterior_threshold)

    def __call__(self, tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> Acceptance:
        if params.greedy:
            return accept_greedy(tree, target_logits)
        probs = probabilities(target_logits, params)  # [n, V], row i: the target after node i
        limits = self.thresholds(probs)
        parents = tree.parents
        tokens = tree.tokens.tolist()
        # Node i passes when its token is typical under its parent's distribution; a node is reachable
        # when it and all its ancestors pass (parents come first, so one pass in node order suffices).
        reachable = [True] + [False] * (len(tree) - 1)
        score = [0.0] * len(tree)
        best = 0
        for i in range(1, len(tree)):
            parent = parents[i]
            p_x = float(probs[parent, tokens[i]])
            if reachable[parent] and p_x > float(limits[parent]):
                reachable[i] = True
                score[i] = score[parent] + math.log(p_x)
                if (tree.depths[i], score[i]) > (tree.depths[best], score[best]):
                    best = i
        return Acceptance(tree.path_to(best), sample(probs[best], generator))


ACCEPTANCES = ("lossless", "typical")


def make_acceptor(name: str = "lossless", posterior_threshold: float = POSTERIOR_THRESHOLD,
                  posterior_alpha: float = POSTERIOR_ALPHA) -> Acceptor | TypicalAcceptor:
    """The acceptor named ``name``: "lossless" (the default rule of the loop) or the lossy "typical"."""
    if name == "lossless":
        return Acceptor()
    if name == "typical":
        return TypicalAcceptor(posterior_threshold, posterior_alpha)
    raise SpeculaError(f"unknown acceptance '{name}'; choose one of {', '.join(ACCEPTANCES)}")
