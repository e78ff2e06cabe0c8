"""`specula calibrate`: measure α, c and the verification cost on this machine, predict, and save a profile.

0. With ``--weights auto`` (the default): which weight format ``auto`` should mean here. Every format
   the device runs is timed (one-token step), checked (the method against vanilla at T = 0, each
   divergence classified near-tie or real as `specula check` does) and compared with the float32
   model (top-1 agreement on float32's own greedy answers); the fastest with no real divergence and
   an agreement of at least ``min_agreement`` is chosen, recorded in the profile (``auto_weights``)
   and calibrated below.
1. The target's verification cost: time of one forward over n tokens after a
   real prompt, n = 1, 2, 4, ..., 128 (median of a few repeats).
2. The method and vanilla decode a few prompts, interleaved. From the method's
   draft trees: α (accepted over tried draft tokens), the acceptance rate of a
   child by its rank among its siblings, the mean draft depth γ and the time of
   one draft step; c = draft step / target step.
3. The lecture's predictions (`specula.bench.theory`): expected tokens per
   cycle, expected improvement factor, best γ for chains; a hardware-aware
   factor that uses the measured verification cost; for trees the node budget
   and depth that maximise predicted tokens/s. Predicted and measured speedups
   are printed side by side like the lecture's Table 4.
4. The profile (`specula.runtime.profile`) gets the measurements and the
   recommended drafter options of this method.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch

from specula.api import Speculator
from specula.bench import theory
from specula.bench.agreement import ArgmaxReference
from specula.bench.metrics import depth_counts, pooled_alpha
from specula.bench.runners import RecordingDrafter, accepted_path
from specula.chat.template import conversation_ids
from specula.decoding import generate_tokens, warm_up
from specula.divergence import NEAR_TIE, REAL, check_greedy
from specula.drafters.vanilla import VanillaDrafter
from specula.errors import SpeculaError
from specula.methods import build_speculator, get_method, resolve_draft
from specula.runtime.compiled_step import WARM_UP_BLOCK
from specula.runtime.heap import trim_heap
from specula.runtime.verify_cost import VERIFY_SIZES, measure_verify_curve, sync
from specula.runtime.weights import WEIGHT_FORMATS, check_available, resolve_weights
from specula.sampling import SamplingParams


@dataclass
class CalibrationOptions:
    target: str
    method: str
    draft: str | None = None
    options: dict | None = None
    prompts: list[str] | None = None
    max_new_tokens: int = 64
    max_prompt_tokens: int = 256
    temperature: float = 0.0
    dtype: str = "auto"
    weights: str = "auto"
    device: str = "cpu"
    threads: int | None = None
    repeats: int = 5
    max_nodes: int = 128
    seed: int = 0
    min_agreement: float = 0.8  # a format that changes more of the model than this is not "auto"
    compile: bool = False  # measure the compiled runtime (`Target.compile`); weight formats are compared eager


def tree_statistics(cycles) -> dict:
    """α, acceptance by sibling rank, mean draft depth and size from (tree, accepted ids) cycles."""
    accepted_lengths, tried_next, depths, sizes = [], [], [], []
    groups, rank_hits = 0, []
    for tree, accepted in cycles:
        path, children = accepted_path(tree, accepted)
        for parent in path:
            siblings = children.get(parent, [])
            if not siblings:
                continue
            groups += 1
            hit = next((rank for rank, c in enumerate(siblings) if c in path), None)
            if hit is not None:
                rank_hits += [0] * (hit + 1 - len(rank_hits))
                rank_hits[hit] += 1
        accepted_lengths.append(len(path) - 1)
        tried_next.append(bool(children.get(path[-1])))
        depths.append(max(tree.depths))
        sizes.append(len(tree) - 1)
    tried, hits = depth_counts(accepted_lengths, tried_next)
    return {
        "alpha": pooled_alpha(tried, hits),
        "acceptance_by_depth": [h / t if t else None for t, h in zip(tried, hits, strict=True)],
        "rank_acceptance": [h / groups for h in rank_hits] if groups else [],
        "mean_depth": statistics.fmean(depths) if depths else 0.0,
        "total_depth": sum(depths),
        "mean_nodes": statistics.fmean(sizes) if sizes else 0.0,
        "chains_only": all(d == s for d, s in zip(depths, sizes, strict=True)),
    }


def recommended_options(method: str, dynamic: bool, best_gamma: int | None, best_tree: dict | None,
                        chains_only: bool) -> dict:
    """The drafter options the profile should carry for this method (only those the registry says it takes)."""
    spec = get_method(method)
    if chains_only and best_gamma and spec.takes("num_tokens"):
        return {"num_tokens": best_gamma}
    if best_tree and best_tree.get("nodes") and dynamic and spec.takes("total_tokens", "depth", "top_k"):
        return {"total_tokens": best_tree["nodes"], "depth": best_tree["depth"], "top_k": best_tree["top_k"]}
    return {}


def _build(opts: CalibrationOptions, weights: str, compile: bool = False):
    # The options are measured as given: an existing profile must not change what is being calibrated, nor a draft
    # budget cap the drafts whose acceptance is being measured.
    return build_speculator(opts.target, opts.method, opts.draft, dtype=opts.dtype, device=opts.device,
                            profile=False, weights=weights, compile=compile, draft_budget="off",
                            **(opts.options or {}))


def _prompt_ids(opts: CalibrationOptions, target) -> list[list[int]]:
    budget = max(1, min(opts.max_prompt_tokens, target.max_length - opts.max_new_tokens - max(VERIFY_SIZES) - 1))
    # A user turn through the chat template when the tokenizer has one, as bench and check decode it.
    prompts = [ids for text in opts.prompts if (ids := conversation_ids(target.tokenizer, [text], [], budget)[0])]
    if not prompts:
        raise SpeculaError("the calibration prompts are empty after tokenization")
    return prompts


def choose_weights(opts: CalibrationOptions, log=lambda message: None) -> dict:
    """What ``--weights auto`` should mean on this machine: the fastest format that stays lossless.

    For every concrete format the device runs (`specula.runtime.weights.check_available`): the target's one-token
    step after the first prompt (median of ``repeats``), the method against vanilla at T = 0 on the
    calibration prompts, every divergence classified as `specula check` does (`divergence.check_greedy`), and
    the format's top-1 agreement with the float32 model on float32's own greedy answers to those prompts
    (how much of the model the format keeps: quantization makes another model, which every method then
    decodes losslessly). The choice is the fastest step among the formats with no real divergence
    (near-ties are floating-point rounding of the same model) and an agreement of at least
    ``opts.min_agreement``. Returns {"choice", "method", "formats": {format: measurements}}.
    """
    formats, reference = {}, None  # reference: (prompt + float32's answer, answer start, float32's argmax there)
    for fmt in WEIGHT_FORMATS[1:]:
        try:
            check_available(fmt, opts.device)
        except SpeculaError as err:
            formats[fmt] = {"available": False, "reason": str(err)}
            log(f"weights {fmt}: not available ({err})")
            continue
        log(f"weights {fmt}: measuring the step and checking {opts.method} against vanilla at T=0")
        speculator = _build(opts, fmt)
        target = speculator.target
        prompts = _prompt_ids(opts, target)
        step = measure_verify_curve(target, prompts[0], (1,), opts.repeats)[1]
        vanilla = Speculator(target, "vanilla", VanillaDrafter())
        greedy = check_greedy(speculator, vanilla, [torch.tensor(p, device=target.device) for p in prompts],
                              opts.max_new_tokens)
        if reference is None:  # float32 comes first in WEIGHT_FORMATS: its answers are the reference text
            texts = [torch.cat([torch.tensor(p, device=target.device),
                                torch.tensor(vanilla.generate(torch.tensor(p, device=target.device),
                                                              opts.max_new_tokens).token_ids, device=target.device)])
                     for p in prompts]
            reference = [(text, len(p), ArgmaxReference.of(target.prefill(text).logits[len(p) - 1:-1]))
                         for text, p in zip(texts, prompts, strict=True)]
        agreement = None
        for text, start, argmax in reference:
            found = argmax.agreement(target.prefill(text).logits[start - 1:-1])
            agreement = found if agreement is None else agreement.add(found)
        formats[fmt] = {"available": True, "step_s": step, "prompts": greedy.prompts,
                        "identical": greedy.identical, "near_ties": greedy.count(NEAR_TIE),
                        "real": greedy.count(REAL), "relative_tolerance": greedy.relative_tolerance,
                        "agreement_with_float32": agreement.rate}
        log(f"weights {fmt}: step {step * 1e3:.1f} ms, {greedy.identical}/{greedy.prompts} identical, "
            f"{greedy.count(NEAR_TIE)} near-ties, {greedy.count(REAL)} real divergences, top-1 agreement with "
            f"float32 {agreement.rate:.3f}")
        del speculator, target, vanilla
        gc.collect()
        trim_heap()
    lossless = {fmt: m["step_s"] for fmt, m in formats.items() if m["available"] and m["real"] == 0
                and m["agreement_with_float32"] >= opts.min_agreement}
    if not lossless:
        raise SpeculaError(f"no weight format decoded {opts.method} losslessly with an agreement of at least "
                           f"{opts.min_agreement} with float32 on this machine: "
                           + "; ".join(f"{f}: {m['real']} real divergences, agreement {m['agreement_with_float32']:.3f}"
                                       if m["available"] else f"{f}: not available" for f, m in formats.items()))
    return {"choice": min(lossless, key=lossless.get), "method": opts.method, "formats": formats,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def calibrate(opts: CalibrationOptions, log=lambda message: None) -> dict:
    """Measure and predict; returns the profile (without writing it).

    With ``weights`` auto the weight format is chosen first (`choose_weights`) and the method is then
    calibrated in it; the profile records the choice under ``auto_weights``.
    """
    if not opts.prompts:
        raise SpeculaError("calibration needs at least one prompt")
    params = SamplingParams(opts.temperature)
    resolve_weights(opts.weights)  # an unknown format fails before anything loads
    if opts.threads:
        torch.set_num_threads(opts.threads)
    auto_weights = choose_weights(opts, log) if opts.weights == "auto" else None
    speculator = _build(opts, auto_weights["choice"] if auto_weights else opts.weights, opts.compile)
    target, inner = speculator.target, speculator.drafter
    sizes = VERIFY_SIZES
    if target.compiled:
        # A compiled step pads a block to its bucket: every size it will verify is measured (not interpolated
        # between powers of two), all of them compiled before any is timed.
        log(f"compiling the target's steps (blocks of up to {WARM_UP_BLOCK} tokens)")
        warm_up(target, inner, WARM_UP_BLOCK)
        sizes = tuple(range(1, WARM_UP_BLOCK + 1))
    draft = resolve_draft(opts.method, opts.target, opts.draft)
    drafter = RecordingDrafter(inner)
    vanilla = VanillaDrafter()
    prompts = _prompt_ids(opts, target)

    log(f"measuring verification cost of {target.name} for {', '.join(map(str, sizes))} tokens")
    curve = measure_verify_curve(target, prompts[0], sizes, opts.repeats, inner.features)
    step = curve[1]

    log(f"decoding {len(prompts)} prompts with vanilla and {opts.method}")
    first = torch.tensor(prompts[0], device=target.device)
    generate_tokens(target, vanilla, first, min(8, opts.max_new_tokens), params, opts.seed)  # warm-up
    generate_tokens(target, drafter, first, min(8, opts.max_new_tokens), params, opts.seed)
    rates = {"vanilla": [], "method": []}
    cycles, draft_time, new_tokens, target_cycles = [], 0.0, 0, 0
    for i, ids in enumerate(prompts):
        ids = torch.tensor(ids, device=target.device)
        for name, d in (("vanilla", vanilla), ("method", drafter)):
            sync(target.device)
            start = time.perf_counter()
            tokens, stats = generate_tokens(target, d, ids, opts.max_new_tokens, params, opts.seed + i)
            sync(target.device)
            rates[name].append(len(tokens) / (time.perf_counter() - start))
            if name == "method":
                cycles += drafter.cycles
                draft_time += stats.draft_time
                new_tokens += stats.new_tokens
                target_cycles += stats.cycles
    trees = tree_statistics(cycles)
    alpha = trees["alpha"] or 0.0
    draft_step = draft_time / trees["total_depth"] if trees["total_depth"] else 0.0
    c = draft_step / step
    gamma = trees["mean_depth"]
    measured = statistics.fmean(rates["method"]) / statistics.fmean(rates["vanilla"])
    nodes_verified = trees["mean_nodes"] + 1
    verify_ratio = theory.verify_cost(curve, round(nodes_verified)) / step
    chains = trees["chains_only"] and gamma > 0
    expected = theory.expected_tokens(alpha, gamma) if chains else None
    if not chains and trees["rank_acceptance"]:
        plan = theory.tree_plan(trees["rank_acceptance"], round(trees["mean_nodes"]), max(1, round(gamma)))
        expected = plan["expected_tokens"]
    predicted_lecture = theory.improvement_factor(alpha, gamma, c) if chains else None
    predicted_hw = expected / (gamma * c + verify_ratio) if expected is not None else None
    best_gamma = theory.best_gamma(alpha, c, curve, min(16, max(sizes) - 1)) if chains else None
    max_nodes = min(opts.max_nodes, max(sizes) - 1)  # beyond the measured curve nothing is known
    best_tree = (theory.best_tree(trees["rank_acceptance"], draft_step, curve, max_nodes)
                 if trees["rank_acceptance"] else None)
    gamma_table = [
        {"gamma": g, "expected_tokens": theory.expected_tokens(alpha, g),
         "improvement": theory.improvement_factor(alpha, g, c),
         "hardware_improvement": theory.hardware_improvement(alpha, g, c, curve)}
        for g in range(1, 13)
    ] if chains else []
    entry = {
        "draft": None if draft is None else str(draft), "options": opts.options or {}, "temperature": opts.temperature,
        "prompts": len(prompts),
        "max_new_tokens": opts.max_new_tokens, "alpha": alpha, "acceptance_by_depth": trees["acceptance_by_depth"],
        "rank_acceptance": trees["rank_acceptance"], "gamma": gamma, "mean_nodes": trees["mean_nodes"],
        "draft_step_s": draft_step, "c": c, "tau": new_tokens / target_cycles if target_cycles else None,
        "expected_tokens": expected, "predicted_speedup_lecture": predicted_lecture,
        "predicted_speedup_hardware": predicted_hw, "measured_speedup": measured,
        "vanilla_tokens_per_s": statistics.fmean(rates["vanilla"]),
        "method_tokens_per_s": statistics.fmean(rates["method"]),
        "chain": chains, "gamma_table": gamma_table, "best_gamma": best_gamma, "best_tree": best_tree,
        "defaults": recommended_options(opts.method, getattr(inner, "dynamic", True), best_gamma, best_tree, chains),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    return {
        "target": target.name, "target_path": str(opts.target), "device": str(target.device.type),
        "dtype": str(target.dtype).removeprefix("torch."), "weights": target.weights, "compile": target.compiled,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__, "target_step_s": step,
        "verify_cost_s": {str(n): t for n, t in curve.items()},
        "methods": {opts.method: entry},
        **({"auto_weights": auto_weights} if auto_weights else {}),
    }


def format_report(profile: dict, method: str) -> str:
    """The human-readable calibration summary."""
    e = profile["methods"][method]
    curve = {int(n): t for n, t in profile["verify_cost_s"].items()}
    step = profile["target_step_s"]

    def f(value, fmt=".2f"):
        return "–" if value is None else f"{value:{fmt}}"

    lines = []
    choice = profile.get("auto_weights")
    if choice:
        lines += ["weight formats (one-token step; the method against vanilla at T=0):"]
        for fmt, m in choice["formats"].items():
            agreement = m.get("agreement_with_float32")
            lines.append(f"  {fmt}: " + (f"{m['step_s'] * 1e3:.1f} ms, {m['identical']}/{m['prompts']} identical, "
                                         f"{m['near_ties']} near-ties, {m['real']} real divergences, top-1 "
                                         f"agreement with float32 {f(agreement, '.3f')}"
                                         if m["available"] else f"not available ({m['reason']})"))
        lines += [f"--weights auto means {choice['choice']} for this target on this machine", ""]
    lines += [
        f"target {profile['target']} ({profile['dtype']}, {profile.get('weights', 'float32')} weights, "
        f"{'compiled, ' if profile.get('compile') else ''}"
        f"{profile['device']}, {profile['threads']} threads): "
        f"one target step {step * 1e3:.2f} ms",
        "verification cost v(n)/v(1): " + ", ".join(f"{n}: {t / step:.2f}" for n, t in sorted(curve.items())),
        f"method {method}: α {f(e['alpha'])}, mean draft depth γ {f(e['gamma'])}, {f(e['mean_nodes'], '.1f')} nodes "
        f"per draft, draft step {e['draft_step_s'] * 1e3:.3f} ms, c {f(e['c'], '.3f')}",
        "acceptance by depth: " + ", ".join(f"{a:.2f}" if a is not None else "–"
                                            for a in e["acceptance_by_depth"][:8]),
        "acceptance by sibling rank: " + ", ".join(f"{a:.2f}" for a in e["rank_acceptance"][:8]),
        "",
        "expected vs measured (cf. the lecture's Table 4):",
        "| method | T | γ | α | c | E[tokens/cycle] | τ measured | EXP lecture | EXP hardware | EMP |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {method} | {e['temperature']:g} | {f(e['gamma'])} | {f(e['alpha'])} | {f(e['c'], '.3f')} | "
        f"{f(e['expected_tokens'])} | {f(e['tau'])} | {f(e['predicted_speedup_lecture'])} | "
        f"{f(e['predicted_speedup_hardware'])} | {f(e['measured_speedup'])} |",
        "",
        "EXP lecture = (1 − α^(γ+1)) / ((1 − α)(γc + 1)); EXP hardware replaces the 1 (one target step to "
        "verify) by the measured v(nodes + 1)/v(1); EMP = measured tokens/s over vanilla's on the same prompts.",
    ]
    if e["gamma_table"]:
        lines += ["", "| γ | E[tokens/cycle] | EXP lecture | EXP hardware |", "|---|---|---|---|"]
        lines += [f"| {row['gamma']} | {row['expected_tokens']:.2f} | {row['improvement']:.2f} | "
                  f"{row['hardware_improvement']:.2f} |" for row in e["gamma_table"]]
        best = max(row["hardware_improvement"] for row in e["gamma_table"])
        lines.append(f"best γ for chains on this machine: {e['best_gamma']}"
                     + ("" if best >= 1 else f" (but even it is predicted slower than vanilla: {best:.2f}×)"))
    tree = e.get("best_tree")
    if tree and not e["chain"]:
        if tree["nodes"]:
            lines.append(
                f"best tree (position-only model, measured verify cost): {tree['nodes']} nodes, depth "
                f"{tree['depth']}, top-k {tree['top_k']}: {tree['expected_tokens']:.2f} tokens/cycle, predicted "
                f"speedup {tree['predicted_speedup']:.2f}")
        else:
            lines.append("best tree (position-only model, measured verify cost): none; every draft budget is "
                         "predicted slower than vanilla on this machine")
    lines.append("recommended options: " + (", ".join(f"{k}={v}" for k, v in e["defaults"].items()) or "none"))
    return "\n".join(lines)
