"""Evaluating a draft head while it trains: decoding held-out prompts with it."""

from __future__ import annotations

from specula.decoding import generate_tokens
from specula.runtime.target import Target
from specula.sampling import SamplingParams


def mean_tau(target: Target, drafter, samples, max_new_tokens: int = 48) -> float:
    """Mean tokens per cycle of greedy decoding with ``drafter`` from the prompts of held-out samples."""
    taus = []
    for sample in samples:
        prompt_length = int(sample["loss_mask"].long().argmax())  # the response starts at the first True
        if prompt_length == 0:
            continue
        _, stats = generate_tokens(target, drafter, sample["input_ids"][:prompt_length], max_new_tokens,
                                   SamplingParams())
        taus.append(stats.tau)
    return sum(taus) / len(taus) if taus else 0.0
