"""Greedy equality explained: where a T=0 record leaves the baseline's tokens, near-tie or real.

The same classification as `specula check` (`specula.divergence.explain`): at a record's first
divergence from the baseline (vanilla) the target's logits for the baseline's prefix are recomputed
and the divergence is called a ``near-tie`` (within the weight dtype's rounding noise) or ``real``.
As in the check, the near-tie allowance applies only where the target's verify pass is not row-invariant
(`specula.divergence.probe_row_invariance`, probed once at the first divergence): on a row-invariant target
outputs must be identical and every divergence but an exact tie is real.
"""

from __future__ import annotations

import torch

from specula.chat.template import conversation_ids
from specula.divergence import explain, probe_row_invariance


def annotate_divergences(records: list[dict], target, questions: dict, baseline: str, max_prompt_tokens: int) -> None:
    """Set ``record["divergence"]`` on every T=0 record of another method than ``baseline``.

    None when its tokens (all turns) equal the baseline's, else the first divergence as a dict:
    ``turn`` plus the fields of `specula.divergence.Divergence` (``kind`` is near-tie or real).
    Records that already have the field (a resumed run) and questions not in ``questions``
    (uid -> Question) are left alone. Later turns are compared only while earlier turns are equal,
    since each turn's prompt holds the answers before it.
    """
    tokenizer = target.tokenizer
    invariant = None  # probed at the first divergence: identical runs need no probe
    base = {r["question"]: r for r in records if r["method"] == baseline and float(r["temperature"]) == 0}
    for record in records:
        if float(record["temperature"]) != 0 or record["method"] == baseline or "divergence" in record:
            continue
        theirs, question = base.get(record["question"]), questions.get(record["question"])
        if theirs is None or question is None:
            continue
        record["divergence"] = None
        answers: list[str] = []
        for turn, (mine, expected) in enumerate(zip(record["turns"], theirs["turns"], strict=False)):
            if mine["token_ids"] != expected["token_ids"]:
                ids, _ = conversation_ids(tokenizer, list(question.turns[: turn + 1]), answers, max_prompt_tokens)
                if invariant is None:
                    invariant = not probe_row_invariance(target, torch.tensor(ids), expected["token_ids"])
                found = explain(target, torch.tensor(ids), expected["token_ids"], mine["token_ids"],
                                invariant=invariant)
                record["divergence"] = {"turn": turn, "row_invariant": invariant, **found.as_dict()}
                break
            answers.append(tokenizer.decode(expected["token_ids"], skip_special_tokens=True))

