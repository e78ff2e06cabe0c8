"""From a data file to the feature sets a head trainer reads: samples, features, train/eval split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specula.errors import SpeculaError
from specula.runtime.target import FeatureRequest, Target
from specula.training.features import CachedFeatures, OnlineFeatures, cache_features
from specula.training.generated import GeneratedData
from specula.training.loop import sample_lengths
from specula.training.regeneration import prepare_samples


@dataclass
class DataOptions:
    """How training samples are made (see `specula.training.records`, `regeneration`, `features`)."""

    data: Path
    cache_dir: Path | None = None
    regenerate: bool = True  # the target writes the responses (self-distillation)
    max_new_tokens: int = 256
    # Regeneration temperatures: each record gets one response per temperature (heads serve greedy and sampled
    # decoding alike). The first one's samples form the held-out set, so runs that add temperatures compare.
    temperatures: tuple[float, ...] = (0.0,)
    batch_size: int = 16
    eval_samples: int = 32
    seed: int = 0
    train_samples: int | None = None  # train on only this many (the held-out set stays the same): data scaling
    max_prompt_context: int | None = None  # train-set items keep at most this many tokens before the response

    def __post_init__(self) -> None:
        self.temperatures = tuple(self.temperatures)
        if not self.temperatures:
            raise SpeculaError("give at least one regeneration temperature (--gen-temperature)")
        for value in self.temperatures:
            if not (isinstance(value, (int, float)) and 0.0 <= value < float("inf")):
                raise SpeculaError(f"the regeneration temperature (--gen-temperature) must be a finite number >= 0, "
                                   f"got {value!r}")
        if len(set(self.temperatures)) < len(self.temperatures):
            given = ", ".join(map(str, self.temperatures))
            raise SpeculaError(f"--gen-temperature: each regeneration temperature once, got {given}")


class PromptCrop:
    """Items of a dataset with all but the last ``context`` tokens before the response dropped.

    Only response positions are trained, so a long prompt costs compute (attention grows with
    its square) and teaches little beyond its last tokens. Every per-token tensor is cut alike.
    """

    def __init__(self, dataset, context: int):
        self.dataset, self.context = dataset, context

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int] | None:
        """The uncropped lengths (None where the dataset cannot tell): they only order batches (`epoch_order`),
        and a sample's crop depends on where its response starts, which only reading it tells."""
        return sample_lengths(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = self.dataset[index]
        response = item["loss_mask"].nonzero()
        start = max(0, int(response[0]) - self.context) if len(response) else 0
        return {key: value[start:] for key, value in item.items()}


class Subset:
    """Items ``indices`` of a dataset (a torch-style Dataset view)."""

    def __init__(self, dataset, indices: list[int]):
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def lengths(self) -> list[int] | None:
        lengths = sample_lengths(self.dataset)
        return None if lengths is None else [lengths[i] for i in self.indices]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.dataset[self.indices[index]]


def feature_sets(target: Target, options: DataOptions, request: FeatureRequest, log=print) -> tuple[Subset, Subset]:
    """(train, eval) feature sets; eval holds ``eval_samples`` samples chosen with the seed.

    The held-out samples are chosen among the first temperature's; every temperature's sample of a held-out
    record stays out of training (the same prompt answered at another temperature is still that prompt).
    With ``train_samples`` the train set is the first that many records of the rest (at each temperature), so
    runs on 1x, 2x, 4x the data share one sample cache and one held-out set.
    """
    runs = [prepare_samples(target, options.data, cache_dir=_samples_dir(options.cache_dir, rank, temperature),
                            regenerate=options.regenerate, max_new_tokens=options.max_new_tokens,
                            temperature=temperature, batch_size=options.batch_size, seed=options.seed, log=log)
            for rank, temperature in enumerate(options.temperatures)]
    # (temperature rank, record) of every sample with a response, the first temperature's first: a cache made
    # with fewer temperatures keeps its feature shards.
    places = [(rank, record) for rank, run in enumerate(runs)
              for record, sample in enumerate(run) if bool(sample.loss_mask.any())]
    samples = [runs[rank][record] for rank, record in places]
    firsts = [record for rank, record in places if rank == 0]
    if len(firsts) <= options.eval_samples:
        raise SpeculaError(f"{len(firsts)} samples with a response are too few to hold out "
                           f"{options.eval_samples} for evaluation")
    if options.cache_dir is not None:
        features = cache_features(target, samples, Path(options.cache_dir) / _request_name(request), request, log=log)
    else:
        features = OnlineFeatures(target, samples, request)
    order = torch.randperm(len(firsts), generator=torch.Generator().manual_seed(options.seed)).tolist()
    held_out = sorted(order[: options.eval_samples])  # indices of `samples`: the first temperature's come first
    kept_records = [firsts[i] for i in sorted(order[options.eval_samples:])]
    if options.train_samples is not None:
        if options.train_samples > len(kept_records):
            raise SpeculaError(f"--train-samples {options.train_samples} exceeds the {len(kept_records)} training "
                               "samples")
        kept_records = kept_records[: options.train_samples]
    position = {place: index for index, place in enumerate(places)}
    kept = [position[rank, record] for rank in range(len(runs)) for record in kept_records
            if (rank, record) in position]
    train = features if options.max_prompt_context is None else PromptCrop(features, options.max_prompt_context)
    return Subset(train, kept), Subset(features, held_out)


def _samples_dir(cache_dir: Path | None, rank: int, temperature: float) -> Path | None:
    """Where one temperature's samples are cached: the first temperature's in ``cache_dir`` itself (as with one)."""
    if cache_dir is None or rank == 0:
        return cache_dir
    return Path(cache_dir) / f"samples-t{temperature:g}"


def _request_name(request: FeatureRequest) -> str:
    layers = "-".join(map(str, request.layer_inputs))
    return "features" + ("-final" if request.final_hidden else "") + (f"-layers{layers}" if layers else "")


def generated_sets(directory: Path, request: FeatureRequest, eval_samples: int, seed: int = 0,
                   train_samples: int | None = None, max_prompt_context: int | None = None,
                   target: Target | None = None) -> tuple[Subset, Subset]:
    """(train, eval) sets of generated data (`specula.training.generated`): features captured while the target wrote.

    ``eval_samples`` jobs, chosen with the seed, are held out (every sample of a held-out job stays out of
    training: a document's summary quotes the document); eval holds each one's first sample. With
    ``train_samples`` training uses the first that many of the rest, in generation order, so runs on growing
    data share one held-out set.
    """
    data = GeneratedData(directory, request, target)
    jobs = [data.info(i)["job"] for i in range(len(data))]
    distinct = sorted(set(jobs))
    if len(distinct) <= eval_samples:
        raise SpeculaError(f"{len(distinct)} generated jobs are too few to hold out {eval_samples} for evaluation")
    order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(seed)).tolist()
    held = {distinct[i] for i in order[:eval_samples]}
    firsts: dict[int, int] = {}
    for index, job in enumerate(jobs):
        firsts.setdefault(job, index)
    evaluation = sorted(firsts[job] for job in held)
    kept = [index for index, job in enumerate(jobs) if job not in held]
    if train_samples is not None:
        if train_samples > len(kept):
            raise SpeculaError(f"--train-samples {train_samples} exceeds the {len(kept)} training samples")
        kept = kept[:train_samples]
    train = data if max_prompt_context is None else PromptCrop(data, max_prompt_context)
    return Subset(train, kept), Subset(data, evaluation)


__all__ = ["CachedFeatures", "DataOptions", "Subset", "feature_sets", "generated_sets"]
