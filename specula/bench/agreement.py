"""How close two decodings are: where greedy outputs first differ and whether that is a floating-point near-tie,
and how often two models' argmax tokens agree over a text.

Speculative decoding verifies k tokens in one forward, vanilla decoding one at a
time; the two forwards round differently (another matmul shape, another
accumulation order), so a greedy output may legitimately take the other branch
where the target's two best tokens are within rounding of each other. Whether a
divergence is such a near-tie is decided in one place, `specula.divergence` (also
used by `specula check` and `specula bench`): the target's logits are recomputed
for the reference's prefix as vanilla decoding computes them, and the gap between
the two tokens' logits is compared with a tolerance derived from the least precise
dtype the target computes in, relative to the largest logit (1e-4 of it in float32,
4 bfloat16 ulps for bfloat16 and the bfloat16 kernels of int8/int4 weights).
Anything wider is a bug. This module gives that verdict the shape the weight-format
tests print.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specula.divergence import NEAR_TIE, explain, first_difference

__all__ = ["Agreement", "ArgmaxReference", "Divergence", "argmax_agreement", "find_divergence",
           "first_difference"]


@dataclass(frozen=True)
class Divergence:
    """The first position where a decoding left the reference one, judged by `specula.divergence`.

    position:  index among the generated tokens; expected / got: the two tokens there (got = -1: ended early).
    margin:    logit(expected) - logit(got) at vanilla's step there (inf when one side ended);
    top2_margin: best minus second-best logit there.
    tolerance: the near-tie threshold on ``|margin|`` for the target's dtype and logit scale;
    kind:      ``near-tie`` or ``real`` (`specula.divergence.classify`).
    """

    position: int
    expected: int
    got: int
    margin: float
    top2_margin: float
    tolerance: float
    kind: str

    @property
    def near_tie(self) -> bool:
        return self.kind == NEAR_TIE

    def describe(self) -> str:
        kind = "a floating-point near-tie" if self.near_tie else "NOT a near-tie"
        return (f"first divergence at generated token {self.position}: expected {self.expected}, got {self.got}; "
                f"logit margin {self.margin:.3g} (top-2 margin {self.top2_margin:.3g}, near-tie below "
                f"{self.tolerance:.3g}): {kind}")


def find_divergence(target, prompt_ids: torch.Tensor, expected: list[int], got: list[int]) -> Divergence | None:
    """None if ``got`` equals ``expected`` (the reference's new tokens after ``prompt_ids`` [P]), else the first
    `Divergence`, classified by `specula.divergence.explain` on ``target`` (a `Target`; its cache is reset)."""
    found = explain(target, prompt_ids, expected, got)
    if found is None:
        return None
    expected_token = -1 if found.vanilla_token is None else found.vanilla_token
    got_token = -1 if found.method_token is None else found.method_token
    return Divergence(found.position, expected_token, got_token, found.gap, found.margin, found.tolerance, found.kind)


@dataclass
class Agreement:
    """Top-1 agreement of a model with a reference over the same positions.

    positions: how many positions were compared; agreeing: how many argmax tokens were equal;
    disagreement_margins: the reference's top-2 logit margin at each disagreeing position (small = the
    reference itself was nearly undecided there).
    """

    positions: int
    agreeing: int
    disagreement_margins: list[float]

    @property
    def rate(self) -> float:
        return self.agreeing / self.positions if self.positions else float("nan")

    def near_ties(self, margin: float) -> int:
        """Disagreements where the reference's top-2 margin is below ``margin`` logits."""
        return sum(m < margin for m in self.disagreement_margins)

    def add(self, other: Agreement) -> Agreement:
        return Agreement(self.positions + other.positions, self.agreeing + other.agreeing,
                         self.disagreement_margins + other.disagreement_margins)


@dataclass
class ArgmaxReference:
    """What an agreement count needs of a reference model's logits [n, V], without keeping them:
    its argmax tokens [n] and its top-1 minus top-2 margins [n]."""

    tokens: torch.Tensor
    margins: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor) -> ArgmaxReference:
        logits = logits.float()
        top = torch.topk(logits, 2, dim=-1).values
        return cls(logits.argmax(-1), top[:, 0] - top[:, 1])

    def agreement(self, logits: torch.Tensor) -> Agreement:
        """Compare the argmax tokens of ``logits`` [n, V] with the reference's."""
        agree = self.tokens == logits.float().argmax(-1)
        return Agreement(int(agree.numel()), int(agree.sum()), [float(m) for m in self.margins[~agree]])


def argmax_agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> Agreement:
    """Compare argmax tokens of ``logits`` [n, V] with those of ``reference_logits`` [n, V]."""
    return ArgmaxReference.of(reference_logits).agreement(logits)
