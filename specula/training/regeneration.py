"""Self-distillation: the target writes the responses of the training samples, cached on disk.

Self-distillation (`regenerate`): the target writes the responses, in batches through
``model.generate`` with left padding, sorted by prompt length. Conversations are regenerated turn by
turn (round r writes every conversation's r-th reply, its context holding the replies of the earlier
rounds); a ``{"text"}`` record is cut in half (at most ``max_prompt_tokens`` tokens of prompt) and the
target continues it. A regenerated sample is the prompt's tokens followed by the generated tokens
themselves (up to and including EOS), exactly the sequence the target sees when it answers that prompt.
Prompts longer than ``max_prompt_tokens`` keep their last tokens (and a leading BOS).

``cache_dir/samples.pt`` keeps the samples (regenerated once), with a fingerprint of the
data, settings, tokenizer and target and a key per record (a hash of its content); an interrupted
regeneration resumes from ``cache_dir/samples.journal.jsonl``. When the data changes (prompts added,
removed or reordered) but the target, tokenizer and settings do not, the records the cache already
holds keep their samples and only the others are regenerated.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write, atomic_write_text
from specula.files.readers import load_torch
from specula.runtime.plain_model import transformers_model
from specula.runtime.target import Target
from specula.runtime.tokenizer import tokenizer_fingerprint
from specula.training.fingerprints import (
    FORMAT_VERSION,
    cache_mismatch,
    record_key,
    records_hash,
    stable_hash,
    target_fingerprint,
)
from specula.training.records import (
    Log,
    TrainingRecord,
    TrainingSample,
    build_samples,
    has_chat_template,
    read_records,
    render,
    tokenize_with_mask,
)

SAMPLES_FILE = "samples.pt"


JOURNAL_FILE = "samples.journal.jsonl"


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

    model, eos = transformers_model(target.model), sorted(target.eos_token_ids)
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
    regeneration resumes. A cache made for other settings, tokenizer or target is refused; one made
    for other data by the same regeneration lends the samples of the records both hold (matched by
    content, in any order) and only the rest are regenerated. Without regeneration other data is refused.
    """
    records = read_records(data) if isinstance(data, (str, Path)) else list(data)
    components = {
        "data": records_hash(records),
        "settings": {"regenerate": regenerate, "max_length": target.max_length, **(
            {"max_new_tokens": max_new_tokens, "temperature": temperature, "batch_size": batch_size, "seed": seed,
             "max_prompt_tokens": max_prompt_tokens} if regenerate else {})},
        "tokenizer": tokenizer_fingerprint(target.tokenizer),
        "target": target_fingerprint(target) if regenerate else None,
        "version": FORMAT_VERSION,
    }
    fingerprint = stable_hash(components)
    keys = [record_key(record) for record in records] if regenerate else None
    directory = None if cache_dir is None else Path(cache_dir)
    reused: dict[int, TrainingSample] = {}
    if directory is not None and (directory / SAMPLES_FILE).is_file():
        payload = _read_samples_file(directory / SAMPLES_FILE)
        if payload["fingerprint"] == fingerprint:
            samples = _unpack(payload)
            if log:
                log(f"reusing {len(samples)} samples from {directory / SAMPLES_FILE}")
            return samples
        reused = _reusable(payload, components, keys, directory)
        if log:
            log(f"reusing {len(reused)} of {len(records)} samples from {directory / SAMPLES_FILE} (same target, "
                f"tokenizer and settings, other data); regenerating {len(records) - len(reused)}")
    journal = None
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        journal = directory / JOURNAL_FILE
        # the journal numbers the records still to regenerate, so it is only good for the same reused set
        about = {**components, "reused": stable_hash(sorted(reused))} if reused else components
        _check_journal(journal, stable_hash(about), about)
    if regenerate:
        todo = [i for i in range(len(records)) if i not in reused]
        fresh = _regenerate(target, [records[i] for i in todo], max_new_tokens, temperature, batch_size, seed,
                            max_prompt_tokens, journal=journal, progress=progress) if todo else []
        made = {**reused, **dict(zip(todo, fresh, strict=True))}
        samples = [made[i] for i in range(len(records))]
    else:
        samples = build_samples(records, target.tokenizer, target.max_length, log=log)
    if directory is not None:
        save_samples(samples, directory / SAMPLES_FILE, fingerprint, components, record_keys=keys)
        journal.unlink(missing_ok=True)
        journal.with_name(journal.name + ".json").unlink(missing_ok=True)
    return samples


def _check_journal(journal: Path, fingerprint: str, components: dict) -> None:
    """The journal's companion file names what it was made for; a journal for anything else is refused."""
    about = journal.with_name(journal.name + ".json")
    if journal.is_file() and about.is_file():
        stored = json.loads(about.read_text())
        if stored.get("fingerprint") != fingerprint:
            raise cache_mismatch("the interrupted regeneration", journal.parent, stored.get("components", {}),
                                 components)
    else:
        journal.unlink(missing_ok=True)
        atomic_write_text(about, json.dumps({"fingerprint": fingerprint, "components": components}, indent=1))


def _reusable(payload: dict, components: dict, keys: list[str] | None, directory: Path) -> dict[int, TrainingSample]:
    """{record index: cached sample} for the records a cache of other data already regenerated.

    Only a cache from the same regeneration (target, tokenizer, settings but the batch size, which only
    groups the work) lends samples; anything else is refused as before. A record is matched by its key.
    """
    stored = json.loads(payload["components"])
    stored_keys = payload.get("record_keys")

    def generation(parts: dict) -> dict:
        settings = {k: v for k, v in parts.get("settings", {}).items() if k != "batch_size"}
        return {**{k: v for k, v in parts.items() if k != "data"}, "settings": settings}

    if keys is None or stored_keys is None or generation(stored) != generation(components):
        raise cache_mismatch("the samples cache", directory, stored, components)
    cached = dict(zip(stored_keys, _unpack(payload), strict=True))
    return {i: cached[key] for i, key in enumerate(keys) if key in cached}


def save_samples(samples: Sequence[TrainingSample], path: str | Path, fingerprint: str = "",
                 components: dict | None = None, record_keys: Sequence[str] | None = None) -> None:
    """Write samples (packed end to end) to a torch file, atomically.

    ``record_keys`` (one per sample: `fingerprints.record_key` of the record it was regenerated from)
    let a later run on other data reuse the samples of the records it shares.
    """
    if record_keys is not None and len(record_keys) != len(samples):
        raise ValueError(f"{len(record_keys)} record keys for {len(samples)} samples")
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    payload = {
        "format": "specula-samples", "version": FORMAT_VERSION, "fingerprint": fingerprint,
        "components": json.dumps(components or {}),
        "record_keys": None if record_keys is None else list(record_keys),
        "input_ids": torch.cat([s.input_ids for s in samples]) if samples else torch.zeros(0, dtype=torch.long),
        "loss_mask": torch.cat([s.loss_mask for s in samples]) if samples else torch.zeros(0, dtype=torch.bool),
        "offsets": torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long),
    }
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def load_samples(path: str | Path, fingerprint: str | None = None, components: dict | None = None,
                 ) -> list[TrainingSample]:
    """Samples written by `save_samples`; with ``fingerprint``, refuse a file made for something else."""
    payload = _read_samples_file(path)
    if fingerprint is not None and payload["fingerprint"] != fingerprint:
        raise cache_mismatch("the samples cache", Path(path).parent, json.loads(payload["components"]),
                             components or {})
    return _unpack(payload)


def _read_samples_file(path: str | Path) -> dict:
    payload = load_torch(path, "training samples file")
    if not isinstance(payload, dict) or payload.get("format") != "specula-samples":
        raise SpeculaError(f"{path} is not a specula samples file")
    return payload


def _unpack(payload: dict) -> list[TrainingSample]:
    offsets = payload["offsets"].tolist()
    return [TrainingSample(payload["input_ids"][a:b].clone(), payload["loss_mask"][a:b].clone())
            for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


# ---------------------------------------------------------------------------------------- features
