"""Training data for draft heads: JSONL records → token samples the target writes itself → target features.

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

Self-distillation (`regenerate`): the target writes the responses, in batches through
``model.generate`` with left padding, sorted by prompt length. Conversations are regenerated turn by
turn (round r writes every conversation's r-th reply, its context holding the replies of the earlier
rounds); a ``{"text"}`` record is cut in half (at most ``max_prompt_tokens`` tokens of prompt) and the
target continues it. A regenerated sample is the prompt's tokens followed by the generated tokens
themselves (up to and including EOS), exactly the sequence the target sees when it answers that prompt.
Prompts longer than ``max_prompt_tokens`` keep their last tokens (and a leading BOS).

Feature cache (`cache_features`, `CachedFeatures`): ``cache_dir/manifest.json`` and shards
``features-00000.safetensors``…; each shard packs its samples' tokens end to end: ``input_ids`` int64
[N], ``loss_mask`` bool [N], ``offsets`` int64 [n + 1] (sample k is rows offsets[k]:offsets[k+1]),
``hidden`` [N, H] (final post-norm hidden states) and ``layer_inputs`` [N, L, H] (inputs of the
requested decoder layers, in the request's order), as `Target.prefill` returns them over the whole
sample. Features are stored in the target's dtype, bit for bit what the target computed (float32 for a
float32 target; half the disk for bfloat16); trainers cast them. A shard is written to a temporary
file and renamed, so an interrupted run leaves only whole shards and the next run computes the rest.
The manifest's fingerprint covers the samples, the target's weights and dtype, the feature request
and the shard size: a cache built for anything else is refused, never silently reused.
``cache_dir/samples.pt`` likewise keeps the samples (regenerated once), with its own fingerprint of the
data, settings, tokenizer and target; an interrupted regeneration resumes from
``cache_dir/samples.journal.jsonl``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.jsonl import json_lines
from specula.outputs import atomic_write, atomic_write_text
from specula.readers import check_safetensors, load_torch, open_safetensors
from specula.target import FeatureRequest, Target

ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
SAMPLES_FILE = "samples.pt"
JOURNAL_FILE = "samples.journal.jsonl"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1

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


@dataclass
class _Job:
    record: int
    prompt: list[int]
    prompt_mask: list[bool]


def regenerate(target: Target, records: Sequence[TrainingRecord], max_new_tokens: int = 256,
               temperature: float = 0.0, batch_size: int = 16, seed: int = 0, max_prompt_tokens: int = 1024,
               journal: str | Path | None = None, progress: bool = True) -> list[TrainingSample]:
    """Samples whose responses the target writes itself (greedy at temperature 0), one per record, in order.

    ``journal``: a JSONL file the finished batches are appended to; a rerun with the same file skips
    them (it must come from the same records, settings and target: see `prepare_samples`).
    On a CPU shared with other busy processes, ``torch.set_num_threads(1)`` can make the many small
    decoding steps several times faster (threads waiting on each other at every operation).
    """
    if max_new_tokens < 1:
        raise SpeculaError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0.0 <= temperature < float("inf"):
        raise SpeculaError(f"temperature must be a finite number >= 0, got {temperature}")
    if batch_size < 1:
        raise SpeculaError(f"batch size must be >= 1, got {batch_size}")
    prompt_limit = min(max_prompt_tokens, target.max_length - max_new_tokens)
    if prompt_limit < 1:
        raise SpeculaError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the target's "
                           f"context of {target.max_length} tokens")
    tokenizer = target.tokenizer
    templated = has_chat_template(tokenizer)
    bos = getattr(tokenizer, "bos_token_id", None)
    histories = [list(record.messages) for record in records]
    points = [_reply_points(record) for record in records]
    done = _Journal(journal)
    last: dict[int, tuple[_Job, list[int]]] = {}
    rounds = max((len(p) for p in points), default=0)
    for rnd in range(rounds):
        jobs = []
        for i, record in enumerate(records):
            if rnd >= len(points[i]):
                continue
            if record.text is not None:
                ids = tokenizer(record.text, verbose=False).input_ids
                cut = min(prompt_limit, max(1, len(ids) // 2))
                jobs.append(_Job(i, ids[:cut], [False] * cut))
                continue
            text, spans = render(tokenizer, histories[i][: points[i][rnd]], add_generation_prompt=True)
            ids, mask = tokenize_with_mask(tokenizer, text, spans, templated)
            if len(ids) > prompt_limit:
                head = 1 if ids[0] == bos else 0
                keep = prompt_limit - head
                ids, mask = ids[:head] + ids[-keep:], mask[:head] + mask[-keep:]
            jobs.append(_Job(i, ids, mask))
        desc = "regenerate" if rounds == 1 else f"regenerate turn {rnd + 1}/{rounds}"
        replies = _generate_jobs(target, jobs, max_new_tokens, temperature, batch_size, seed, rnd, done, desc,
                                 progress)
        for job, reply in zip(jobs, replies, strict=True):
            last[job.record] = (job, reply)
            if records[job.record].text is None:
                at, history = points[job.record][rnd], histories[job.record]
                message = ("assistant", tokenizer.decode(reply, skip_special_tokens=True))
                if at < len(history):
                    history[at] = message
                else:
                    history.append(message)
    done.close()
    return [TrainingSample.of(job.prompt + reply, job.prompt_mask + [True] * len(reply))
            for job, reply in (last[i] for i in sorted(last))]


_regenerate = regenerate  # reachable from `prepare_samples`, whose flag has the same name


def _reply_points(record: TrainingRecord) -> list[int]:
    """Where the target writes a reply: each assistant turn, and after a final user turn."""
    if record.text is not None:
        return [0]
    points = [k for k, (role, _) in enumerate(record.messages) if role == "assistant"]
    if record.messages[-1][0] != "assistant":
        points.append(len(record.messages))
    return points


class _Journal:
    """Finished generation batches, one JSON line each: {"round", "batch", "records", "replies"}."""

    def __init__(self, path: str | Path | None):
        self.path = None if path is None else Path(path)
        self.entries: dict[tuple[int, int], dict] = {}
        self.file = None
        if self.path is None:
            return
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.entries[(entry["round"], entry["batch"])] = entry
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a line torn by an interruption
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a", encoding="utf-8")

    def get(self, rnd: int, batch: int, records: list[int]) -> list[list[int]] | None:
        entry = self.entries.get((rnd, batch))
        return entry["replies"] if entry is not None and entry.get("records") == records else None

    def add(self, rnd: int, batch: int, records: list[int], replies: list[list[int]]) -> None:
        if self.file is not None:
            entry = {"round": rnd, "batch": batch, "records": records, "replies": replies}
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _generate_jobs(target: Target, jobs: list[_Job], max_new_tokens: int, temperature: float, batch_size: int,
                   seed: int, rnd: int, journal: _Journal, desc: str, progress: bool) -> list[list[int]]:
    from tqdm.auto import tqdm

    order = sorted(range(len(jobs)), key=lambda j: (len(jobs[j].prompt), j))
    replies: list[list[int]] = [[] for _ in jobs]
    bar = tqdm(total=len(jobs), desc=desc, unit="prompt", disable=not progress, dynamic_ncols=True)
    produced, started = 0, time.perf_counter()
    for number, first in enumerate(range(0, len(order), batch_size)):
        rows = order[first:first + batch_size]
        records = [jobs[j].record for j in rows]
        batch = journal.get(rnd, number, records)
        if batch is None:
            batch = generate_batch(target, [jobs[j].prompt for j in rows], max_new_tokens, temperature,
                                   seed=(seed * 1_000_003 + rnd) * 1_000_003 + number)
            journal.add(rnd, number, records, batch)
            produced += sum(map(len, batch))
        for j, reply in zip(rows, batch, strict=True):
            replies[j] = reply
        bar.update(len(rows))
        bar.set_postfix(tok_s=f"{produced / max(time.perf_counter() - started, 1e-9):.0f}")
    bar.close()
    return replies


@torch.no_grad()
def generate_batch(target: Target, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                   seed: int = 0) -> list[list[int]]:
    """The target's continuations of ``prompts``, generated together with left padding.

    Each continuation stops after its first EOS (kept) or at ``max_new_tokens``. The model's own
    generation defaults are ignored: greedy at temperature 0, else sampling from the full softmax at
    ``temperature`` (no top-k, top-p or penalties), seeded by ``seed``.
    """
    from transformers import GenerationConfig

    model, eos = target.model, sorted(target.eos_token_ids)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), int(pad), dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        attention[row, width - len(prompt):] = 1
    sampling = temperature > 0
    warping = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if sampling else {}
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sampling, pad_token_id=int(pad),
                              eos_token_id=eos or None, use_cache=True, **warping)
    saved = model.generation_config
    model.generation_config = GenerationConfig()  # so that no default of the checkpoint (penalties, top-k) applies
    devices = [target.device.index or 0] if target.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = model.generate(input_ids=input_ids.to(target.device), attention_mask=attention.to(target.device),
                                 generation_config=config)
    finally:
        model.generation_config = saved
    replies = []
    for row in out[:, width:].tolist():
        stop = next((k for k, token in enumerate(row) if token in target.eos_token_ids), None)
        replies.append(row if stop is None else row[: stop + 1])
    return replies


# -------------------------------------------------------------------------------- samples on disk


def prepare_samples(target: Target, data: str | Path | Sequence[TrainingRecord], cache_dir: str | Path | None = None,
                    regenerate: bool = True, max_new_tokens: int = 256, temperature: float = 0.0,
                    batch_size: int = 16, seed: int = 0, max_prompt_tokens: int = 1024, progress: bool = True,
                    log: Log | None = print) -> list[TrainingSample]:
    """Training samples for ``target`` from a JSONL file (or records): regenerated by it, or the data's own.

    With ``cache_dir`` they are made once and kept in ``cache_dir/samples.pt``; an interrupted
    regeneration resumes. A cache made from other data, settings, tokenizer or target is refused.
    """
    records = read_records(data) if isinstance(data, (str, Path)) else list(data)
    components = {
        "data": _records_hash(records),
        "settings": {"regenerate": regenerate, "max_length": target.max_length, **(
            {"max_new_tokens": max_new_tokens, "temperature": temperature, "batch_size": batch_size, "seed": seed,
             "max_prompt_tokens": max_prompt_tokens} if regenerate else {})},
        "tokenizer": tokenizer_fingerprint(target.tokenizer),
        "target": target_fingerprint(target) if regenerate else None,
        "version": FORMAT_VERSION,
    }
    fingerprint = _hash(components)
    directory = None if cache_dir is None else Path(cache_dir)
    if directory is not None and (directory / SAMPLES_FILE).is_file():
        samples = load_samples(directory / SAMPLES_FILE, fingerprint, components)
        if log:
            log(f"reusing {len(samples)} samples from {directory / SAMPLES_FILE}")
        return samples
    journal = None
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        journal = directory / JOURNAL_FILE
        _check_journal(journal, fingerprint, components)
    if regenerate:
        samples = _regenerate(target, records, max_new_tokens, temperature, batch_size, seed, max_prompt_tokens,
                             journal=journal, progress=progress)
    else:
        samples = build_samples(records, target.tokenizer, target.max_length, log=log)
    if directory is not None:
        save_samples(samples, directory / SAMPLES_FILE, fingerprint, components)
        journal.unlink(missing_ok=True)
        journal.with_name(journal.name + ".json").unlink(missing_ok=True)
    return samples


def _check_journal(journal: Path, fingerprint: str, components: dict) -> None:
    """The journal's companion file names what it was made for; a journal for anything else is refused."""
    about = journal.with_name(journal.name + ".json")
    if journal.is_file() and about.is_file():
        stored = json.loads(about.read_text())
        if stored.get("fingerprint") != fingerprint:
            raise _mismatch("the interrupted regeneration", journal.parent, stored.get("components", {}), components)
    else:
        journal.unlink(missing_ok=True)
        _write_atomic(about, json.dumps({"fingerprint": fingerprint, "components": components}, indent=1))


def save_samples(samples: Sequence[TrainingSample], path: str | Path, fingerprint: str = "",
                 components: dict | None = None) -> None:
    """Write samples (packed end to end) to a torch file, atomically."""
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    payload = {
        "format": "specula-samples", "version": FORMAT_VERSION, "fingerprint": fingerprint,
        "components": json.dumps(components or {}),
        "input_ids": torch.cat([s.input_ids for s in samples]) if samples else torch.zeros(0, dtype=torch.long),
        "loss_mask": torch.cat([s.loss_mask for s in samples]) if samples else torch.zeros(0, dtype=torch.bool),
        "offsets": torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long),
    }
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def load_samples(path: str | Path, fingerprint: str | None = None, components: dict | None = None,
                 ) -> list[TrainingSample]:
    """Samples written by `save_samples`; with ``fingerprint``, refuse a file made for something else."""
    payload = load_torch(path, "training samples file")
    if not isinstance(payload, dict) or payload.get("format") != "specula-samples":
        raise SpeculaError(f"{path} is not a specula samples file")
    if fingerprint is not None and payload["fingerprint"] != fingerprint:
        raise _mismatch("the samples cache", Path(path).parent, json.loads(payload["components"]), components or {})
    offsets = payload["offsets"].tolist()
    return [TrainingSample(payload["input_ids"][a:b].clone(), payload["loss_mask"][a:b].clone())
            for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


# ---------------------------------------------------------------------------------------- features


def cache_features(target: Target, samples: Sequence[TrainingSample], cache_dir: str | Path,
                   request: FeatureRequest, shard_size: int = 128, progress: bool = True,
                   log: Log | None = print) -> CachedFeatures:
    """Run the target over every sample (teacher forcing) and keep the requested features on disk.

    Shards already on disk from an interrupted run with the same fingerprint are kept; a cache
    built for other samples, another target or another request is refused.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    _check_request(target, request)
    if shard_size < 1:
        raise SpeculaError(f"shard size must be >= 1, got {shard_size}")
    if not samples:
        raise SpeculaError("there are no training samples to compute features for")
    longest = max(int(s.input_ids.shape[0]) for s in samples)
    if longest > target.max_length:
        raise SpeculaError(f"a training sample has {longest} tokens, more than the target's context of "
                           f"{target.max_length}")
    components = {
        "samples": _samples_hash(samples), "target": target_fingerprint(target),
        "request": _request_dict(request), "shard_size": shard_size, "version": FORMAT_VERSION,
    }
    fingerprint = _hash(components)
    directory = Path(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / MANIFEST_FILE
    shards = [{"file": f"features-{k:05d}.safetensors", "first": first, "count": min(shard_size, len(samples) - first)}
              for k, first in enumerate(range(0, len(samples), shard_size))]
    if manifest_path.is_file():
        manifest = _read_manifest(directory)
        if manifest.get("fingerprint") != fingerprint:
            raise _mismatch("the feature cache", directory, manifest.get("components", {}), components)
    else:
        manifest = {
            "format": "specula-features", "version": FORMAT_VERSION, "fingerprint": fingerprint,
            "components": components,
            "target": {"name": target.name, "path": str(getattr(target.config, "_name_or_path", "")),
                       "model_type": target.config.model_type, "hidden_size": int(target.config.hidden_size)},
            "request": _request_dict(request), "dtype": str(target.dtype).removeprefix("torch."),
            "num_samples": len(samples), "num_tokens": sum(int(s.input_ids.shape[0]) for s in samples),
            "shards": shards, "complete": False,
        }
        _write_atomic(manifest_path, json.dumps(manifest, indent=1))
    todo = [shard for shard in shards if not _whole_shard(directory / shard["file"], log)]
    if log and len(todo) < len(shards):
        log(f"feature cache {directory}: {len(shards) - len(todo)} of {len(shards)} shards done, "
            f"computing {len(todo)}")
    bar = tqdm(total=sum(s["count"] for s in todo), desc="features", unit="sample", disable=not progress,
               dynamic_ncols=True)
    tokens, started = 0, time.perf_counter()
    for shard in todo:
        part = samples[shard["first"]:shard["first"] + shard["count"]]
        hidden, layers = [], []
        for sample in part:
            out = target.prefill(sample.input_ids.to(target.device), request)
            if request.final_hidden:
                hidden.append(out.hidden.detach().cpu())
            if request.layer_inputs:
                layers.append(torch.stack([out.layer_inputs[i] for i in request.layer_inputs], 1).detach().cpu())
            tokens += int(sample.input_ids.shape[0])
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - started, 1e-9):.0f}")
        lengths = torch.tensor([int(s.input_ids.shape[0]) for s in part], dtype=torch.long)
        tensors = {
            "input_ids": torch.cat([s.input_ids for s in part]).long(),
            "loss_mask": torch.cat([s.loss_mask for s in part]).bool(),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        }
        if hidden:
            tensors["hidden"] = torch.cat(hidden)
        if layers:
            tensors["layer_inputs"] = torch.cat(layers)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        metadata = {"first": str(shard["first"]), "count": str(shard["count"])}
        atomic_write(directory / shard["file"], lambda tmp, t=tensors, m=metadata: save_file(t, tmp, metadata=m))
    bar.close()
    target.reset()
    if not manifest["complete"]:
        manifest["complete"] = True
        _write_atomic(manifest_path, json.dumps(manifest, indent=1))
    return CachedFeatures(directory)


class CachedFeatures:
    """The samples of a feature cache with their features (a torch Dataset: ``len`` and indexing).

    An item is a dict of ``input_ids`` int64 [T], ``loss_mask`` bool [T] and, as requested,
    ``hidden`` [T, H] and ``layer_inputs`` [T, L, H], in the stored dtype. Shards are read lazily
    (memory-mapped), so a cache larger than memory is fine.
    """

    def __init__(self, cache_dir: str | Path, target: Target | None = None):
        self.directory = Path(cache_dir)
        self.manifest = _read_manifest(self.directory)
        if not self.manifest.get("complete"):
            raise SpeculaError(f"the feature cache in {self.directory} is incomplete; run the caching again to "
                               "finish it")
        if target is not None and self.manifest["components"]["target"] != target_fingerprint(target):
            raise SpeculaError(f"the feature cache in {self.directory} was built with another target "
                               f"({self.manifest['target']['path'] or self.manifest['target']['name']}, "
                               f"{self.manifest['dtype']})")
        request = self.manifest["request"]
        self.request = FeatureRequest(request["final_hidden"], tuple(request["layer_inputs"]))
        self.shards = self.manifest["shards"]
        self._firsts = [shard["first"] for shard in self.shards]
        self._open: dict[int, tuple[object, list[int]]] = {}

    def __len__(self) -> int:
        return int(self.manifest["num_samples"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        k = bisect.bisect_right(self._firsts, index) - 1
        handle, offsets = self._shard(k)
        local = index - self.shards[k]["first"]
        a, b = offsets[local], offsets[local + 1]
        names = ["input_ids", "loss_mask"]
        if self.request.final_hidden:
            names.append("hidden")
        if self.request.layer_inputs:
            names.append("layer_inputs")
        return {name: handle.get_slice(name)[a:b] for name in names}

    def _shard(self, k: int):
        if k not in self._open:
            path = self.directory / self.shards[k]["file"]
            if not path.is_file():
                raise SpeculaError(f"feature shard {path} is missing; run the caching again to rebuild it")
            handle = open_safetensors(path, "feature shard")
            try:
                offsets = handle.get_tensor("offsets").tolist()
            except Exception as err:  # a shard of another layout
                raise SpeculaError(f"feature shard {path} has no readable offsets ({err}); delete it and run "
                                   "the caching again to rebuild it") from err
            self._open[k] = (handle, offsets)
        return self._open[k]

    def __getstate__(self):  # picklable for DataLoader workers: file handles are reopened there
        state = dict(self.__dict__)
        state["_open"] = {}
        return state


class OnlineFeatures:
    """Samples with features computed by the target when an item is read (no disk); items as `CachedFeatures`."""

    def __init__(self, target: Target, samples: Sequence[TrainingSample], request: FeatureRequest):
        _check_request(target, request)
        self.target, self.samples, self.request = target, list(samples), request

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.samples[index]
        out = self.target.prefill(sample.input_ids.to(self.target.device), self.request)
        item = {"input_ids": sample.input_ids, "loss_mask": sample.loss_mask}
        if self.request.final_hidden:
            item["hidden"] = out.hidden.detach().cpu()
        if self.request.layer_inputs:
            item["layer_inputs"] = torch.stack([out.layer_inputs[i] for i in self.request.layer_inputs], 1).cpu()
        return item


def _check_request(target: Target, request: FeatureRequest) -> None:
    if not request.final_hidden and not request.layer_inputs:
        raise SpeculaError("the feature request asks for no features")
    layers = int(target.config.num_hidden_layers)
    bad = [i for i in request.layer_inputs if not 0 <= i < layers]
    if bad:
        raise SpeculaError(f"requested inputs of layers {bad}, but the target has layers 0..{layers - 1}")


def _request_dict(request: FeatureRequest) -> dict:
    return {"final_hidden": bool(request.final_hidden), "layer_inputs": [int(i) for i in request.layer_inputs]}


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise SpeculaError(f"{directory} holds no feature cache (no {MANIFEST_FILE})")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SpeculaError(f"the feature cache manifest {path} cannot be read: {err}") from err
    if not isinstance(manifest, dict) or manifest.get("format") != "specula-features":
        raise SpeculaError(f"{path} is not a specula feature cache manifest")
    return manifest


# ------------------------------------------------------------------------------------- fingerprints


def target_fingerprint(target: Target) -> dict:
    """What identifies a target's behaviour: model type, dtype and a hash of (a strided sample of) its weights.

    Independent of the path it was loaded from, so a cache still matches after the model moves.
    """
    digest = hashlib.sha256()
    for name, param in sorted(target.model.named_parameters()):
        flat = param.detach().reshape(-1)
        digest.update(f"{name}{tuple(param.shape)}".encode())
        digest.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    return {"model_type": target.config.model_type, "dtype": str(target.dtype).removeprefix("torch."),
            "weights": digest.hexdigest()[:20]}


def tokenizer_fingerprint(tokenizer) -> str:
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else str(len(tokenizer)).encode())
    digest.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return digest.hexdigest()[:20]


def _records_hash(records: Sequence[TrainingRecord]) -> str:
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps([record.messages, record.text]).encode())
        digest.update(b"\n")
    return digest.hexdigest()[:20]


def _samples_hash(samples: Sequence[TrainingSample]) -> str:
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(str(int(sample.input_ids.shape[0])).encode())
        digest.update(sample.input_ids.long().numpy().tobytes())
        digest.update(sample.loss_mask.bool().numpy().tobytes())
    return digest.hexdigest()[:20]


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def _mismatch(what: str, directory: Path, stored: dict, wanted: dict) -> SpeculaError:
    differ = [key for key in sorted(set(stored) | set(wanted)) if stored.get(key) != wanted.get(key)]
    details = []
    for key in differ:
        old, new = stored.get(key), wanted.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                       if old.get(k) != new.get(k)]
            details.append(f"{key} ({', '.join(changed)})")
        else:
            details.append(key)
    return SpeculaError(f"{what} in {directory} was built for other {', '.join(details) or 'settings'}; "
                        "use another cache directory or delete this one")


def _write_atomic(path: Path, text: str) -> None:
    atomic_write_text(path, text)


def _whole_shard(path: Path, log: Log | None) -> bool:
    """Whether a shard is on disk and intact; a damaged one (truncated by hand, a bad disk) is recomputed."""
    if not path.is_file():
        return False
    try:
        check_safetensors(path, "feature shard")
    except SpeculaError as err:
        if log:
            log(f"{err}: computing it again")
        return False
    return True
