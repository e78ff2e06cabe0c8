"""`pld`: prompt lookup decoding, a training-free drafter.

The newest n tokens of the context are searched for earlier in the context
(n from ``max_ngram`` down to ``min_ngram``); the tokens that followed the most
recent earlier occurrence are proposed as a chain. Code and summaries repeat
their input often, which is where this pays off.
"""

from __future__ import annotations

import torch

from specula.errors import SpeculaError
from specula.runtime.target import FeatureRequest, ForwardOutput
from specula.sampling import SamplingParams
from specula.tree import DraftTree


def lookup_continuation(context: torch.Tensor, max_ngram: int, min_ngram: int, num_tokens: int) -> list[int]:
    """Tokens following the latest earlier match of the longest matching suffix n-gram of ``context`` [T]."""
    length = context.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context[length - n:]
        windows = context[: length - 1].unfold(0, n, 1)  # [length - n, n]: every earlier n-gram start
        hits = torch.nonzero((windows == suffix).all(dim=1)).flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return context[start:start + num_tokens].tolist()
    return []


class PromptLookupDrafter:
    name = "pld"
    features = FeatureRequest()

    def __init__(self, num_tokens: int = 10, max_ngram: int = 3, min_ngram: int = 1):
        if num_tokens < 1 or min_ngram < 1 or max_ngram < min_ngram:
            raise SpeculaError("pld needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        pass

    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        drafts = lookup_continuation(context, self.max_ngram, self.min_ngram, min(self.num_tokens, max_depth))
        return DraftTree.chain(int(context[-1]), drafts, device=context.device)

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        pass

    def fork(self) -> PromptLookupDrafter:
        return self  # no state: it reads the context it is given
