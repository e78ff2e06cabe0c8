"""Spec-Bench metrics over per-question records (pure functions: no models, no clocks).

A record is one (question, method, temperature) run; see `specula.bench.suite`
for its fields. The definitions:

- tokens/s of a question: its new tokens over the wall time of its whole
  generations (all turns, prefill included);
- speedup of a method: mean per-question tokens/s of the method over the mean
  per-question tokens/s of vanilla on the same questions (a ratio of means, as
  Spec-Bench computes it);
- τ: new tokens over draft-and-verify cycles, pooled over the records (the
  prefill's own token counts as one cycle, so vanilla is 1.00);
- acceptance by depth (n-α): the d-th rate is the fraction of cycles whose
  accepted length is >= d among the cycles that tried a draft token at depth d
  (accepted length >= d - 1 and the last accepted node had a child to try);
- acceptance by depth per node: the fraction of tested draft tokens at depth d
  (those whose parent was accepted) that lie on the accepted path. Equal to n-α
  for chains; lower in trees, where siblings compete (cf. EAGLE-2 Fig. 5);
- calibration (EAGLE-2 Fig. 6): tested draft tokens binned by the drafter's own
  probability of the token given its parent; a bin's acceptance rate is the
  fraction of its tokens on the accepted path;
- τ by context length: the same ratio over the turns whose prompt (the conversation so far, with the
  model's own earlier answers) falls in a length bucket (`CONTEXT_BUCKETS`), for drafters that lose
  acceptance as the context grows;
- greedy equality: at T=0, the fraction of questions whose tokens equal vanilla's; the others are
  split into near-ties and real divergences (`specula.bench.divergences`, the check's classifier).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

CALIBRATION_BINS = 20
# Prompt-length buckets of `tau_by_context`, in tokens: [lower, upper) with a label.
CONTEXT_BUCKETS = ((0, 512, "<512"), (512, 1024, "512-1k"), (1024, 2048, "1k-2k"), (2048, 4096, "2k-4k"),
                   (4096, None, ">=4k"))


def depth_counts(accepted: Sequence[int], tried_next: Sequence[bool]) -> tuple[list[int], list[int]]:
    """Per-depth (tried, accepted) counts from per-cycle accepted lengths.

    ``tried_next[i]`` says whether cycle i tried a token one deeper than its
    accepted path (the last accepted node had at least one child). Index 0 of
    each list is depth 1.
    """
    if len(accepted) != len(tried_next):
        raise ValueError("accepted and tried_next must have one entry per cycle")
    deepest = max((a + bool(t) for a, t in zip(accepted, tried_next, strict=True)), default=0)
    tried, hits = [0] * deepest, [0] * deepest
    for a, t in zip(accepted, tried_next, strict=True):
        for d in range(a):
            tried[d] += 1
            hits[d] += 1
        if t:
            tried[a] += 1
    return tried, hits


def chain_tried_next(accepted: Sequence[int], draft_lengths: Sequence[int]) -> list[bool]:
    """For chains: a cycle tried one more token when it accepted fewer than it drafted."""
    return [a < n for a, n in zip(accepted, draft_lengths, strict=True)]


def add_counts(total: list[int], more: Sequence[int]) -> list[int]:
    """Element-wise sum of two count lists of possibly different lengths."""
    out = list(total) + [0] * max(0, len(more) - len(total))
    for i, v in enumerate(more):
        out[i] += v
    return out


def rates(tried: Sequence[int], hits: Sequence[int]) -> list[float | None]:
    return [h / t if t else None for t, h in zip(tried, hits, strict=False)]


def pooled_alpha(tried: Sequence[int], hits: Sequence[int]) -> float | None:
    """α as the lecture uses it: accepted over tried draft tokens, pooled over depths."""
    total = sum(tried)
    return sum(hits) / total if total else None


def tau(records: Iterable[dict]) -> float | None:
    records = [r for r in records if r.get("cycles")]
    cycles = sum(r["cycles"] for r in records)
    return sum(r["new_tokens"] for r in records) / cycles if cycles else None


def tau_by_context(records: Iterable[dict]) -> dict[str, dict]:
    """{bucket label: {"turns", "new_tokens", "tau", "tokens_per_s"}} over the records' turns, by prompt length.

    Only buckets holding a turn with counted cycles appear; tokens/s is pooled (the bucket's new tokens over
    its turns' wall time, prefill included).
    """
    out = {}
    turns = [t for r in records for t in r["turns"] if t.get("cycles")]
    for lower, upper, label in CONTEXT_BUCKETS:
        inside = [t for t in turns if t["prompt_tokens"] >= lower and (upper is None or t["prompt_tokens"] < upper)]
        if inside:
            tokens, wall = sum(t["new_tokens"] for t in inside), sum(t["wall_time"] for t in inside)
            out[label] = {"turns": len(inside), "new_tokens": tokens, "tau": tokens / sum(t["cycles"] for t in inside),
                          "tokens_per_s": tokens / wall if wall else None}
    return out


def mean_tokens_per_s(records: Iterable[dict]) -> float | None:
    values = [r["tokens_per_s"] for r in records]
    return statistics.fmean(values) if values else None


def speedup(method_records: Iterable[dict], baseline_records: Iterable[dict]) -> float | None:
    """Ratio of mean per-question tokens/s, over the questions both have."""
    base = {r["question"]: r for r in baseline_records}
    mine = [r for r in method_records if r["question"] in base]
    if not mine:
        return None
    denominator = mean_tokens_per_s(base[r["question"]] for r in mine)
    return mean_tokens_per_s(mine) / denominator if denominator else None


def tokens_of(record: dict) -> list[int]:
    return [t for turn in record["turns"] for t in turn["token_ids"]]


def greedy_equality(method_records: Iterable[dict], baseline_records: Iterable[dict]) -> float | None:
    """Fraction of shared questions whose generated tokens (all turns) equal the baseline's."""
    base = {r["question"]: tokens_of(r) for r in baseline_records}
    pairs = [(tokens_of(r), base[r["question"]]) for r in method_records if r["question"] in base]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def greedy_divergences(records: Iterable[dict]) -> dict | None:
    """{"near_ties": n, "real": m} over the records' classified divergences; None when none was classified."""
    judged = [r["divergence"] for r in records if "divergence" in r]
    if not judged:
        return None
    kinds = [d["kind"] for d in judged if d is not None]
    return {"near_ties": kinds.count("near-tie"), "real": kinds.count("real")}


def time_shares(records: Iterable[dict]) -> tuple[float | None, float | None]:
    """Fractions of the wall time spent drafting and verifying (None when the runner cannot tell)."""
    records = [r for r in records if r.get("draft_time") is not None]
    wall = sum(r["wall_time"] for r in records)
    if not wall:
        return None, None
    return sum(r["draft_time"] for r in records) / wall, sum(r["verify_time"] for r in records) / wall


def repetition(tokens: Sequence[int], n: int = 4) -> float:
    """Share of n-grams that repeat an earlier n-gram of the same text (0: none, near 1: a loop)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def empty_calibration() -> dict:
    return {"count": [0] * CALIBRATION_BINS, "accepted": [0] * CALIBRATION_BINS,
            "confidence": [0.0] * CALIBRATION_BINS}


def add_to_calibration(cal: dict, confidence: float, accepted: bool) -> None:
    b = min(CALIBRATION_BINS - 1, max(0, int(confidence * CALIBRATION_BINS)))
    cal["count"][b] += 1
    cal["accepted"][b] += int(accepted)
    cal["confidence"][b] += float(confidence)


def merge_calibration(items: Iterable[dict | None]) -> dict | None:
    out = None
    for cal in items:
        if cal is None:
            continue
        out = out or empty_calibration()
        for key in out:
            out[key] = [a + b for a, b in zip(out[key], cal[key], strict=True)]
    return out


def calibration_curve(cal: dict | None) -> list[tuple[float, float, int]]:
    """(mean confidence, acceptance rate, count) of each non-empty bin."""
    if cal is None:
        return []
    return [(c / n, a / n, n) for n, a, c in zip(cal["count"], cal["accepted"], cal["confidence"], strict=True) if n]


def summarize(records: list[dict], baseline: list[dict] | None, greedy: bool) -> dict:
    """Every metric of one group of records (a method in a category, or overall)."""
    tried, hits, node_tried, node_hits = [], [], [], []
    for r in records:
        tried = add_counts(tried, r.get("depth_tried") or [])
        hits = add_counts(hits, r.get("depth_accepted") or [])
        node_tried = add_counts(node_tried, r.get("node_depth_tried") or [])
        node_hits = add_counts(node_hits, r.get("node_depth_accepted") or [])
    draft_share, verify_share = time_shares(records)
    rss = [r["rss_mb"] for r in records if r.get("rss_mb") is not None]
    cuda = [r["cuda_peak_mb"] for r in records if r.get("cuda_peak_mb") is not None]
    has_depths = any(r.get("depth_tried") is not None for r in records)
    has_nodes = any(r.get("node_depth_tried") is not None for r in records)  # absent from older records
    return {
        "questions": len(records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "tokens_per_s": mean_tokens_per_s(records),
        "speedup": speedup(records, baseline) if baseline else None,
        "tau": tau(records),
        "alpha": pooled_alpha(tried, hits),
        "acceptance_by_depth": rates(tried, hits) if has_depths else None,
        "depth_tried": tried if has_depths else None,
        "node_acceptance_by_depth": rates(node_tried, node_hits) if has_nodes else None,
        "draft_share": draft_share,
        "verify_share": verify_share,
        "peak_rss_mb": max(rss) if rss else None,
        "cuda_peak_mb": max(cuda) if cuda else None,
        "greedy_equal": greedy_equality(records, baseline) if greedy and baseline else None,
        "greedy_divergences": greedy_divergences(records) if greedy and baseline else None,
        "repetition": statistics.fmean(r["repetition"] for r in records) if records else None,
        "calibration": merge_calibration(r.get("calibration") for r in records),
    }


def aggregate(records: list[dict], methods: list[str], baseline: str = "vanilla",
              hf_methods: Sequence[str] = ("hf", "hf_assisted", "hf_pld")) -> dict:
    """{temperature: {method: {category or 'overall': summary}}}; speedups are against ``baseline``.

    Each method's overall summary also gets ``vs_best_hf``: its mean tokens/s over
    that of the fastest `transformers` baseline in the run (None without one).
    """
    out: dict[str, dict] = {}
    for temperature in sorted({r["temperature"] for r in records}):
        at_t = [r for r in records if r["temperature"] == temperature]
        categories = list(dict.fromkeys(r["category"] for r in at_t))
        base_all = [r for r in at_t if r["method"] == baseline]
        table: dict[str, dict] = {}
        for method in methods:
            mine = [r for r in at_t if r["method"] == method]
            if not mine:
                continue
            row = {}
            for category in categories:
                group = [r for r in mine if r["category"] == category]
                if group:
                    row[category] = summarize(group, [r for r in base_all if r["category"] == category],
                                              temperature == 0)
            row["overall"] = summarize(mine, base_all, temperature == 0)
            row["overall"]["by_context"] = tau_by_context(mine)
            table[method] = row
        hf_rates = {m: table[m]["overall"]["tokens_per_s"] for m in hf_methods if m in table}
        best_hf = max(hf_rates, key=hf_rates.get) if hf_rates else None
        for row in table.values():
            row["overall"]["vs_best_hf"] = (
                row["overall"]["tokens_per_s"] / hf_rates[best_hf] if best_hf and hf_rates[best_hf] else None)
            row["overall"]["best_hf"] = best_hf
        out[f"{temperature:g}"] = table
    return out
