"""Running one turn of one question with one method, timed the same way for every method.

`SpeculaRunner` runs our decode loop (`specula.decoding.generate_tokens`) with
a method assembled by `specula.methods.build_speculator`; `HFRunner` runs `transformers` `generate`
(plain, assisted with a draft model, or prompt lookup) on the same loaded
model. Both return a `TurnResult`; the wall time is taken around the whole
generation (prefill included) and nothing else.

Our methods decode with ``record_nodes=True``: the loop notes each tested
draft node as (confidence, accepted, depth) (see `GenerationStats`), which
`analyse_nodes` turns into per-depth acceptance counts (per cycle and per
node, cf. EAGLE-2 Fig. 5) and, when the drafts carry confidences, a
confidence-vs-acceptance histogram (EAGLE-2 Fig. 6). `RecordingDrafter` keeps
whole trees instead, for calibration's sibling-rank statistics.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass, field

import torch

from specula.bench.config import MethodSpec
from specula.bench.metrics import add_to_calibration, depth_counts, empty_calibration
from specula.decoding import generate_tokens
from specula.drafters.draft_model import check_same_vocabulary
from specula.methods import build_speculator
from specula.runtime.plain_model import transformers_model
from specula.runtime.target import Target
from specula.sampling import SamplingParams


@dataclass
class TurnResult:
    token_ids: list[int]
    wall_time: float
    cycles: int | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    prefill_time: float | None = None
    accepted_lengths: list[int] | None = None
    stop_reason: str = ""
    depth_tried: list[int] | None = None
    depth_accepted: list[int] | None = None
    calibration: dict | None = None
    node_depth_tried: list[int] | None = None
    node_depth_accepted: list[int] | None = None
    cuda_peak_mb: float | None = None
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------- memory


def rss_mb() -> float:
    """Resident set size of this process now, in MiB."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        try:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * resource.getpagesize() / 2**20
        except OSError:
            return max_rss_mb()


def max_rss_mb() -> float:
    """Peak resident set size of this process since it started, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cuda_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _cuda_peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


# ---------------------------------------------------------------- our methods


def accepted_path(tree, accepted: torch.Tensor) -> tuple[list[int], dict[int, list[int]]]:
    """Node indices of the accepted path (root first) and each node's children, in node order.

    ``accepted`` holds the token ids the target kept, root first; the path is
    found by searching down from the root for a path spelling them (siblings
    may repeat a token when drafts are sampled, so the first match can be a dead end).
    """
    tokens = tree.tokens.tolist()
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents[1:], start=1):
        children.setdefault(parent, []).append(i)
    wanted = accepted.tolist()[1:]
    best = [0]
    stack = [[0]]
    while stack:
        path = stack.pop()
        if len(path) > len(best):
            best = path
            if len(best) == len(wanted) + 1:
                break
        depth = len(path) - 1
        if depth < len(wanted):
            stack.extend(path + [c] for c in reversed(children.get(path[-1], [])) if tokens[c] == wanted[depth])
    return best, children


@dataclass
class NodeAnalysis:
    """Acceptance counts of one generation's tested draft nodes. Index 0 of each list is depth 1.

    depth_tried / depth_accepted:           per cycle (n-α): cycles that tried / accepted a token at depth d.
    node_depth_tried / node_depth_accepted: per node: tested nodes at depth d / those on the accepted path.
    calibration: the confidence histogram of tested nodes (`metrics.empty_calibration`), None without confidences.
    """

    depth_tried: list[int]
    depth_accepted: list[int]
    node_depth_tried: list[int]
    node_depth_accepted: list[int]
    calibration: dict | None


def analyse_nodes(accepted_lengths: list[int], nodes: list[list[tuple[float, bool, int]]]) -> NodeAnalysis:
    """Acceptance by depth and calibration from `GenerationStats.nodes` (one list per cycle).

    A tested node (its parent accepted) counts as accepted when it lies on the accepted path. A
    cycle tried depth a + 1 when it tested a node one deeper than its a accepted drafts.
    """
    tried_next = [any(depth == a + 1 for _, _, depth in cycle) for a, cycle in zip(accepted_lengths, nodes,
                                                                                     strict=True)]
    tried, hits = depth_counts(accepted_lengths, tried_next)
    node_tried, node_hits = [], []
    calibration = None
    for confidence, accepted, depth in (node for cycle in nodes for node in cycle):
        grow = depth - len(node_tried)
        node_tried, node_hits = node_tried + [0] * grow, node_hits + [0] * grow
        node_tried[depth - 1] += 1
        node_hits[depth - 1] += int(accepted)
        if not math.isnan(confidence):
            calibration = calibration or empty_calibration()
            add_to_calibration(calibration, confidence, accepted)
    return NodeAnalysis(tried, hits, node_tried, node_hits, calibration)


class RecordingDrafter:
    """A drafter that remembers each cycle's tree and accepted tokens; otherwise the inner drafter itself."""

    def __init__(self, inner):
        self.inner = inner
        self.cycles: list[tuple[object, torch.Tensor]] = []
        self._tree = None

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def features(self):
        return self.inner.features

    def start(self, prompt, target_out) -> None:
        self.cycles = []
        self.inner.start(prompt, target_out)

    def propose(self, context, max_depth, params, generator):
        self._tree = self.inner.propose(context, max_depth, params, generator)
        return self._tree

    def observe(self, accepted, target_out) -> None:
        self.cycles.append((self._tree, accepted))
        self.inner.observe(accepted, target_out)

    def fork(self) -> RecordingDrafter:
        return RecordingDrafter(self.inner.fork())


def is_lossy(options: dict) -> bool:
    """Whether a method's options select the lossy typical acceptance."""
    return options.get("acceptance", "lossless") == "typical"


class SpeculaRunner:
    """One of our methods on the shared target, assembled by the registry like `specula.load` does."""

    def __init__(self, spec: MethodSpec, target: Target, dtype: str):
        self.spec = spec
        self.target = target
        # Profile defaults were merged (and recorded) when the spec was made, so none are applied here.
        speculator = build_speculator(target, spec.method, spec.draft, dtype=dtype, profile=False, **spec.options)
        self.drafter, self.acceptor = speculator.drafter, speculator.acceptor
        self.budget = speculator.budget  # now: a curve measured on first use is not timed with a question
        draft = getattr(self.drafter, "draft", None)
        self.draft_model = draft if isinstance(draft, Target) else None  # a separate model with its own context

    def run(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int) -> TurnResult:
        device = self.target.device
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        _cuda_reset(device)
        _sync(device)
        start = time.perf_counter()
        tokens, stats = generate_tokens(self.target, self.drafter, ids, max_new_tokens, params, seed,
                                        acceptor=self.acceptor, record_nodes=True, budget=self.budget)
        _sync(device)
        wall = time.perf_counter() - start
        nodes = analyse_nodes(stats.accepted_lengths, stats.nodes)
        return TurnResult(tokens, wall, cycles=stats.cycles, draft_time=stats.draft_time,
                          verify_time=stats.verify_time, prefill_time=stats.prefill_time,
                          accepted_lengths=list(stats.accepted_lengths), stop_reason=stats.stop_reason,
                          depth_tried=nodes.depth_tried, depth_accepted=nodes.depth_accepted,
                          calibration=nodes.calibration, node_depth_tried=nodes.node_depth_tried,
                          node_depth_accepted=nodes.node_depth_accepted, cuda_peak_mb=_cuda_peak(device))


# ---------------------------------------------------------------- transformers baselines


class _CountCalls:
    """Counts forward calls of a module while active (the target forwards of one generate call)."""

    def __init__(self, module: torch.nn.Module):
        self.module, self.calls, self.handle = module, 0, None

    def __enter__(self):
        self.calls = 0
        self.handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, *_):
        self.calls += 1

    def __exit__(self, *exc):
        self.handle.remove()


class HFRunner:
    """`transformers` generate on the target's own model: hf (plain), hf_assisted, hf_pld."""

    def __init__(self, spec: MethodSpec, target: Target, dtype: str):
        self.spec = spec
        self.target = target
        self.kwargs: dict = {}
        self.draft_model: Target | None = None
        if spec.method == "hf_assisted":
            draft = Target.load(spec.draft, dtype=dtype, device=target.device, role="draft")
            check_same_vocabulary(target, draft)
            self.draft_model = draft
            assistant = transformers_model(draft.model)
            for key, value in spec.options.items():
                setattr(assistant.generation_config, key, value)
            self.kwargs["assistant_model"] = assistant
        elif spec.method == "hf_pld":
            self.kwargs["prompt_lookup_num_tokens"] = int(spec.options.get("num_tokens", 10))
            if "max_matching_ngram_size" in spec.options:
                self.kwargs["max_matching_ngram_size"] = int(spec.options["max_matching_ngram_size"])
        eos = sorted(target.eos_token_ids)
        self.kwargs.update(eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)

    def run(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams, seed: int) -> TurnResult:
        device = self.target.device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        sampling = {"do_sample": False}
        if not params.greedy:
            # transformers' own default top_k is 50: pass ours (0 = off) explicitly so both sample alike.
            sampling = {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k,
                        "top_p": params.top_p}
        torch.manual_seed(seed)
        _cuda_reset(device)
        model = transformers_model(self.target.model)
        with _CountCalls(model) as counter, torch.no_grad():
            _sync(device)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids),
                                             **sampling, **self.kwargs)
            _sync(device)
            wall = time.perf_counter() - start
        tokens = out[0, len(prompt_ids):].tolist()
        stop = "eos" if tokens and tokens[-1] in self.target.eos_token_ids else "max_new_tokens"
        return TurnResult(tokens, wall, cycles=counter.calls or None, stop_reason=stop,
                          cuda_peak_mb=_cuda_peak(device))


def make_runner(spec: MethodSpec, target: Target, dtype: str):
    return (HFRunner if spec.is_hf else SpeculaRunner)(spec, target, dtype)
