"""Training data the target generates with its features captured (`capture`), kept as content-addressed shards.

A data directory holds ``run.json`` (what the data was made with: target and its weights format, tokenizer,
the prompt mix, feature request, top-k, feature dtype; a run with anything else is refused), ``journal.jsonl``
(one line per shard, appended after the shard is on disk: its file, the jobs it finished, its token counts) and
``shards/shard-<sha256>.safetensors``, named by the hash of their bytes. A shard holds the samples of
``flush_jobs`` finished jobs packed end to end: ``input_ids`` int32 [N], ``loss_mask`` bool [N], ``offsets``
int64 [n + 1], ``dist_ids`` int32 [N, k], ``dist_probs`` [N, k] and, as requested, ``layer_inputs`` [N, L, H] and
``hidden`` [N, H] (features and probabilities in float16 or bfloat16); its metadata lists each sample's job,
kind, conversation and temperature.

Resume: jobs are numbered and made from the seed alone (`conversations.JobMaker`), so a rerun skips the jobs
the journal lists and plays the rest. A kill loses the jobs in flight (at most one batch) and the finished jobs
of an unwritten shard (fewer than ``flush_jobs``); a shard written without its journal line (a kill between the
two) or a torn journal line is dropped, never counted twice. Raising ``response_tokens`` and resuming extends a
run.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write_text
from specula.files.readers import open_safetensors
from specula.kernels.q4_1 import unavailable_reason
from specula.runtime.target import FeatureRequest, Target
from specula.runtime.tokenizer import tokenizer_fingerprint
from specula.training.capture import CapturedSample, CaptureEngine, training_item
from specula.training.conversations import Job, JobMaker, PromptMix
from specula.training.fingerprints import cache_mismatch, stable_hash, target_fingerprint
from specula.training.records import Log, has_chat_template, offset_lengths, shard_position

RUN_FILE, JOURNAL_FILE, SHARDS = "run.json", "journal.jsonl", "shards"
DATA_VERSION = 1
FEATURE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class GenerationOptions:
    """How much to generate and how it is stored (see the module docstring)."""

    response_tokens: int = 100_000  # stop starting jobs once the journal holds this many response tokens
    max_jobs: int | None = None  # or after this many jobs
    batch_size: int = 32
    top_k: int = 32
    feature_dtype: str = "float16"
    flush_jobs: int = 16
    max_length: int = 4096

    def __post_init__(self) -> None:
        if self.feature_dtype not in FEATURE_DTYPES:
            raise SpeculaError(f"feature dtype must be one of {', '.join(FEATURE_DTYPES)}, got {self.feature_dtype}")
        for name in ("response_tokens", "batch_size", "top_k", "flush_jobs"):
            if getattr(self, name) < 1:
                raise SpeculaError(f"{name} must be >= 1, got {getattr(self, name)}")


def default_weights(device: str = "cpu") -> str:
    """The format generation serves by default: q4_1 (the fastest on a CPU) where its kernel is built, else float32."""
    return "q4_1" if unavailable_reason(device) is None else "float32"


def run_components(target: Target, mix: PromptMix, request: FeatureRequest, options: GenerationOptions) -> dict:
    return {"target": {**target_fingerprint(target), "format": target.weights},
            "tokenizer": tokenizer_fingerprint(target.tokenizer), "mix": mix.describe(),
            "request": {"final_hidden": bool(request.final_hidden), "layer_inputs": list(request.layer_inputs)},
            "top_k": options.top_k, "feature_dtype": options.feature_dtype, "max_length": options.max_length,
            "version": DATA_VERSION}


def generate_data(target: Target, directory: str | Path, mix: PromptMix, request: FeatureRequest,
                  options: GenerationOptions = GenerationOptions(), log: Log | None = print,
                  on_shard: Callable[[dict], None] | None = None) -> dict:
    """Generate into ``directory`` until it holds ``options.response_tokens`` response tokens; returns totals.

    Resumes whatever the directory already holds for the same run (`run.json`). ``on_shard(entry)`` is called
    after each shard's journal line is written (tests interrupt a run there).
    """
    if not request.final_hidden and not request.layer_inputs:
        raise SpeculaError("the feature request asks for no features")
    if mix.chat != has_chat_template(target.tokenizer):
        raise SpeculaError("the prompt mix's chat setting does not match the target's tokenizer")
    root = Path(directory)
    components = run_components(target, mix, request, options)
    fingerprint = stable_hash(components)
    run_file = root / RUN_FILE
    if run_file.is_file():
        stored = json.loads(run_file.read_text())
        if stored.get("fingerprint") != fingerprint:
            raise cache_mismatch("the generated data", root, stored.get("components", {}), components)
    else:
        (root / SHARDS).mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_file, json.dumps({"format": "specula-generated", "fingerprint": fingerprint,
                                                "components": components}, indent=1))
    entries = _clean(root, log)
    done = {job for entry in entries for job in entry["jobs"]}
    totals = {"jobs": len(done), "samples": sum(e["samples"] for e in entries),
              "tokens": sum(e["tokens"] for e in entries),
              "response_tokens": sum(e["response_tokens"] for e in entries)}
    if log and entries:
        log(f"resuming {root}: {totals['jobs']} jobs, {totals['response_tokens']} response tokens already there")
    maker = JobMaker(mix)
    limit = options.max_jobs if options.max_jobs is not None else float("inf")

    def jobs() -> Iterator[Job]:
        index = 0
        while index < limit and totals["response_tokens"] < options.response_tokens:
            if index not in done:
                yield maker.job(index)
            index += 1

    engine = CaptureEngine(target, request, options.top_k, FEATURE_DTYPES[options.feature_dtype],
                           options.batch_size, options.max_length)
    buffer: list[tuple[Job, list[CapturedSample]]] = []
    started, fed_before = time.perf_counter(), 0
    journal = (root / JOURNAL_FILE).open("a", encoding="utf-8")

    def flush() -> None:
        entry = _write_shard(root, buffer)
        journal.write(json.dumps(entry) + "\n")
        journal.flush()
        os.fsync(journal.fileno())
        buffer.clear()
        for key in ("samples", "tokens", "response_tokens"):
            totals[key] += entry[key]
        totals["jobs"] += len(entry["jobs"])
        if log:
            seconds = time.perf_counter() - started
            log(f"{root}: {totals['jobs']} jobs, {totals['response_tokens']} response tokens; "
                f"{(engine.fed_tokens - fed_before) / max(seconds, 1e-9):.0f} tokens/s fed this run")
        if on_shard is not None:
            on_shard(entry)

    def finished(job: Job, samples: list[CapturedSample]) -> None:
        buffer.append((job, samples))
        if len(buffer) >= options.flush_jobs:
            flush()

    try:
        engine.run(jobs(), finished)
        if buffer:
            flush()
    finally:
        journal.close()
    totals["seconds"] = time.perf_counter() - started
    totals["fed_tokens"] = engine.fed_tokens
    return totals


def _write_shard(root: Path, finished: list[tuple[Job, list[CapturedSample]]]) -> dict:
    """Write the samples of ``finished`` jobs as one shard named by its content; returns its journal entry."""
    from safetensors.torch import save_file

    samples = [s for _, found in finished for s in found]
    tensors: dict[str, torch.Tensor] = {}
    if samples:
        lengths = torch.tensor([int(s.input_ids.shape[0]) for s in samples], dtype=torch.long)
        tensors = {"input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
                   "loss_mask": torch.cat([s.loss_mask for s in samples]),
                   "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                   "dist_ids": torch.cat([s.dist_ids for s in samples]),
                   "dist_probs": torch.cat([s.dist_probs for s in samples])}
        for name in ("layer_inputs", "hidden"):
            if getattr(samples[0], name) is not None:
                tensors[name] = torch.cat([getattr(s, name) for s in samples])
    else:
        tensors = {"offsets": torch.zeros(1, dtype=torch.long)}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    metadata = {"samples": json.dumps([s.info for s in samples]), "jobs": json.dumps([j.index for j, _ in finished])}
    temporary = root / SHARDS / f".tmp-{os.getpid()}.safetensors"
    save_file(tensors, str(temporary), metadata=metadata)
    digest = hashlib.sha256(temporary.read_bytes()).hexdigest()[:32]
    name = f"shard-{digest}.safetensors"
    os.replace(temporary, root / SHARDS / name)
    tokens = int(tensors["input_ids"].shape[0]) if samples else 0
    response = int(tensors["loss_mask"].sum()) if samples else 0
    return {"file": name, "jobs": [j.index for j, _ in finished], "samples": len(samples), "tokens": tokens,
            "response_tokens": response}


def read_journal(root: Path) -> list[dict]:
    """The journal's whole entries, in order (a line torn by a kill is skipped)."""
    path = root / JOURNAL_FILE
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and {"file", "jobs", "samples", "tokens", "response_tokens"} <= set(entry):
            entries.append(entry)
    return entries


def _clean(root: Path, log: Log | None) -> list[dict]:
    """Journal entries whose shard is on disk (the journal is rewritten without the others, and without a job
    listed twice); shards no entry names (written just before a kill) and temporary files are deleted."""
    entries, seen, kept = read_journal(root), set(), []
    for entry in entries:
        if (root / SHARDS / entry["file"]).is_file() and not seen & set(entry["jobs"]):
            kept.append(entry)
            seen |= set(entry["jobs"])
    listed = {entry["file"] for entry in kept}
    for path in (root / SHARDS).iterdir():
        if path.name not in listed:
            path.unlink()
    text = "".join(json.dumps(entry) + "\n" for entry in kept)
    journal = root / JOURNAL_FILE
    if not journal.is_file() or journal.read_text(encoding="utf-8") != text:
        if log and journal.is_file():
            log(f"{journal}: dropped {len(entries) - len(kept)} entries without a whole shard or a torn line")
        atomic_write_text(journal, text)
    return kept


class GeneratedData:
    """The samples of a data directory as a torch-style Dataset (``len``, indexing), in journal order.

    An item holds ``input_ids`` int64 [T], ``loss_mask`` bool [T], ``dist_ids`` int64 [T, k], ``dist_probs``
    float32 [T, k], ``target_top`` int64 [T] (the target's most probable next token; 0 where no distribution was
    computed) and, as ``request`` asks, ``layer_inputs`` [T, L, H] (in the request's order) and ``hidden`` [T, H],
    in the stored dtype. Shards are memory-mapped, read lazily.
    """

    def __init__(self, directory: str | Path, request: FeatureRequest | None = None, target: Target | None = None):
        self.root = Path(directory)
        run_file = self.root / RUN_FILE
        if not run_file.is_file():
            raise SpeculaError(f"{self.root} holds no generated data (no {RUN_FILE})")
        self.run = json.loads(run_file.read_text())
        components = self.run["components"]
        if target is not None and components["target"] != {**target_fingerprint(target), "format": target.weights}:
            raise SpeculaError(f"the data in {self.root} was generated by another target or weights format "
                               f"({components['target']['format']})")
        stored = components["request"]
        self.stored_layers = list(stored["layer_inputs"])
        self.request = request or FeatureRequest(stored["final_hidden"], tuple(self.stored_layers))
        missing = [i for i in self.request.layer_inputs if i not in self.stored_layers]
        if missing or (self.request.final_hidden and not stored["final_hidden"]):
            raise SpeculaError(f"the data in {self.root} holds layers {self.stored_layers}"
                               f"{' and the final hidden' if stored['final_hidden'] else ''}; the head needs "
                               f"layers {list(self.request.layer_inputs)}"
                               f"{' and the final hidden' if self.request.final_hidden else ''}")
        self.pick = [self.stored_layers.index(i) for i in self.request.layer_inputs]
        self.shards = [e for e in read_journal(self.root) if e["samples"]]
        if not self.shards:
            raise SpeculaError(f"{self.root} holds no generated samples yet")
        counts = [e["samples"] for e in self.shards]
        self._firsts = [sum(counts[:k]) for k in range(len(counts))]
        self._total = sum(counts)
        self._open: dict[int, tuple[object, list[int], list[dict]]] = {}

    def __len__(self) -> int:
        return self._total

    def info(self, index: int) -> dict:
        """Job, kind, conversation and temperature of sample ``index``."""
        k = bisect.bisect_right(self._firsts, index) - 1
        return self._shard(k)[2][index - self._firsts[k]]

    def lengths(self) -> list[int]:
        """Tokens of every sample, from the shards' offsets (no feature is read)."""
        return offset_lengths(self._shard(k)[1] for k in range(len(self.shards)))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        k, local = shard_position(self._firsts, len(self), index)
        handle, offsets, _ = self._shard(k)
        a, b = offsets[local], offsets[local + 1]
        layer_inputs = hidden = None
        if self.request.layer_inputs:
            stacked = handle.get_slice("layer_inputs")[a:b]
            layer_inputs = stacked if self.pick == list(range(len(self.stored_layers))) else stacked[:, self.pick]
        if self.request.final_hidden:
            hidden = handle.get_slice("hidden")[a:b]
        return training_item(*(handle.get_slice(name)[a:b] for name in ("input_ids", "loss_mask", "dist_ids",
                                                                          "dist_probs")), layer_inputs, hidden)

    def _shard(self, k: int):
        if k not in self._open:
            path = self.root / SHARDS / self.shards[k]["file"]
            if not path.is_file():
                raise SpeculaError(f"shard {path} is missing; resume the generation to make its jobs again")
            handle = open_safetensors(path, "generated data shard")
            self._open[k] = (handle, handle.get_tensor("offsets").tolist(), json.loads(handle.metadata()["samples"]))
        return self._open[k]

    def __getstate__(self):  # picklable for DataLoader workers: file handles are reopened there
        state = dict(self.__dict__)
        state["_open"] = {}
        return state
