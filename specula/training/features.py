"""Target features of training samples: batched feature passes and the on-disk feature cache.

Feature cache (`cache_features`, `CachedFeatures`): ``cache_dir/manifest.json`` and shards
``features-00000.safetensors``…; each shard packs its samples' tokens end to end: ``input_ids`` int64
[N], ``loss_mask`` bool [N], ``offsets`` int64 [n + 1] (sample k is rows offsets[k]:offsets[k+1]),
``hidden`` [N, H] (final post-norm hidden states), ``target_top`` int64 [N] (the target's argmax token at each
position, with ``hidden``) and ``layer_inputs`` [N, L, H] (inputs of the
requested decoder layers, in the request's order), as `Target.prefill` returns them over the whole
sample. Features are stored in the target's dtype, bit for bit what the target computed (float32 for a
float32 target; half the disk for bfloat16); trainers cast them. A shard is written to a temporary
file and renamed, so an interrupted run leaves only whole shards and the next run computes the rest.
The manifest's fingerprint covers the samples, the target's weights and dtype, the feature request
and the shard size: a cache built for anything else is refused, never silently reused — except that
when only the samples changed (prompts added to the data), every shard whose own samples are the same
(its entry's ``samples`` hash, at the same place) is kept and only the others are computed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.files.outputs import atomic_write, atomic_write_text
from specula.files.readers import check_safetensors, open_safetensors
from specula.runtime.plain_model import transformers_model
from specula.runtime.target import FeatureRequest, Target
from specula.training.fingerprints import cache_mismatch, samples_hash, stable_hash, target_fingerprint
from specula.training.records import Log, TrainingSample, offset_lengths, shard_position

MANIFEST_FILE = "manifest.json"
FEATURES_VERSION = 2  # 2: shards hold target_top (a cache of version 1 is refused, not misread)


def cache_features(target: Target, samples: Sequence[TrainingSample], cache_dir: str | Path,
                   request: FeatureRequest, shard_size: int = 128, progress: bool = True,
                   log: Log | None = print, batch_tokens: int = 4096) -> CachedFeatures:
    """Run the target over every sample (teacher forcing) and keep the requested features on disk.

    Shards already on disk from an interrupted run with the same fingerprint are kept; a cache
    built for other samples, another target or another request is refused. Samples of similar
    length run together, about ``batch_tokens`` (padded) tokens per forward (`batched_features`).
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
        "samples": samples_hash(samples), "target": target_fingerprint(target),
        "request": _request_dict(request), "shard_size": shard_size, "version": FEATURES_VERSION,
    }
    fingerprint = stable_hash(components)
    directory = Path(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    manifest_path = directory / MANIFEST_FILE
    shards = [{"file": f"features-{k:05d}.safetensors", "first": first, "count": min(shard_size, len(samples) - first),
               "samples": samples_hash(samples[first:first + shard_size])}
              for k, first in enumerate(range(0, len(samples), shard_size))]
    manifest = _read_manifest(directory) if manifest_path.is_file() else None
    if manifest is not None and manifest.get("fingerprint") != fingerprint:
        _keep_same_shards(directory, manifest, components, shards, log)
        manifest = None
    if manifest is None:
        manifest = {
            "format": "specula-features", "version": FEATURES_VERSION, "fingerprint": fingerprint,
            "components": components,
            "target": {"name": target.name, "path": str(getattr(target.config, "_name_or_path", "")),
                       "model_type": target.config.model_type, "hidden_size": int(target.config.hidden_size)},
            "request": _request_dict(request), "dtype": str(target.dtype).removeprefix("torch."),
            "num_samples": len(samples), "num_tokens": sum(int(s.input_ids.shape[0]) for s in samples),
            "shards": shards, "complete": False,
        }
        atomic_write_text(manifest_path, json.dumps(manifest, indent=1))
    todo = [shard for shard in shards if not _whole_shard(directory / shard["file"], log)]
    if log and len(todo) < len(shards):
        log(f"feature cache {directory}: {len(shards) - len(todo)} of {len(shards)} shards done, "
            f"computing {len(todo)}")
    bar = tqdm(total=sum(s["count"] for s in todo), desc="features", unit="sample", disable=not progress,
               dynamic_ncols=True)
    tokens, started = 0, time.perf_counter()
    for shard in todo:
        part = samples[shard["first"]:shard["first"] + shard["count"]]
        items: list[dict[str, torch.Tensor]] = [{}] * len(part)
        for rows in _length_batches(part, batch_tokens):
            for row, item in zip(rows, batched_features(target, [part[r].input_ids for r in rows], request),
                                 strict=True):
                items[row] = item
                tokens += int(part[row].input_ids.shape[0])
            bar.update(len(rows))
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - started, 1e-9):.0f}")
        lengths = torch.tensor([int(s.input_ids.shape[0]) for s in part], dtype=torch.long)
        tensors = {
            "input_ids": torch.cat([s.input_ids for s in part]).long(),
            "loss_mask": torch.cat([s.loss_mask for s in part]).bool(),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        }
        for name in _feature_names(request):
            tensors[name] = torch.cat([item[name] for item in items])
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        metadata = {"first": str(shard["first"]), "count": str(shard["count"])}
        atomic_write(directory / shard["file"], lambda tmp, t=tensors, m=metadata: save_file(t, tmp, metadata=m))
    bar.close()
    if not manifest["complete"]:
        manifest["complete"] = True
        atomic_write_text(manifest_path, json.dumps(manifest, indent=1))
    return CachedFeatures(directory)


def batched_features(target: Target, sequences: Sequence[torch.Tensor], request: FeatureRequest,
                     ) -> list[dict[str, torch.Tensor]]:
    """Each sequence's features from one forward: ``hidden`` [T_k, H] and ``target_top`` int64 [T_k] (the
    target's argmax token at each position) when the final hidden is requested, ``layer_inputs`` [T_k, L, H].

    The sequences are right-padded into one [B, T] batch and run through the model's own forward
    without a KV cache: under causal attention a real token never sees the padding after it, so each
    row's features are its sequence's (up to the rounding of other matmul shapes, the same tolerance
    as any batched inference) — at thousands of tokens/s where one `Target.prefill` per sample, with
    its cache sized to the model's whole context, ran at hundreds.
    """
    model = transformers_model(target.model)  # its own batched forward (a plain model has none)
    base = getattr(model, model.base_model_prefix)
    lengths = [int(s.shape[0]) for s in sequences]
    ids = torch.zeros(len(sequences), max(lengths), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : lengths[row]] = sequence
    with torch.no_grad():
        out = base(input_ids=ids.to(target.device), use_cache=False,
                   output_hidden_states=bool(request.layer_inputs))
    return [_features_of(target, out.last_hidden_state[row, :length],
                         [out.hidden_states[i][row, :length] for i in request.layer_inputs] if request.layer_inputs
                         else [], request) for row, length in enumerate(lengths)]


def _features_of(target: Target, hidden: torch.Tensor, layers: list[torch.Tensor], request: FeatureRequest,
                 ) -> dict[str, torch.Tensor]:
    """The stored features of one sequence from its final hidden [T, H] and requested layer inputs ([T, H] each).

    ``target_top`` is kept so that a trainer restricted to a draft vocabulary knows whether the target's
    choice lies in it without multiplying by the whole LM head again at every step of every epoch.
    """
    item = {}
    if request.final_hidden:
        with torch.no_grad():
            item["hidden"] = hidden.detach().cpu()
            item["target_top"] = target.model.get_output_embeddings()(hidden).argmax(-1).cpu()
    if layers:
        item["layer_inputs"] = torch.stack(layers, 1).detach().cpu()
    return item


def _length_batches(samples: Sequence[TrainingSample], batch_tokens: int) -> list[list[int]]:
    """Indices of ``samples`` in groups of similar length, each at most ``batch_tokens`` padded tokens."""
    order = sorted(range(len(samples)), key=lambda k: int(samples[k].input_ids.shape[0]))
    groups: list[list[int]] = []
    for k in order:
        length = int(samples[k].input_ids.shape[0])  # the longest so far, as the order is ascending
        if groups and (len(groups[-1]) + 1) * length <= batch_tokens:
            groups[-1].append(k)
        else:
            groups.append([k])
    return groups


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

    def lengths(self) -> list[int]:
        """Tokens of every sample, from the shards' offsets (no feature is read)."""
        return offset_lengths(self._shard(k)[1] for k in range(len(self.shards)))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        k, local = shard_position(self._firsts, len(self), index)
        handle, offsets = self._shard(k)
        a, b = offsets[local], offsets[local + 1]
        return {name: handle.get_slice(name)[a:b] for name in ("input_ids", "loss_mask", *_feature_names(self.request))}

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

    def lengths(self) -> list[int]:
        return [int(sample.input_ids.shape[0]) for sample in self.samples]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.samples[index]
        out = self.target.prefill(sample.input_ids.to(self.target.device), self.request)
        layers = [out.layer_inputs[i] for i in self.request.layer_inputs]
        return {"input_ids": sample.input_ids, "loss_mask": sample.loss_mask,
                **_features_of(self.target, out.hidden, layers, self.request)}


def _feature_names(request: FeatureRequest) -> tuple[str, ...]:
    """The per-token tensors stored for a request, besides ``input_ids`` and ``loss_mask``."""
    return (("hidden", "target_top") if request.final_hidden else ()) + (
        ("layer_inputs",) if request.layer_inputs else ())


def _check_request(target: Target, request: FeatureRequest) -> None:
    if not request.final_hidden and not request.layer_inputs:
        raise SpeculaError("the feature request asks for no features")
    layers = int(target.config.num_hidden_layers)
    bad = [i for i in request.layer_inputs if not 0 <= i < layers]
    if bad:
        raise SpeculaError(f"requested inputs of layers {bad}, but the target has layers 0..{layers - 1}")


def _keep_same_shards(directory: Path, manifest: dict, components: dict, shards: list[dict], log: Log | None) -> None:
    """Delete the shards of a cache built for other samples, but those holding the same samples at the same place.

    Only for the same target, request, shard size and version (anything else is refused); the stale
    files go before the new manifest is written, so an interruption never leaves one looking done.
    """
    stored = manifest.get("components", {})
    if {k: v for k, v in stored.items() if k != "samples"} != {k: v for k, v in components.items() if k != "samples"}:
        raise cache_mismatch("the feature cache", directory, stored, components)
    wanted = {(s["file"], s["first"], s["count"], s["samples"]) for s in shards}
    old = manifest.get("shards", [])
    kept = [s for s in old if (s.get("file"), s.get("first"), s.get("count"), s.get("samples")) in wanted]
    for shard in old:
        if shard not in kept:
            (directory / shard["file"]).unlink(missing_ok=True)
    if log:
        log(f"feature cache {directory} was built for other samples: keeping the {len(kept)} of its {len(old)} "
            "shards that hold the same samples")


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
