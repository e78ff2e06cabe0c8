"""results.md and the PNG plots of a bench run, from the aggregates in results.json.

- ``results.md``: per temperature, a table shaped like Table 1 of the EAGLE-2
  paper (rows methods, columns categories and overall, cells "speedup× / τ"),
  then per-method details (tokens/s, speedup over the best `transformers`
  baseline, greedy equality, acceptance by depth, time shares, memory), and τ by prompt length
  when the turns span several length buckets (long conversations).
- ``speedup_tau.png``: speedup and τ per method and category.
- ``acceptance_by_depth.png``: acceptance rate by depth in the draft (cf. EAGLE-2 Fig. 5), per
  cycle (n-α, top row) and per tested draft token (bottom row; lower than n-α in trees, where
  siblings compete; absent for records written before it was recorded).
- ``calibration.png``: draft confidence against acceptance rate (EAGLE-2 Fig. 6), for
  methods whose drafts carry confidences; the others are named as not available. A point is
  a confidence bin of tested draft tokens (their parent was accepted); its acceptance rate
  is the fraction of them on the accepted path. A calibrated drafter lies on the diagonal.

Rows and plot labels of methods run with the lossy typical acceptance say so.
"""

from __future__ import annotations

from pathlib import Path

from specula.bench.metrics import CONTEXT_BUCKETS, calibration_curve
from specula.bench.runners import is_lossy
from specula.files.outputs import atomic_write, atomic_write_text

PLOTS = ("speedup_tau.png", "acceptance_by_depth.png", "calibration.png")
DEPTH_COLUMNS = 5
MIN_BIN_COUNT = 5  # calibration bins with fewer draft tokens are too noisy to plot


def _num(value, fmt: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{fmt}}{suffix}"


def _categories(table: dict) -> list[str]:
    seen: dict[str, None] = {}
    for row in table.values():
        for category in row:
            if category != "overall":
                seen.setdefault(category, None)
    return list(seen)


def _divergence_note(counts: dict | None) -> str:
    """' (n near-tie, m real)' after a greedy-equality rate below 1, when the divergences were classified."""
    if not counts or not (counts["near_ties"] or counts["real"]):
        return ""
    return f" ({counts['near_ties']} near-tie, {counts['real']} real)"


def _identical(overall: dict) -> bool:
    """Whether a T=0 row's token ids equal the baseline's on every question (the baseline's own row is not
    compared: it has no classified divergences)."""
    return overall.get("greedy_equal") == 1.0 and overall.get("greedy_divergences") is not None


def _row_label(label: str, settings: dict, temperature: str) -> str:
    """A method's row name; rows run with the lossy typical acceptance say so.

    At T=0 typical acceptance is greedy matching (exact), so only T > 0 rows are marked LOSSY.
    """
    spec = settings.get("methods", {}).get(label) or {}
    if not is_lossy(spec.get("options") or {}):
        return label
    exact = float(temperature) == 0
    return f"{label} (typical acceptance, {'exact at T=0' if exact else 'LOSSY'})"


def markdown(results: dict) -> str:
    settings, env = results["settings"], results.get("environment", {})
    lines = [
        f"# Benchmark: {settings['target']}",
        "",
        f"dtype {settings['dtype']}, weights {settings.get('weights', 'float32')}, device {settings['device']}, "
        f"{settings['threads']} threads, "
        f"max_new_tokens {settings['max_new_tokens']}, top_k {settings['top_k']}, top_p {settings['top_p']}, "
        f"seed {settings['seed']}; torch {env.get('torch', '?')}, transformers {env.get('transformers', '?')}.",
        f"Data: {', '.join(settings['data'])}"
        + (f" (categories {', '.join(settings['categories'])})" if settings.get("categories") else "")
        + (f", at most {settings['limit']} questions per category" if settings.get("limit") else "") + ".",
        "",
        "Cells are speedup over vanilla (ratio of mean per-question tokens/s) / τ (tokens per target forward; "
        "for `transformers` baselines counted from the target's forward calls, for llama.cpp rows from its draft "
        "counters).",
    ]
    turns = [t for r in results.get("records", []) for t in r["turns"]]
    cut = sum(1 for t in turns if t.get("cut_tokens"))
    if cut:
        lines += ["", f"{cut} of {len(turns)} prompt turns (all methods and temperatures) did not fit the context "
                      f"and kept their last {settings['max_prompt_tokens']} tokens."]
    if results.get("command"):
        lines += ["", f"Command: `{results['command']}`"]
    for temperature, table in results.get("aggregates", {}).items():
        categories = _categories(table)
        lines += ["", f"## Temperature {temperature}", ""]
        lines.append("| method | " + " | ".join(categories + ["overall"]) + " |")
        lines.append("|---" * (len(categories) + 2) + "|")
        for method, row in table.items():
            cells = []
            for category in categories + ["overall"]:
                s = row.get(category)
                cells.append("" if s is None else f"{_num(s['speedup'], '.2f', '×')} / {_num(s['tau'], '.2f')}")
            lines.append(f"| {_row_label(method, settings, temperature)} | " + " | ".join(cells) + " |")
        greedy = temperature in ("0", "0.0")
        best_hf = next((r["overall"].get("best_hf") for r in table.values() if r["overall"].get("best_hf")), None)
        lines += ["", f"Overall details at T={temperature}:", ""]
        depth_head = " | ".join(f"α{d}" for d in range(1, DEPTH_COLUMNS + 1))
        vs = f"vs {best_hf}" if best_hf else "vs best hf"
        lines.append(f"| method | questions | tokens/s | {vs} | " + ("greedy equal | " if greedy else "")
                     + f"α | {depth_head} | draft share | verify share | peak RSS MiB | repetition |")
        lines.append("|---" * (9 + DEPTH_COLUMNS + int(greedy)) + "|")
        for method, row in table.items():
            s = row["overall"]
            depth = list(s.get("acceptance_by_depth") or [])[:DEPTH_COLUMNS]
            depth += [None] * (DEPTH_COLUMNS - len(depth))
            cells = [str(s["questions"]), _num(s["tokens_per_s"], ".1f"), _num(s.get("vs_best_hf"), ".2f", "×")]
            if greedy:
                identical = " identical" if _identical(s) else ""
                cells.append(_num(s.get("greedy_equal"), ".2f") + identical
                             + _divergence_note(s.get("greedy_divergences")))
            cells += [_num(s["alpha"], ".2f")] + [_num(a, ".2f") for a in depth]
            cells += [_num(s["draft_share"], ".0%"), _num(s["verify_share"], ".0%"), _num(s["peak_rss_mb"], ".0f"),
                      _num(s["repetition"], ".2f")]
            lines.append(f"| {_row_label(method, settings, temperature)} | " + " | ".join(cells) + " |")
        unequal = [m for m, r in table.items() if greedy and r["overall"].get("greedy_equal") not in (None, 1.0)]
        real = [m for m in unequal if (table[m]["overall"].get("greedy_divergences") or {"real": 1})["real"]]
        if real:
            lines += ["", "**Greedy outputs differ from vanilla beyond floating-point near-ties for: "
                          f"{', '.join(real)}.** For our methods this is a bug to report; `transformers` "
                          "baselines can differ by floating-point rounding, llama.cpp rows also because llama.cpp "
                          "computes with quantized weights and activations where our target dequantizes."]
        identical = [m for m, r in table.items() if greedy and _identical(r["overall"])]
        if identical:
            lines += ["", f"Greedy outputs of {', '.join(identical)} are identical to vanilla's, token for token, on "
                          "every question."]
        if set(unequal) - set(real):
            lines += ["", f"Greedy outputs of {', '.join(m for m in unequal if m not in real)} differ from vanilla "
                          "only where the target's top two logits tie within the dtype's rounding noise (near-ties, "
                          "as `specula check` classifies them: allowed only where the verify pass is not "
                          "row-invariant, which the check probes on the target)."]
        lines += _context_lines(table, settings, temperature)
        lines += _llamacpp_lines(results.get("llamacpp", {}).get(temperature))
    lines += [
        "",
        "α: accepted over tried draft tokens; αd: acceptance rate at depth d of the draft (among cycles that "
        "accepted d−1 drafts and had a depth-d token to try). Repetition: share of repeated 4-grams in the output "
        "(high values mean looping text, which inflates τ). Peak RSS is the whole process (all models loaded); "
        f"loading the target added {results.get('target_load_rss_mb', '?')} MiB, each method: "
        + ", ".join(f"{k} {v} MiB" for k, v in results.get("method_load_rss_mb", {}).items()) + ".",
        "",
        "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS),
        "",
    ]
    return "\n".join(lines)


def _context_lines(table: dict, settings: dict, temperature: str) -> list[str]:
    """τ and tokens/s by the turn's prompt length, when the run's turns span more than one length bucket."""
    by_method = {m: r["overall"].get("by_context") or {} for m, r in table.items()}
    buckets = [label for _, _, label in CONTEXT_BUCKETS if any(label in b for b in by_method.values())]
    if len(buckets) < 2:
        return []
    lines = ["", f"By prompt length at T={temperature} (tokens of the conversation before each answer; cells τ / "
                 "tokens/s (turns), prefill included):", "",
             "| method | " + " | ".join(buckets) + " |", "|---" * (len(buckets) + 1) + "|"]
    for method, cells in by_method.items():
        if not cells:
            continue  # no cycles counted (a `transformers` baseline without a forward counter)
        row = [f"{_num(c['tau'], '.2f')} / {_num(c['tokens_per_s'], '.1f')} ({c['turns']})" if c else ""
               for c in (cells.get(label) for label in buckets)]
        lines.append(f"| {_row_label(method, settings, temperature)} | " + " | ".join(row) + " |")
    return lines


def _llamacpp_lines(table: dict | None) -> list[str]:
    """llama.cpp's own timings of its rows at one temperature (`specula.bench.llamacpp.server_table`)."""
    if not table:
        return []
    lines = ["", "llama.cpp's own timings (tokens/s above is new tokens over llama.cpp's prefill + decode time):", "",
             "| method | questions | decode tokens/s (llama.cpp) | tokens/s at the client (HTTP included) | "
             "drafted | accepted |", "|---|---|---|---|---|---|"]
    for method, row in table.items():
        lines.append(f"| {method} | {row['questions']} | {_num(row['decode_tokens_per_s'], '.1f')} | "
                     f"{_num(row['client_tokens_per_s'], '.1f')} | {row['draft_n'] or '–'} | "
                     f"{_num(row['draft_acceptance'], '.0%')} |")
    return lines


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup_tau(results: dict, path: Path) -> None:
    plt = _pyplot()
    aggregates = results.get("aggregates", {})
    rows = max(1, len(aggregates))
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.8 * rows), squeeze=False)
    for r, (temperature, table) in enumerate(aggregates.items()):
        categories = _categories(table) + ["overall"]
        methods = list(table)
        width = 0.8 / max(1, len(methods))
        for c, (metric, title) in enumerate((("speedup", "speedup over vanilla"), ("tau", "τ (tokens per cycle)"))):
            ax = axes[r][c]
            for i, method in enumerate(methods):
                values = [(table[method].get(cat) or {}).get(metric) for cat in categories]
                xs = [k + (i - (len(methods) - 1) / 2) * width for k in range(len(categories))]
                ax.bar(xs, [v or 0.0 for v in values], width, label=method)
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            ax.set_xticks(range(len(categories)))
            ax.set_xticklabels(categories, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{title}, T={temperature}", fontsize=10)
    if not aggregates:
        axes[0][0].text(0.5, 0.5, "no results", ha="center")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8, frameon=False)
    fig.suptitle(f"{results['settings']['target']} ({results['settings']['dtype']}, "
                 f"{results['settings'].get('weights', 'float32')} weights, "
                 f"{results['settings']['threads']} threads)")
    fig.tight_layout(rect=(0, 0.06 if handles else 0, 1, 1))
    _save_figure(fig, path)
    plt.close(fig)


DEPTH_VIEWS = (("acceptance_by_depth", "per cycle (n-α)"), ("node_acceptance_by_depth", "per tested draft token"))


def plot_acceptance_by_depth(results: dict, path: Path) -> None:
    plt = _pyplot()
    aggregates = results.get("aggregates", {})
    settings = results.get("settings", {})
    columns = max(1, len(aggregates))
    fig, axes = plt.subplots(len(DEPTH_VIEWS), columns, figsize=(6 * columns, 3.6 * len(DEPTH_VIEWS)),
                             squeeze=False)
    for c, (temperature, table) in enumerate(aggregates.items()):
        for r, (key, view) in enumerate(DEPTH_VIEWS):
            ax = axes[r][c]
            missing = []
            for method, row in table.items():
                rates = row["overall"].get(key)
                points = [(d + 1, a) for d, a in enumerate(rates or []) if a is not None]
                if not points:
                    missing.append(method)
                    continue
                ax.plot(*zip(*points, strict=True), marker="o", label=_row_label(method, settings, temperature))
            ax.set_ylim(0, 1.05)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.set_xlabel("depth in the draft (position)")
            ax.set_ylabel("acceptance rate")
            ax.set_title(f"acceptance by draft depth, {view}, T={temperature}", fontsize=10)
            if ax.lines:
                ax.legend(fontsize=7)
            if missing:
                ax.text(0.02, 0.02, "no per-depth data for: " + ", ".join(missing), transform=ax.transAxes,
                        fontsize=7, color="grey")
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def plot_calibration(results: dict, path: Path) -> None:
    plt = _pyplot()
    aggregates = results.get("aggregates", {})
    fig, axes = plt.subplots(1, max(1, len(aggregates)), figsize=(5.5 * max(1, len(aggregates)), 5), squeeze=False)
    for c, (temperature, table) in enumerate(aggregates.items()):
        ax = axes[0][c]
        ax.plot([0, 1], [0, 1], "r--", linewidth=1)
        missing = []
        for method, row in table.items():
            curve = [point for point in calibration_curve(row["overall"].get("calibration"))
                     if point[2] >= MIN_BIN_COUNT]
            if not curve:
                missing.append(method)
                continue
            xs, ys, _ = zip(*curve, strict=True)
            ax.plot(xs, ys, marker="o", label=_row_label(method, results.get("settings", {}), temperature))
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("draft confidence")
        ax.set_ylabel("acceptance rate")
        ax.set_title(f"draft calibration, T={temperature} (bins with >= {MIN_BIN_COUNT} tokens)", fontsize=10)
        if ax.lines[1:]:
            ax.legend(fontsize=7)
        if missing:
            ax.text(0.02, 0.95, "not available for: " + ", ".join(missing) + "\n(their drafts carry no confidences)",
                    transform=ax.transAxes, fontsize=7, color="grey", va="top")
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def write_report(results: dict, out: Path) -> list[Path]:
    out = Path(out)
    written = [out / "results.md"]
    atomic_write_text(written[0], markdown(results))
    for name, plot in zip(PLOTS, (plot_speedup_tau, plot_acceptance_by_depth, plot_calibration), strict=True):
        plot(results, out / name)
        written.append(out / name)
    return written


def _save_figure(fig, path: Path) -> None:
    """Write a figure atomically (the format follows ``path``'s suffix, not the temporary file's)."""
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format=Path(path).suffix.lstrip(".") or "png"))
