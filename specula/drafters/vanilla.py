"""`vanilla`: no draft at all, so every cycle is one ordinary decoding step of the target."""

from __future__ import annotations

import torch

from specula.runtime.target import FeatureRequest, ForwardOutput
from specula.sampling import SamplingParams
from specula.tree import DraftTree


class VanillaDrafter:
    name = "vanilla"
    features = FeatureRequest()

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        pass

    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        return DraftTree.root_only(int(context[-1]), device=context.device)

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        pass

    def fork(self) -> VanillaDrafter:
        return self  # no state
