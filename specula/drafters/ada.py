"""`ada` (AdaEAGLE): EAGLE drafting whose length each cycle is predicted by an LDLP.

After every verification the LDLP reads the target's embedding and final hidden
state of the last accepted token and predicts how many drafts the target will
accept next; the drafter then drafts that many (rounded, clipped to [1, max]).

- chain (default, the paper's setting): a greedy — or, at T > 0, sampled — EAGLE
  chain of the predicted length. It is the EAGLE-2 growth of `EagleDrafter` with
  one child per node, so the head-driving code (catch-up, KV cache, drafting from
  the head's warped distribution with draft_probs for the lossless acceptor) is
  the same code that serves `eagle2`.
- tree (``tree=True``, drafter name "ada-tree"): an EAGLE-2 dynamic tree whose
  depth is the predicted length (``total_tokens`` and ``top_k`` as for eagle2).

The predictor only decides how much to draft, never what: output is exactly the
target's whatever it predicts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specula.drafters.eagle import EagleDrafter
from specula.errors import SpeculaError
from specula.heads.eagle_head import EagleHead
from specula.heads.ldlp import LengthPredictor, head_fingerprint
from specula.runtime.target import FeatureRequest, ForwardOutput, Target
from specula.sampling import SamplingParams
from specula.tree import DraftTree

LDLP_SUBDIR = "ldlp"  # where an LDLP lives inside its EAGLE head directory when no ldlp= is given


class AdaDrafter(EagleDrafter):
    """EagleDrafter with the depth set every cycle by ``predictor``; ``num_tokens`` caps the predicted length."""

    def __init__(self, target: Target, head: EagleHead, predictor: LengthPredictor, tree: bool = False,
                 num_tokens: int | None = None, total_tokens: int | None = None, top_k: int | None = None):
        cap = predictor.max_draft_length if num_tokens is None else min(num_tokens, predictor.max_draft_length)
        if tree:
            super().__init__(target, head, dynamic=True, name="ada-tree", total_tokens=total_tokens,
                             depth=cap, top_k=top_k)
        else:  # (total_tokens and top_k only with tree: the registry's rule, checked where options arrive)
            # One child per node and room for the longest chain: EAGLE-2 growth degenerates to a chain.
            super().__init__(target, head, dynamic=True, name="ada", total_tokens=cap, depth=cap, top_k=1)
        predictor.check_fits(target.config.hidden_size, target.vocab_size)
        self.predictor = predictor.to(device=target.device, dtype=target.dtype)
        self.cap = cap
        # The LDLP reads the final hidden state whatever features the head itself wants.
        self.features = FeatureRequest(final_hidden=True, layer_inputs=self.features.layer_inputs)
        self.next_length = 1
        self.predicted_lengths: list[int] = []  # one per propose call, for inspection

    def _predict(self, last_token: torch.Tensor, target_out: ForwardOutput) -> None:
        """Set the next cycle's draft length from the last accepted token (id []) and its output rows."""
        embed = self.embed(last_token.reshape(1))[0]
        self.next_length = self.predictor.draft_length(embed, target_out.hidden[-1], self.cap)

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        super().start(prompt, target_out)
        self.predicted_lengths = []
        self._predict(prompt[-1], target_out)

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        super().observe(accepted, target_out)
        self._predict(accepted[-1], target_out)

    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        self.depth = self.next_length
        self.predicted_lengths.append(self.next_length)
        return super().propose(context, max_depth, params, generator)


def build_ada_drafter(target: Target, draft: str | None, ldlp: str | Path | None = None, tree: bool = False,
                      **options) -> AdaDrafter:
    """`ada` from an EAGLE head directory and an LDLP directory (default: ``draft/ldlp``); ``options``
    (num_tokens, and total_tokens/top_k with a tree) as the registry checked them (`specula.methods`)."""
    if not draft:
        raise SpeculaError("method ada needs --draft HEAD_DIR, a trained EAGLE head for this target")
    ldlp_dir = Path(ldlp) if ldlp else Path(draft) / LDLP_SUBDIR
    if not ldlp_dir.is_dir():
        raise SpeculaError(f"no LDLP at {ldlp_dir}: method ada needs --ldlp DIR (or HEAD_DIR/{LDLP_SUBDIR}), "
                           "trained with `specula train ldlp` for this head")
    head = EagleHead.from_pretrained(draft, dtype=target.dtype, device=target.device)
    predictor = LengthPredictor.from_pretrained(ldlp_dir, dtype=target.dtype, device=target.device)
    predictor.check_fits(target.config.hidden_size, target.vocab_size, head_fingerprint(draft))
    return AdaDrafter(target, head, predictor, tree=tree, **options)
