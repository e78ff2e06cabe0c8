"""The protocol every drafting method implements; the decode loop knows drafters only through it."""

from __future__ import annotations

from typing import Protocol

import torch

from specula.runtime.target import FeatureRequest, ForwardOutput
from specula.sampling import SamplingParams
from specula.tree import DraftTree


class Drafter(Protocol):
    """Proposes draft trees and follows the text the target commits.

    The loop calls `start` once after the target's prefill, then per cycle
    `propose` and, after verification, `observe` with what the target kept.
    """

    name: str
    features: FeatureRequest  # hidden states this drafter needs from every target forward

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        """Prompt ids [P] and the target's prefill output (rows for each prompt token)."""

    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        """A tree rooted at ``context[-1]`` (all ids so far, [T]) no deeper than ``max_depth``."""

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        """Tokens [m] the target just committed (the root and accepted drafts) and its output rows for them."""

    def fork(self) -> Drafter:
        """A drafter with the same weights and options and its own state, for another sequence generating at
        the same time (batched serving); weights are shared, not copied."""
