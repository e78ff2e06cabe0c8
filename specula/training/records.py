"""Training records and samples: JSONL records → token samples with a loss mask on the response.

Records (`read_records`): a JSONL file, one object per line, in one of three formats:
- ShareGPT: ``{"conversations": [{"from": "system"|"human"|"user"|"gpt"|"assistant", "value": str}, ...]}``
  (``"messages"`` with ``"role"``/``"content"`` is read the same way; leading assistant turns are dropped);
- ``{"prompt": str}``, optionally with ``"response": str`` (one user turn and its reply);
- ``{"text": str}``: raw text.

Samples (`TrainingSample`): ``input_ids`` int64 [T] and ``loss_mask`` bool [T], True exactly on the
response tokens (the tokens a drafter learns to predict; the prompt is context only).

Rendering. When the tokenizer has a chat template (``tokenizer.chat_template`` is not None) a
conversation is rendered with it and tokenized without extra special tokens (as
``apply_chat_template(tokenize=True)`` does); a response is an assistant turn as the template renders
it after the generation prompt: its content and the template's end-of-turn marker, without trailing
whitespace. Without a chat template the turns are plain text, concatenated as they are, with "\\n\\n"
before every user or system turn but the first, so that a prompt record is exactly prompt + response
(the natural form for a completion model such as a code model); tokenization adds the tokenizer's
special tokens (e.g. BOS) as `transformers` does. A token belongs to the response when its last
character lies in a response span.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.files.jsonl import json_lines

ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


Log = Callable[[str], None]


@dataclass(frozen=True)
class TrainingRecord:
    """One JSONL line: a conversation (a prompt record is one user turn and maybe its reply) or raw text."""

    messages: tuple[tuple[str, str], ...] = ()  # (role, content); role is system, user or assistant
    text: str | None = None
    source: str = ""  # "file, line n", for messages

    @property
    def has_response(self) -> bool:
        return self.text is not None or any(role == "assistant" for role, _ in self.messages)


@dataclass
class TrainingSample:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T], True on response tokens

    @classmethod
    def of(cls, ids: Sequence[int], mask: Sequence[bool]) -> TrainingSample:
        return cls(torch.tensor(list(ids), dtype=torch.long), torch.tensor(list(mask), dtype=torch.bool))


# ---------------------------------------------------------------------------------------------- records


def read_records(path: str | Path) -> list[TrainingRecord]:
    """Records of a JSONL file in any of the three formats; blank lines are skipped."""
    file = Path(path)
    if not file.is_file():
        raise SpeculaError(f"training data file not found: {path}")
    records = []
    try:
        with file.open(encoding="utf-8") as lines:
            for _, where, obj in json_lines(lines, lambda n: f"{path}, line {n}"):
                records.append(parse_record(obj, where))
    except UnicodeDecodeError as err:
        raise SpeculaError(f"training data file {path} is not UTF-8 text") from err
    if not records:
        raise SpeculaError(f"training data file {path} holds no records")
    return records


def parse_record(obj, where: str = "record") -> TrainingRecord:
    """One decoded JSON object as a record, or a SpeculaError naming ``where``."""
    if not isinstance(obj, dict):
        raise SpeculaError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "conversations" in obj or "messages" in obj:
        turns = obj["conversations"] if "conversations" in obj else obj["messages"]
        if not isinstance(turns, list) or not turns:
            raise SpeculaError(f"{where}: 'conversations' must be a non-empty list of turns")
        messages = []
        for k, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise SpeculaError(f"{where}: turn {k} is not an object with 'from' and 'value'")
            speaker = turn.get("from", turn.get("role"))
            if speaker not in ROLES:
                raise SpeculaError(f"{where}: turn {k} has speaker {speaker!r}; expected one of {', '.join(ROLES)}")
            messages.append((ROLES[speaker], _string(turn.get("value", turn.get("content")), f"turn {k} value",
                                                      where)))
        while messages and messages[0][0] == "assistant":  # some ShareGPT dumps open with the model's turn
            messages.pop(0)
        if not any(role == "user" for role, _ in messages):
            raise SpeculaError(f"{where}: the conversation has no human/user turn")
        return TrainingRecord(tuple(messages), source=where)
    if "prompt" in obj:
        messages = [("user", _string(obj["prompt"], "'prompt'", where))]
        if obj.get("response") is not None:
            messages.append(("assistant", _string(obj["response"], "'response'", where)))
        return TrainingRecord(tuple(messages), source=where)
    if "text" in obj:
        return TrainingRecord(text=_string(obj["text"], "'text'", where), source=where)
    raise SpeculaError(f"{where}: unknown record format: expected a 'conversations', 'prompt' or 'text' field")


def _string(value, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise SpeculaError(f"{where}: {what} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise SpeculaError(f"{where}: {what} is empty")
    return value


# ---------------------------------------------------------------------------------- rendering, tokens


def has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def render(tokenizer, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = False,
           ) -> tuple[str, list[tuple[int, int]]]:
    """Text of a conversation and the character spans [start, end) of its assistant turns."""
    if not has_chat_template(tokenizer):
        return _render_plain(messages)
    text = _apply_template(tokenizer, messages, add_generation_prompt)
    spans: list[tuple[int, int]] = []
    search = 0
    for i, (role, content) in enumerate(messages):
        if role != "assistant":
            continue
        before = _apply_template(tokenizer, messages[:i], True) if i else ""
        through = _apply_template(tokenizer, messages[: i + 1], False)
        if through.startswith(before) and text.startswith(through):
            start, end = len(before), len(before) + len(through[len(before):].rstrip())
        else:  # a template that re-renders earlier turns (e.g. dropping their reasoning) is not incremental
            start = text.find(content, search)
            if start < 0:
                raise SpeculaError(f"cannot find assistant turn {i} in the chat template's rendering")
            end = start + len(content)
        spans.append((start, end))
        search = end
    return text, spans


def _render_plain(messages: Sequence[tuple[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    parts, spans, length = [], [], 0
    for k, (role, content) in enumerate(messages):
        piece = ("\n\n" if k and role != "assistant" else "") + content
        if role == "assistant":
            spans.append((length, length + len(piece)))
        parts.append(piece)
        length += len(piece)
    return "".join(parts), spans


def _apply_template(tokenizer, messages: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as err:  # jinja2 errors, raise_exception() in templates, ...
        raise SpeculaError(f"the tokenizer's chat template cannot render this conversation: {err}") from err


def tokenize_with_mask(tokenizer, text: str, spans: Sequence[tuple[int, int]], templated: bool,
                       ) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` and, per token, whether its last character lies in one of ``spans``."""
    try:
        encoded = tokenizer(text, add_special_tokens=not templated, return_offsets_mapping=True, verbose=False)
    except NotImplementedError as err:
        raise SpeculaError("building training samples needs a fast tokenizer (one with offset mappings)") from err
    starts = [a for a, _ in spans]
    mask = []
    for start, end in encoded["offset_mapping"]:
        k = bisect.bisect_right(starts, end - 1) - 1
        mask.append(end > start and k >= 0 and end - 1 < spans[k][1])
    return list(encoded["input_ids"]), mask


def build_samples(records: Sequence[TrainingRecord], tokenizer, max_length: int | None = None,
                  log: Log | None = print) -> list[TrainingSample]:
    """Samples from the records' own responses (no regeneration); a text record is trained on whole.

    Samples are cut to ``max_length`` tokens; those left without a response token are dropped.
    """
    templated = has_chat_template(tokenizer)
    samples, dropped = [], 0
    for record in records:
        if record.text is not None:
            ids, mask = tokenize_with_mask(tokenizer, record.text, [(0, len(record.text))], False)
        else:
            if not record.has_response:
                raise SpeculaError(f"{record.source}: no response to train on; let the target regenerate "
                                   "the responses or add one")
            text, spans = render(tokenizer, record.messages)
            ids, mask = tokenize_with_mask(tokenizer, text, spans, templated)
        if max_length is not None:
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            dropped += 1
            continue
        samples.append(TrainingSample.of(ids, mask))
    if dropped and log:
        log(f"dropped {dropped} samples with no response token within {max_length} tokens")
    return samples


# ----------------------------------------------------------------------------------- self-distillation


def offset_lengths(shard_offsets) -> list[int]:
    """Sample lengths [n] from each shard's ``offsets`` (sample i spans offsets[i]:offsets[i + 1]), in shard order."""
    return [b - a for offsets in shard_offsets for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def shard_position(firsts: list[int], total: int, index: int) -> tuple[int, int]:
    """(shard, row within it) of sample ``index`` (negative counts from the end) in ``total`` samples stored in
    shards whose first samples are ``firsts`` (ascending); IndexError outside the samples."""
    if index < 0:
        index += total
    if not 0 <= index < total:
        raise IndexError(f"sample {index} out of range for {total} samples")
    k = bisect.bisect_right(firsts, index) - 1
    return k, index - firsts[k]
