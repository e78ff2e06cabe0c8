"""Part 2 of `specula check`: the method's loop sampled at T > 0, with the power to see a distortion planned first.

Order of work, so that nothing about the test depends on its own outcome:

1. Plan. Per prompt the target's exact distribution gives the chi-square's cells for a sample size n
   (`specula.certify.distribution_test.likely_sequences`); `specula.certify.power` turns n and the cells' degrees
   of freedom into the least distortion detected with power 0.8, and the distortion asked for (``tv``) into the
   n that reaches it. n starts at ``samples`` and grows to that fixed point, capped at ``max_samples``. Only
   exact probabilities enter the plan, never a sample, so the test keeps its level.
2. The control: the method's own acceptor judging drafts against the target's distribution tilted to
   p^(1/f) (`TiltedAcceptor`), f chosen so that the control's distortion through the same cells is ``tv``
   (`specula.certify.power.control_factor`, computed exactly). It must be rejected; otherwise the check could
   not have failed, and the verdict is "inconclusive".
3. Sample the method and the control n times per prompt (they share seeds and, through a `ForwardMemo`, the
   target's forwards; see `specula.certify.forward_memo`) and test both (`specula.certify.distribution_test`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from specula.acceptance import Acceptance
from specula.certify.distribution_test import (
    MIN_EXPECTED,
    FitResult,
    chi_square_df,
    fit,
    likely_sequences,
    tested_cells,
    token_statistics,
)
from specula.certify.exact_distribution import ExactDistribution
from specula.certify.forward_memo import ForwardMemo
from specula.certify.power import POWER, control_factor, detectable_tv, samples_for_tv
from specula.decoding import generate_tokens
from specula.runtime.target import Target
from specula.sampling import SamplingParams, probabilities
from specula.tree import DraftTree

TV = 0.1  # the distortion (total variation over the cells) the T > 0 test must detect, by default
MAX_SAMPLES = 2000  # per prompt: the most the plan may ask for
PLAN_ROUNDS = 6
UNWARPED = SamplingParams(1.0)  # the tilted logits are already the distribution to sample


class TiltedAcceptor:
    """The power control: ``base`` (the method's own acceptor) judging drafts against q ∝ p^(1/factor), p the
    target's distribution as the sampling parameters warp it (the target at ``factor`` times the temperature,
    on p's own top-k / top-p support). A lossless acceptor then emits exactly q from the second token on."""

    lossless = False

    def __init__(self, base, factor: float):
        self.base, self.factor = base, factor

    def __call__(self, tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None) -> Acceptance:
        if params.greedy:
            return self.base(tree, target_logits, params, generator)
        tilted = torch.log(probabilities(target_logits, params)) / self.factor  # [n, V]; -inf off the support
        return self.base(tree, tilted, UNWARPED, generator)


@dataclass
class SamplingResult:
    """T > 0: the plan, the distribution test of the method and of the planted-error control.

    target_tv: the distortion asked to be detected; detectable_tv: the least one this sample size detects with
    probability ``power`` (total variation over the chi-square's cells, on every prompt; `specula.certify.power`).
    control_factor / control_tv: the control's tilt and its exact distortion through the same cells.
    """

    temperature: float
    top_p: float
    top_k: int
    alpha: float
    prefixes: int
    samples_per_prefix: int
    tokens: int
    drafted: int
    accepted: int
    method: FitResult
    control: FitResult
    control_description: str
    target_tv: float = TV
    detectable_tv: float = 1.0
    power: float = POWER
    max_samples: int = MAX_SAMPLES
    control_factor: float = 1.0
    control_tv: float = 0.0

    @property
    def powered(self) -> bool:
        """Whether the sample size reaches the distortion asked for."""
        return self.detectable_tv <= self.target_tv

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "alpha": self.alpha,
                "prefixes": self.prefixes, "samples_per_prefix": self.samples_per_prefix, "tokens": self.tokens,
                "drafted": self.drafted, "accepted": self.accepted,
                "power": {"target_tv": self.target_tv, "detectable_tv": self.detectable_tv, "power": self.power,
                          "max_samples": self.max_samples},
                "method": self.method.as_dict(),
                "control": {"description": self.control_description, "factor": self.control_factor,
                            "tv": self.control_tv, **self.control.as_dict()}}


def draft_model(drafter) -> Target | None:
    """The separate draft model a drafter runs (sps), or None (heads and lookups run no model of their own)."""
    draft = getattr(drafter, "draft", None)
    return draft if isinstance(draft, Target) else None


def _memoized(drafter):
    """``drafter``, or a copy whose draft model (sps) answers through its own `ForwardMemo`: a draft model's
    forwards are as deterministic as the target's, and every run of a prompt repeats its prefill."""
    draft = draft_model(drafter)
    if draft is None:
        return drafter
    memoized = copy.copy(drafter)
    memoized.draft = ForwardMemo(draft)
    return memoized


def _sample(target, drafter, acceptor, ids: torch.Tensor, params: SamplingParams, tokens: int,
            seeds: range) -> tuple[list[tuple[int, ...]], int, int]:
    """(the first ``tokens`` new tokens of one loop run per seed, draft tokens proposed, draft tokens accepted).

    ``target`` is the speculator's target or a `ForwardMemo` of it, ``drafter`` its drafter or `_memoized` copy:
    the runs are the same either way.
    """
    sequences, drafted, accepted = [], 0, 0
    for seed in seeds:
        new, stats = generate_tokens(target, drafter, ids, tokens, params, seed=seed,
                                     stop_on_eos=False, acceptor=acceptor)
        sequences.append(tuple(new))
        drafted += sum(stats.tree_sizes)
        accepted += sum(stats.accepted_lengths)
    return sequences, drafted, accepted


def plan(exacts: list[ExactDistribution], tokens: int, samples: int, max_samples: int, tv: float,
         level: float) -> tuple[int, list[dict[tuple[int, ...], float]], float]:
    """(samples per prompt, each prompt's chi-square cells at that size, the distortion it detects).

    From ``samples`` up: cells for n, their degrees of freedom, the n `samples_for_tv` asks for ``tv`` at
    ``level`` (the chi-square's share of alpha); again with that n until it suffices or reaches ``max_samples``.
    """
    n = min(samples, max_samples)
    for _ in range(PLAN_ROUNDS):
        cells = []
        for exact in exacts:
            exact.reattach()  # the prompts' distributions share the target's cache
            cells.append(likely_sequences(exact, tokens, MIN_EXPECTED / n))
        df = sum(chi_square_df(c, n) for c in cells)
        need = samples_for_tv(tv, len(exacts), df, level)
        if need <= n or n >= max_samples:
            break
        n = min(max_samples, max(need, n + 1))
    return n, cells, detectable_tv(n * len(exacts), df, level)


def check_sampling(speculator, prompts: list[torch.Tensor], params: SamplingParams, samples: int, tokens: int,
                   seed: int, alpha: float, tv: float = TV, max_samples: int = MAX_SAMPLES) -> SamplingResult:
    """Part 2: plan the sample size for ``tv``, then test the method's loop and the planted-error control.

    Cost: every run goes through one `ForwardMemo` per prompt, so runs that share their history (the
    prompt's prefill always; then each verify pass until their sampled tokens part, and the control,
    which reuses the method's seeds, until its acceptor first decides otherwise) share the target's
    forwards; the runs themselves are bit for bit those of plain decoding (see `specula.certify.forward_memo`).
    The exact probabilities are computed once per distinct prefix, as token trees
    (`specula.certify.exact_distribution`).
    """
    target = speculator.target
    exacts = [ExactDistribution(target, ids, params) for ids in prompts]
    level = alpha / 2  # the chi-square's Bonferroni share next to the likelihood z-test
    n, cells, detectable = plan(exacts, tokens, samples, max_samples, tv, level)
    tested = [tested_cells(c, n) for c in cells]
    factor, control_tv = control_factor(list(zip(exacts, tested, strict=True)), tv)
    control = TiltedAcceptor(speculator.acceptor, factor)
    drafted = accepted = 0
    method_data, control_data = [], []
    for k, (ids, exact) in enumerate(zip(prompts, exacts, strict=True)):
        seeds = range(seed + k * n, seed + (k + 1) * n)  # the control reuses the method's seeds
        memo, drafter = ForwardMemo(target), _memoized(speculator.drafter)
        drawn, proposed, kept = _sample(memo, drafter, speculator.acceptor, ids, params, tokens, seeds)
        planted, _, _ = _sample(memo, drafter, control, ids, params, tokens, seeds)
        del memo, drafter  # their remembered outputs and cache entries
        drafted, accepted = drafted + proposed, accepted + kept
        exact.reattach()
        statistics = token_statistics(exact, drawn + planted)
        method_data.append((drawn, statistics, cells[k]))
        control_data.append((planted, statistics, cells[k]))
    target.reset()
    description = f"the method's acceptor judging against the target at {factor:.3g} x T"
    return SamplingResult(params.temperature, params.top_p, params.top_k, alpha, len(prompts), n, tokens,
                          drafted, accepted, fit(method_data), fit(control_data), description, tv, detectable,
                          POWER, max_samples, factor, control_tv)
