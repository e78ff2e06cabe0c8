"""Generation with capture: the target plays out conversation jobs in batches and records, in the forward that
consumes each token, everything a draft head trains on — no second feature pass.

Every running conversation is a `Target.fork` (its own KV cache); one packed forward per step
(`specula.runtime.packed.forward_packed`, the server's batched path) runs each conversation's pending tokens:
its whole prompt at first, then one token a step while the target writes, or the token that closed a turn with
the chat template's text up to the next written turn. A finished job's slot takes the next job at once
(continuous batching). For every token fed, the forward's rows give the token's features:

- ``layer_inputs`` [T, L, H]: inputs of the requested decoder layers (EAGLE-3's fused low/mid/high layers);
- ``hidden`` [T, H]: the final post-norm hidden state, when requested (EAGLE's feature);
- ``dist_ids`` int32 [T, k], ``dist_probs`` [T, k]: the target's top-k next-token distribution at temperature 1
  (softmax of the same forward's logits, in the weights format being served), sorted by probability; all zero on
  rows whose logits were not computed (a prompt's rows but its last: no response token is decided there).

A sample's last token (usually the end-of-turn token) is fed too, so features and distributions cover every
position, exactly what a forward over the finished sequence gives (`tests/test_capture.py`). Samples are the
conversation's tokens with ``loss_mask`` True on the assistant turns the target wrote (their end-of-turn token
included); fixed text and Magpie user turns are context.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from specula.runtime.packed import Block, forward_packed
from specula.runtime.target import FeatureRequest, Target
from specula.sampling import sample_rows
from specula.training.conversations import Conversation, Job, Ref, Turn
from specula.training.records import has_chat_template
from specula.training.synthesis import SynthesisOptions, rejection

PROBE = "SpeculaTurnProbe{}Q"
USER_FILTER = SynthesisOptions(max_chars=1200)  # Magpie follow-ups: a closed turn of Latin-script text


@dataclass
class CapturedSample:
    """One conversation with its features; tensors as in the module docstring, [T, ...] over its tokens."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    layer_inputs: torch.Tensor | None
    hidden: torch.Tensor | None
    dist_ids: torch.Tensor
    dist_probs: torch.Tensor
    info: dict


def plan(tokenizer, conversation: Conversation, texts: dict[Ref, str]) -> list[list[int] | tuple[int, Turn]]:
    """The conversation as steps: token ids of fixed text, and (turn index, turn) for each turn the target writes.

    Fixed text is the chat template's rendering around the written turns (found by rendering probe contents),
    with fixed contents and quoted earlier turns (``texts``) filled in, tokenized as `apply_chat_template` would;
    the text after the last written turn is left out (the sample ends where the target stopped). Without a chat
    template turns are plain text ("\\n\\n" before each user turn but the first), tokenized with the tokenizer's
    special tokens (e.g. BOS) at the start.
    """
    templated = has_chat_template(tokenizer)
    contents = [None if t.generated else "".join(p if isinstance(p, str) else texts[p] for p in t.parts)
                for t in conversation.turns]
    if templated:
        probes = [PROBE.format(k) for k in range(len(contents))]
        rendered = tokenizer.apply_chat_template([{"role": t.role, "content": p} for t, p in
                                                  zip(conversation.turns, probes, strict=True)], tokenize=False)
        pieces, rest = [], rendered
        for probe in probes:
            before, found, rest = rest.partition(probe)
            if not found:
                raise ValueError("the chat template does not render every turn's content in order")
            pieces.append(before)
    else:
        pieces = [("\n\n" if k and t.role != "assistant" else "") for k, t in enumerate(conversation.turns)]
    steps: list[list[int] | tuple[int, Turn]] = []
    text = ""
    for k, (turn, piece, content) in enumerate(zip(conversation.turns, pieces, contents, strict=True)):
        text += piece
        if content is not None:
            text += content
            continue
        ids = tokenizer(text, add_special_tokens=not templated and not steps, verbose=False).input_ids
        steps += [list(ids), (k, turn)]
        text = ""
    return steps


@dataclass
class _Slot:
    target: Target
    job: Job | None = None
    conversation: int = 0
    texts: dict[Ref, str] = field(default_factory=dict)
    samples: list[CapturedSample] = field(default_factory=list)
    steps: list = field(default_factory=list)
    step: int = 0
    pending: list[int] = field(default_factory=list)
    pending_mask: list[bool] = field(default_factory=list)
    prompt: bool = False  # the pending block is a conversation's prompt (only its last row's logits)
    final: bool = False  # the pending block is the sample's last token
    written: list[int] = field(default_factory=list)  # the turn being written
    turn_start: int = 0  # sample length before the scaffold of the turn being written
    generator: torch.Generator | None = None
    rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    length: int = 0  # tokens in rows (kept, not summed: a step asked every slot, and summing was 7 % of capture)


class CaptureEngine:
    """Runs jobs ``batch_size`` at a time through ``target`` and hands each finished job's samples to a callback."""

    def __init__(self, target: Target, request: FeatureRequest, top_k: int = 32,
                 feature_dtype: torch.dtype = torch.float16, batch_size: int = 32, max_length: int = 4096):
        if top_k < 1 or batch_size < 1 or max_length < 8:
            raise ValueError("top_k and batch_size must be >= 1 and max_length >= 8")
        self.target, self.request, self.top_k = target, request, min(top_k, target.vocab_size)
        self.feature_dtype, self.batch_size = feature_dtype, batch_size
        self.max_length = min(max_length, target.max_length)
        self.tokenizer = target.tokenizer
        self.eos = target.eos_token_ids
        self.slots = [_Slot(target.fork()) for _ in range(batch_size)]
        self.fed_tokens = 0

    def run(self, jobs: Iterator[Job], done: Callable[[Job, list[CapturedSample]], None]) -> None:
        """Play out every job of ``jobs`` (taken as slots free up); ``done(job, samples)`` as each one ends."""
        source = iter(jobs)
        exhausted = False
        while True:
            for slot in self.slots:
                while slot.job is None and not exhausted:
                    job = next(source, None)
                    if job is None:
                        exhausted = True
                        break
                    self._start_job(slot, job, done)
            active = [slot for slot in self.slots if slot.job is not None]
            if not active:
                return
            self._step(active, done)

    # ------------------------------------------------------------------------------------------- job flow

    def _start_job(self, slot: _Slot, job: Job, done) -> None:
        slot.job, slot.conversation, slot.texts, slot.samples = job, 0, {}, []
        self._start_conversation(slot, done)

    def _start_conversation(self, slot: _Slot, done) -> None:
        """Set the slot up for its job's next conversation; end the job when there is none (or it cannot run)."""
        job = slot.job
        while slot.conversation < len(job.conversations):
            conversation = job.conversations[slot.conversation]
            quoted = [p for t in conversation.turns for p in t.parts if not isinstance(p, str)]
            if any(ref not in slot.texts for ref in quoted):  # an earlier turn it quotes was never written
                break
            steps = plan(self.tokenizer, conversation, slot.texts)
            if len(steps[0]) + 2 > self.max_length:
                break
            slot.steps, slot.step, slot.written, slot.rows, slot.length = steps, 1, [], {}, 0
            slot.pending, slot.pending_mask = list(steps[0]), [False] * len(steps[0])
            slot.prompt, slot.final, slot.turn_start = True, False, 0
            slot.generator = torch.Generator().manual_seed((job.seed + slot.conversation) % 2**63)
            slot.target.reset()
            return
        done(job, slot.samples)
        slot.job = None

    def _step(self, active: list[_Slot], done) -> None:
        blocks = [Block(torch.tensor(s.pending, dtype=torch.long), None, None, self.request, s.prompt)
                  for s in active]
        outputs = forward_packed([s.target for s in active], blocks)
        logits = torch.cat([out.logits for out in outputs]).float()
        probs = torch.softmax(logits, dim=-1)
        top_probs, top_ids = probs.topk(self.top_k, dim=-1)
        last_rows = torch.tensor([out.logits.shape[0] for out in outputs]).cumsum(0) - 1
        tokens = self._next_tokens(active, logits[last_rows])
        first = 0
        for slot, out, token in zip(active, outputs, tokens, strict=True):
            n, count = len(slot.pending), out.logits.shape[0]
            slot.target.commit()
            self.fed_tokens += n
            self._record(slot, out, top_ids[first:first + count], top_probs[first:first + count], n)
            first += count
            if slot.final:
                self._finish_conversation(slot, done)
            else:
                self._advance(slot, token, done)

    def _next_tokens(self, active: list[_Slot], logits: torch.Tensor) -> list[int]:
        """Each slot's next token from ``logits`` [B, V], its last row: the argmax where the turn being written
        is greedy, else a sample at the turn's temperature — all sampled rows in one inverse-CDF draw
        (`sample_rows`), each with a uniform from its slot's own generator, so a job's tokens depend on its seed
        alone, not on which jobs share its steps. Slots whose sample is complete get the argmax, unused."""
        temperatures = torch.tensor([0.0 if s.final else float(s.steps[s.step][1].temperature) for s in active])
        tokens = logits.argmax(dim=-1)
        sampled = (temperatures > 0).nonzero().squeeze(1)
        if len(sampled):
            warped = torch.softmax(logits[sampled] / temperatures[sampled].unsqueeze(1), dim=-1)
            uniforms = torch.stack([torch.rand((), generator=active[i].generator) for i in sampled.tolist()])
            tokens[sampled] = sample_rows(warped, uniforms)
        return tokens.tolist()

    def _record(self, slot: _Slot, out, ids: torch.Tensor, probs: torch.Tensor, n: int) -> None:
        rows = slot.rows
        dist_ids = torch.zeros(n, self.top_k, dtype=torch.int32)
        dist_probs = torch.zeros(n, self.top_k, dtype=torch.float32)
        dist_ids[n - ids.shape[0]:] = ids.to(torch.int32).cpu()
        dist_probs[n - ids.shape[0]:] = probs.cpu()
        parts = {"input_ids": torch.tensor(slot.pending, dtype=torch.long),
                 "loss_mask": torch.tensor(slot.pending_mask, dtype=torch.bool),
                 "dist_ids": dist_ids, "dist_probs": dist_probs.to(self.feature_dtype)}
        if self.request.layer_inputs:
            parts["layer_inputs"] = torch.stack([out.layer_inputs[i] for i in self.request.layer_inputs], 1).to(
                "cpu", self.feature_dtype)
        if self.request.final_hidden:
            parts["hidden"] = out.hidden.to("cpu", self.feature_dtype)
        for name, value in parts.items():
            rows.setdefault(name, []).append(value)
        slot.length += n

    def _advance(self, slot: _Slot, token: int, done) -> None:
        """Append ``token`` to the turn being written; on its end, queue the text up to the next written turn."""
        k, turn = slot.steps[slot.step]
        slot.written.append(token)
        assistant = turn.role == "assistant"
        length = slot.length
        ended = token in self.eos or len(slot.written) >= turn.max_new_tokens or length + 2 > self.max_length
        slot.prompt = False
        slot.pending, slot.pending_mask = [token], [assistant]
        if not ended:
            return
        text = self.tokenizer.decode([t for t in slot.written if t not in self.eos], skip_special_tokens=True)
        if not assistant and (token not in self.eos or rejection(text.strip(), USER_FILTER)):
            # A follow-up that is unfinished, too short or not text: the conversation ends before it.
            self._cut(slot, slot.turn_start)
            self._finish_conversation(slot, done)
            return
        slot.texts[(slot.conversation, k)] = text.strip()
        slot.written = []
        if slot.step + 1 < len(slot.steps):  # fixed text, then the next written turn
            scaffold = list(slot.steps[slot.step + 1])
            if scaffold and scaffold[0] == token and token in self.eos:
                scaffold = scaffold[1:]  # the template closes the turn with the token the target just wrote
            if length + 1 + len(scaffold) + 2 <= self.max_length:
                slot.turn_start = length + 1
                slot.pending += scaffold
                slot.pending_mask += [False] * len(scaffold)
                slot.step += 2
                return
        slot.final = True

    def _cut(self, slot: _Slot, length: int) -> None:
        slot.rows = {name: [torch.cat(parts)[:length]] for name, parts in slot.rows.items()}
        slot.length = min(slot.length, length)

    def _finish_conversation(self, slot: _Slot, done) -> None:
        rows = {name: torch.cat(parts) for name, parts in slot.rows.items()}
        if rows and bool(rows["loss_mask"].any()):
            job = slot.job
            info = {"job": job.index, "kind": job.kind, "conversation": slot.conversation,
                    "temperature": job.temperature}
            slot.samples.append(CapturedSample(rows["input_ids"], rows["loss_mask"], rows.get("layer_inputs"),
                                               rows.get("hidden"), rows["dist_ids"], rows["dist_probs"], info))
        slot.rows, slot.length = {}, 0
        slot.conversation += 1
        self._start_conversation(slot, done)


def training_item(input_ids: torch.Tensor, loss_mask: torch.Tensor, dist_ids: torch.Tensor, dist_probs: torch.Tensor,
                  layer_inputs: torch.Tensor | None = None, hidden: torch.Tensor | None = None
                  ) -> dict[str, torch.Tensor]:
    """A sample as a trainer reads one, tensors as in the module docstring: ids as int64, probabilities as float32,
    and ``target_top`` [T], the target's own top token where its distribution was recorded (else 0)."""
    ids, probs = dist_ids.long(), dist_probs.float()
    item = {"input_ids": input_ids.long(), "loss_mask": loss_mask, "dist_ids": ids, "dist_probs": probs,
            "target_top": torch.where(probs[:, 0] > 0, ids[:, 0], 0)}
    item.update({k: v for k, v in (("layer_inputs", layer_inputs), ("hidden", hidden)) if v is not None})
    return item


def answer_prompts(target: Target, conversations: list[list[str]], request: FeatureRequest,
                   max_new_tokens: int = 128, batch_size: int = 32) -> list[dict[str, torch.Tensor]]:
    """The target's greedy answers to each conversation's user turns in turn (its own earlier answers in context,
    as `specula bench` asks MT-bench's two turns), features captured in float32 as it writes: evaluation samples
    (`training_item`), in the order given."""
    jobs = [Job(index, "evaluation", 0, 0.0, (Conversation(tuple(
        turn for text in turns for turn in (Turn("user", (text,)), Turn("assistant", (), 0.0, max_new_tokens)))),))
        for index, turns in enumerate(conversations)]
    found: dict[int, list[CapturedSample]] = {}
    engine = CaptureEngine(target, request, feature_dtype=torch.float32, batch_size=min(batch_size, len(jobs) or 1))
    engine.run(iter(jobs), lambda job, samples: found.__setitem__(job.index, samples))
    return [training_item(s.input_ids, s.loss_mask, s.dist_ids, s.dist_probs, s.layer_inputs, s.hidden)
            for index in range(len(jobs)) for s in found[index]]
