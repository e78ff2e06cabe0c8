"""Fingerprints of what a cache was built from (data, samples, target, tokenizer), so a cache built
for anything else is refused, never silently reused."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from specula.errors import SpeculaError
from specula.runtime.target import Target
from specula.training.records import TrainingRecord, TrainingSample

FORMAT_VERSION = 1


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


def _record_bytes(record: TrainingRecord) -> bytes:
    """A record's content (its turns or its text, not the line it was read from), as hashed."""
    return json.dumps([record.messages, record.text]).encode()


def records_hash(records: Sequence[TrainingRecord]) -> str:
    digest = hashlib.sha256()
    for record in records:
        digest.update(_record_bytes(record))
        digest.update(b"\n")
    return digest.hexdigest()[:20]


def record_key(record: TrainingRecord) -> str:
    """A hash of one record's content."""
    return hashlib.sha256(_record_bytes(record)).hexdigest()[:20]


def samples_hash(samples: Sequence[TrainingSample]) -> str:
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(str(int(sample.input_ids.shape[0])).encode())
        digest.update(sample.input_ids.long().numpy().tobytes())
        digest.update(sample.loss_mask.bool().numpy().tobytes())
    return digest.hexdigest()[:20]


def stable_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


def cache_mismatch(what: str, directory: Path, stored: dict, wanted: dict) -> SpeculaError:
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
