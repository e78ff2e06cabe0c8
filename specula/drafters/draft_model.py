"""`sps`: standard speculative sampling (Leviathan et al.) with a separate small draft model.

The draft model runs autoregressively for γ tokens from the root, greedily at
temperature 0 and by sampling (recording its distributions q) otherwise. It
keeps its own KV cache holding a prefix of the committed text; each cycle it
first catches up on committed tokens it has not seen, then drafts.
"""

from __future__ import annotations

import copy

import torch

from specula.errors import SpeculaError
from specula.runtime.target import FeatureRequest, ForwardOutput, Target
from specula.sampling import SamplingParams, probabilities, sample
from specula.tree import DraftTree


def check_same_vocabulary(target: Target, draft: Target) -> None:
    """Speculative sampling compares distributions token by token, so both models must share ids."""
    if draft.vocab_size != target.vocab_size:
        raise SpeculaError(
            f"draft vocabulary size {draft.vocab_size} differs from the target's {target.vocab_size}; "
            "sps needs a draft model with the target's tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise SpeculaError("draft tokenizer differs from the target's; sps needs the same tokenizer")


class DraftModelDrafter:
    name = "sps"
    features = FeatureRequest()

    def __init__(self, draft: Target, num_tokens: int = 4):
        if num_tokens < 1:
            raise SpeculaError("sps needs at least one draft token per cycle (gamma >= 1)")
        self.draft = draft
        self.num_tokens = num_tokens
        self.seen: list[int] = []  # ids held in the draft's cache, in order
        self.context_length = 0  # length of the context of the last proposal

    def start(self, prompt: torch.Tensor, target_out: ForwardOutput) -> None:
        # A draft with a shorter context than the target's drafts only while the text fits it.
        self.draft.reset()
        self.seen = []
        if len(prompt) < self.draft.max_length:
            self.draft.prefill(prompt)
            self.seen = prompt.tolist()

    def propose(self, context: torch.Tensor, max_depth: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        root = int(context[-1])
        self.context_length = len(context)
        depth = min(self.num_tokens, max_depth, self.draft.max_length - len(context))
        if depth <= 0 or not self.seen:
            return DraftTree.root_only(root, device=context.device)
        pending = context[len(self.seen):]  # committed text the draft has not processed, ending in the root
        logits = self._extend(pending)
        drafts, dists, confidences = [], [], []
        for step in range(depth):
            if params.greedy:
                token = int(torch.argmax(logits))
                confidences.append(float(torch.softmax(logits.float(), dim=-1)[token]))
            else:
                q = probabilities(logits, params)
                token = sample(q, generator)
                dists.append(q)
                confidences.append(float(q[token]))
            drafts.append(token)
            if step + 1 < depth:
                logits = self._extend(torch.tensor([token], device=context.device))
        # The draft cache now holds the context plus all drafts but the last.
        self.seen = context.tolist() + drafts[:-1]
        return DraftTree.chain(root, drafts, torch.stack(dists) if dists else None, device=context.device,
                               confidences=confidences)

    def _extend(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.draft.forward(tokens)
        self.draft.commit()
        return out.logits[-1]

    def fork(self) -> DraftModelDrafter:
        other = copy.copy(self)  # the draft model's weights are shared; its KV cache is not
        other.draft = self.draft.fork()
        other.seen, other.context_length = [], 0
        return other

    def observe(self, accepted: torch.Tensor, target_out: ForwardOutput) -> None:
        # The committed text is now the proposal's context plus the accepted drafts; whatever the
        # draft cached beyond that (rejected drafts) is stale.
        valid = min(len(self.seen), self.context_length + len(accepted) - 1)
        self.draft.truncate(valid)
        self.seen = self.seen[:valid]
