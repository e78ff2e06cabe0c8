"""Explaining where a method's greedy output leaves vanilla's: a floating-point near-tie, or a real divergence.

At temperature 0 a lossless method emits the target's argmax at every position, so its tokens
equal plain (vanilla) greedy decoding's. Equal *in exact arithmetic*: the method computes the
target's logits in a verify pass over a block of k tokens, vanilla in one-token steps, and the two
matrix shapes round differently. Where the target's top two logits nearly tie, that rounding can
flip the argmax, and the texts part although both runs are correct.

So each divergence is judged on the target's own logits for vanilla's prefix at the position where
the texts part: ``gap`` = logit of vanilla's token − logit of the method's token. If ``|gap|`` is within
the rounding noise of the weight dtype the divergence is a ``near-tie``; otherwise it is ``real``,
i.e. the method emitted a token the target does not prefer by a margin no rounding explains.

Tolerance. Rounding noise in a logit scales with the logit scale (max |logit|) times the dtype's
machine epsilon. Measured between a one-token step and a 6-token block on stories260k and
pycoder-25m: float32 up to 8e-7·max|logit| (about 7 ε), bfloat16 up to 1.3e-2·max|logit| (1.6 ε:
its logits are themselves rounded to bfloat16). The tolerance is

    tolerance = max(ULPS · ε(dtype), RELATIVE_FLOOR) · max|logit|,   ULPS = 4, RELATIVE_FLOOR = 1e-4,

i.e. bfloat16 3.1e-2, float16 3.9e-3 and float32 1e-4 of the logit scale. The float32 floor leaves two
orders of magnitude above the noise measured on small models, for deeper and wider targets whose
reductions reorder over more terms; typical top-2 margins are O(1) logits, so a real bug stays visible.

Row invariance. Where the target's verify pass is row-invariant (`specula.runtime.invariance`: the CPU kernels
in float32, int8, int4 and q4_1 give each row of a k-token block the bits of one-token steps), the two
computations are the same and no rounding separates them: the outputs must be bit-identical. `check_greedy`
probes that on the target itself (`probe_row_invariance`) rather than assume it from the format, and where it
holds judges every divergence with tolerance 0 (only an exact tie of the two logits is excused); the near-tie
allowance is kept for setups where the probe finds rows that differ (e.g. a GPU, or formats without the
invariant kernels), and the result says which applied.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from specula.decoding import GenerationStats
from specula.runtime.invariance import mismatched_rows, tree_block
from specula.runtime.target import Target

ULPS = 4
RELATIVE_FLOOR = 1e-4
NEAR_TIE, REAL = "near-tie", "real"


def compute_dtype(target: Target) -> torch.dtype:
    """The least precise floating dtype ``target`` computes in: its parameters', or a quantized layer's
    kernels' (int8/int4 weights run in bfloat16 on CPU, `specula.runtime.quantized_linear`)."""
    dtypes = {p.dtype for p in target.model.parameters() if p.dtype.is_floating_point}
    dtypes |= {m.compute_dtype for m in target.model.modules() if isinstance(getattr(m, "compute_dtype", None),
                                                                           torch.dtype)}
    return max(dtypes or {target.dtype}, key=lambda d: torch.finfo(d).eps)


def relative_tolerance(dtype: torch.dtype) -> float:
    """Tolerance on a logit difference as a fraction of max|logit|, for logits computed in ``dtype``."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    return max(ULPS * eps, RELATIVE_FLOOR)


@dataclass
class Divergence:
    """The first position where a method's greedy tokens leave vanilla's, judged on the target's logits.

    position:       index into the new tokens (0 is the token the prefill picks).
    vanilla_token:  vanilla's token there, method_token the method's (None for a side whose output ended first).
    margin:         top-1 minus top-2 logit of the target's one-token step on vanilla's prefix.
    gap:            logit of vanilla's token minus logit of the method's token (same logits; inf if none).
    tolerance:      the near-tie threshold for this dtype and logit scale (see the module docstring).
    kind:           ``near-tie`` (|gap| <= tolerance) or ``real``.
    verify_argmax:  argmax of the same row computed in the method's verify shape (a block of
                    ``verify_width`` tokens), when that shape is known; ``shape_noise`` is the largest
                    |difference| between the two computations of that row's logits.
    """

    position: int
    vanilla_token: int | None
    method_token: int | None
    margin: float
    gap: float
    tolerance: float
    kind: str
    verify_width: int | None = None
    verify_argmax: int | None = None
    shape_noise: float | None = None
    vanilla_text: str | None = None  # the two tokens' vocabulary entries, when a caller with a tokenizer fills them in
    method_text: str | None = None

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and v == float("inf") else v) for k, v in asdict(self).items()}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length mismatch counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(logits: torch.Tensor, vanilla_token: int | None, method_token: int | None,
             dtype: torch.dtype, invariant: bool = False) -> tuple[float, float, float, str]:
    """(margin, gap, tolerance, kind) from the target's logits [V] at the divergence. Pure: no model.

    A side whose output ended before the other's (token None) is a real divergence: no tie explains it.
    ``invariant``: the verify pass computes vanilla's very bits, so the tolerance is 0 (an exact tie only).
    """
    row = logits.double()
    top = torch.topk(row, 2).values
    margin = float(top[0] - top[1])
    tolerance = 0.0 if invariant else relative_tolerance(dtype) * float(row.abs().max())
    if method_token is None or vanilla_token is None:
        return margin, float("inf"), tolerance, REAL
    gap = float(row[vanilla_token] - row[method_token])
    return margin, gap, tolerance, NEAR_TIE if abs(gap) <= tolerance else REAL


def _row_logits(target: Target, context: torch.Tensor, width: int, row: int) -> torch.Tensor:
    """Logits [V] of block row ``row`` when the last ``width`` tokens of ``context`` [T] run as one block."""
    if width < len(context):
        target.prefill(context[: len(context) - width])
    else:
        target.reset()
    out = target.forward(context[len(context) - width:])
    target.commit()
    return out.logits[row].float()


def explain(target: Target, prompt: torch.Tensor, vanilla: list[int], method: list[int],
            verify_block: tuple[int, int] | None = None, invariant: bool = False) -> Divergence | None:
    """Judge the first divergence of ``method``'s new tokens from ``vanilla``'s (None if they are equal).

    ``prompt`` int64 [P]. The target's logits are recomputed for vanilla's prefix as vanilla computed
    them (the prompt's prefill for position 0, else a one-token step). ``verify_block`` = (start, width):
    the verify pass that produced the divergent token began at new-token index ``start`` − 1 (its root)
    and ran ``width`` tokens; the same row is recomputed in that shape, filling the block with vanilla's
    later tokens (causally invisible to the row, they only reproduce the matrix shape). The target's
    cache is reset: call this between generations, not during one. ``invariant``: see `classify`.
    """
    position = first_difference(vanilla, method)
    if position is None:
        return None
    device = target.device
    ids = torch.cat([prompt.to(device), torch.tensor(vanilla, dtype=torch.long, device=device)])
    context = ids[: len(prompt) + position]  # everything before the divergent token
    with torch.no_grad():
        one_step = _row_logits(target, context, len(context) if position == 0 else 1, -1)
        vanilla_token = vanilla[position] if position < len(vanilla) else None
        method_token = method[position] if position < len(method) else None
        margin, gap, tolerance, kind = classify(one_step, vanilla_token, method_token, compute_dtype(target),
                                                invariant)
        result = Divergence(position, vanilla_token, method_token, margin, gap, tolerance, kind)
        if verify_block is not None and position > 0:
            start, width = verify_block
            row = position - start  # block row 0 is the root, new token start - 1, whose logits judge token start
            block_start = len(prompt) + start - 1
            block_end = min(len(ids), block_start + max(width, row + 1))
            shaped = _row_logits(target, ids[:block_end], block_end - block_start, row)
            result.verify_width = block_end - block_start
            result.verify_argmax = int(torch.argmax(shaped))
            result.shape_noise = float((shaped - one_step).abs().max())
    target.reset()
    return result


# ---------------------------------------------------------------- a method against vanilla


@dataclass
class GreedyResult:
    """T = 0: per prompt, the method's tokens against vanilla's."""

    prompts: int
    max_new_tokens: int
    identical: int
    compared_tokens: int
    drafted: int
    accepted: int
    relative_tolerance: float
    divergences: list[tuple[int, Divergence]] = field(default_factory=list)  # (prompt index, divergence)
    # `probe_row_invariance` on this target: block -> its rows that differ from one-token steps ({} = invariant)
    mismatched: dict[str, list[int]] = field(default_factory=dict)

    @property
    def row_invariant(self) -> bool:
        """Whether the probe found every verify row bit-equal to one-token steps (divergences then have tolerance 0)."""
        return not self.mismatched

    def count(self, kind: str) -> int:
        return sum(d.kind == kind for _, d in self.divergences)

    def as_dict(self) -> dict:
        return {"prompts": self.prompts, "max_new_tokens": self.max_new_tokens, "identical": self.identical,
                "compared_tokens": self.compared_tokens, "drafted": self.drafted, "accepted": self.accepted,
                "relative_tolerance": 0.0 if self.row_invariant else self.relative_tolerance,
                "row_invariant": self.row_invariant, "mismatched_probe_rows": self.mismatched,
                "near_ties": self.count(NEAR_TIE), "real": self.count(REAL),
                "divergences": [{"prompt": i, **d.as_dict()} for i, d in self.divergences]}


def _verify_block(stats: GenerationStats, position: int) -> tuple[int, int] | None:
    """(first new-token index, block width) of the cycle that emitted new token ``position`` (None: the prefill)."""
    start = 1  # the prefill emits token 0
    for accepted, size in zip(stats.accepted_lengths, stats.tree_sizes, strict=True):
        if position < start + accepted + 1:
            return start, size + 1
        start += accepted + 1
    return None


PROBE_CHAIN = 8
PROBE_TREE = [-1, 0, 0, 1, 1, 2, 4, 3]  # each node's parent: a root, two children, four grandchildren, one below


@torch.no_grad()
def probe_row_invariance(target: Target, prompt: torch.Tensor, continuation: list[int]) -> dict[str, list[int]]:
    """{block: rows whose logits are not bit-equal to one-token steps over the same tokens} after ``prompt`` [P],
    for a chain of ``continuation``'s first tokens and a tree of them (`specula.runtime.invariance`); {} when the
    verify pass is row-invariant here. Measured, not assumed from the format: kernels and devices decide it."""
    room = target.max_length - int(prompt.numel())
    tokens = (list(continuation) + prompt.tolist() * PROBE_CHAIN)[:min(PROBE_CHAIN, room)]
    found = {}
    target.prefill(prompt.to(target.device))
    chain = torch.tensor(tokens, dtype=torch.long, device=target.device)
    found[f"chain of {len(tokens)}"] = mismatched_rows(target, chain)
    if len(tokens) >= len(PROBE_TREE):
        mask, depths = tree_block(PROBE_TREE)
        found[f"tree of {len(PROBE_TREE)}"] = mismatched_rows(target, chain[:len(PROBE_TREE)],
                                                              mask.to(target.device), depths)
    target.reset()
    return {block: rows for block, rows in found.items() if rows}


def check_greedy(speculator, vanilla, prompts: list[torch.Tensor], max_new_tokens: int) -> GreedyResult:
    """Part 1: the method against vanilla at T = 0, every divergence explained (with tolerance 0 where the probe
    finds the verify pass row-invariant, unless the divergence's own verify block, recomputed, shows otherwise)."""
    target = speculator.target
    result = GreedyResult(len(prompts), max_new_tokens, 0, 0, 0, 0, relative_tolerance(compute_dtype(target)))
    for index, ids in enumerate(prompts):
        expected = vanilla.generate(ids, max_new_tokens).token_ids
        if index == 0:
            result.mismatched = probe_row_invariance(target, ids, expected)
        run = speculator.generate(ids, max_new_tokens)
        result.drafted += sum(run.stats.tree_sizes)
        result.accepted += sum(run.stats.accepted_lengths)
        position = first_difference(expected, run.token_ids)
        if position is None:
            result.identical += 1
            result.compared_tokens += len(expected)
            continue
        block = _verify_block(run.stats, position)
        divergence = explain(target, ids, expected, run.token_ids, block, result.row_invariant)
        if result.row_invariant and divergence.shape_noise:
            # The probe's blocks were row-invariant, the verify block that emitted this token was not (on a GPU
            # int8 passes of 64 rows differ where 8 do not): judge it as on a target without invariance.
            result.mismatched[f"verify block of {divergence.verify_width}"] = [position - block[0]]
            divergence = explain(target, ids, expected, run.token_ids, block, False)
        for side, token in (("vanilla_text", divergence.vanilla_token), ("method_text", divergence.method_token)):
            setattr(divergence, side, None if token is None else speculator.tokenizer.convert_ids_to_tokens(token))
        result.compared_tokens += divergence.position + 1
        result.divergences.append((index, divergence))
    return result
