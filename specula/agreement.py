"""How close two decodings are: where greedy outputs first differ and whether that is a floating-point near-tie,
and how often two models' argmax tokens agree over a text.

Speculative decoding verifies k tokens in one forward, vanilla decoding one at a
time; the two forwards round differently (another matmul shape, another
accumulation order), so a greedy output may legitimately take the other branch
where the target's two best tokens are within rounding of each other — and the
KV cache itself holds different roundings depending on whether it was filled
token by token or in blocks. Such a divergence is a *near-tie*: at the one-token
step vanilla decoding takes there, the logit margin between the two tokens is at
most the rounding unit of the least precise dtype the target computes in (at
least `NEAR_TIE_RELATIVE`) times the largest logit's magnitude. For float32 that
is 1e-4; for the bfloat16 kernels of int8/int4 weights 2^-8 (a bfloat16 carries
8 significant bits). Anything wider is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE_RELATIVE = 1e-4  # float32 rounding moves logits by ~1e-6 relative; 100x that is still a tie


def near_tie_relative(model: torch.nn.Module) -> float:
    """The near-tie margin relative to the largest logit for ``model``: the unit roundoff of the least
    precise dtype its parameters or its layers' kernels compute in, at least `NEAR_TIE_RELATIVE`."""
    dtypes = {p.dtype for p in model.parameters()} | {getattr(m, "compute_dtype", None) for m in model.modules()}
    return max([NEAR_TIE_RELATIVE] + [torch.finfo(d).eps / 2 for d in dtypes if d is not None and d.is_floating_point])


@dataclass(frozen=True)
class Divergence:
    """The first position where a decoding left the reference one, seen from the reference's one-token step.

    position: index among the generated tokens; expected / got: the two tokens there (got = -1: ended early).
    margin:   logit(expected) - logit(got) at the one-token step; top2_margin: best minus second-best logit.
    scale:    the largest logit magnitude at that step; relative: the near-tie margin relative to it.
    """

    position: int
    expected: int
    got: int
    margin: float
    top2_margin: float
    scale: float
    relative: float = NEAR_TIE_RELATIVE

    @property
    def near_tie(self) -> bool:
        return self.got >= 0 and abs(self.margin) <= self.relative * max(1.0, self.scale)

    def describe(self) -> str:
        kind = "a floating-point near-tie" if self.near_tie else "NOT a near-tie"
        return (f"first divergence at generated token {self.position}: expected {self.expected}, got {self.got}; "
                f"logit margin {self.margin:.3g} (top-2 margin {self.top2_margin:.3g}, largest |logit| "
                f"{self.scale:.3g}, near-tie below {self.relative * max(1.0, self.scale):.3g}): {kind}")


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (or of the end of the shorter list), None if equal."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


@torch.no_grad()
def one_token_logits(target, context: torch.Tensor) -> torch.Tensor:
    """float32 [V]: the logits of the token after ``context`` [P] as vanilla decoding computes them, one token
    forwarded after the committed rest. Leaves ``target`` holding ``context`` committed but for its last token."""
    target.prefill(context[:-1])
    return target.forward(context[-1:]).logits[-1].float()


def find_divergence(target, prompt_ids: torch.Tensor, expected: list[int], got: list[int]) -> Divergence | None:
    """None if ``got`` equals ``expected`` (the reference's new tokens after ``prompt_ids`` [P]), else the first
    `Divergence`, measured on ``target``'s one-token step there."""
    i = first_difference(expected, got)
    if i is None:
        return None
    context = torch.cat([prompt_ids.cpu(), torch.tensor(expected[:i], dtype=prompt_ids.dtype)])
    logits = one_token_logits(target, context)
    top = torch.topk(logits, 2).values
    expected_token = expected[i] if i < len(expected) else -1
    got_token = got[i] if i < len(got) else -1
    if expected_token < 0 or got_token < 0:
        margin = float("inf")
    else:
        margin = float(logits[expected_token] - logits[got_token])
    return Divergence(i, expected_token, got_token, margin, float(top[0] - top[1]), float(logits.abs().max()),
                      near_tie_relative(target.model))


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


def argmax_agreement(reference_logits: torch.Tensor, logits: torch.Tensor) -> Agreement:
    """Compare argmax tokens of ``logits`` [n, V] with those of ``reference_logits`` [n, V]."""
    reference_logits, logits = reference_logits.float(), logits.float()
    agree = reference_logits.argmax(-1) == logits.argmax(-1)
    top = torch.topk(reference_logits, 2, dim=-1).values
    margins = (top[:, 0] - top[:, 1])[~agree]
    return Agreement(int(agree.numel()), int(agree.sum()), [float(m) for m in margins])
