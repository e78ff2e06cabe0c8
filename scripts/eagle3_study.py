"""Reproduce EAGLE-3's two claims at our scale on pycoder-25m: the ablation (paper Table 2) and data scaling (Fig. 1).

Stages (run in order; each skips work already done, so an interrupted study resumes):

    .venv/bin/python scripts/eagle3_study.py train   # heads on 1x, 2x, 4x the data (+ the ablation head)
    .venv/bin/python scripts/eagle3_study.py bench   # one `specula bench` run over every head, T=0
    .venv/bin/python scripts/eagle3_study.py plot    # docs/eagle3/study.png and docs/eagle3/README.md table

(a) Ablation, all heads trained on the 4x data with the same schedule and decoded with the same dynamic tree:
    EAGLE head (feature regression, top-layer feature) decoded as eagle2;
    + remove the feature constraint: an EAGLE-3 head (training-time test) reading only the top-layer feature;
    + fused features: the EAGLE-3 head reading the inputs of layers 2, N//2, N-3.
(b) Scaling: τ of `eagle` (EAGLE head, decoded as eagle2) and `eagle3` heads trained on 1x, 2x and 4x the data.

Every head trains on the first N of the same regenerated samples (`--train-samples`, one cache) and is
evaluated on held-out prompts of ../shared/data/pycode/eval.jsonl (not used in training).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SPECULA = [sys.executable, "-m", "specula"]
RUNS = REPO / "runs" / "eagle3-study"
DOCS = REPO / "docs" / "eagle3"
DATA = REPO / "runs" / "pycode_train_1600.jsonl"  # head -1600 data/pycode_train_prompts.jsonl
CACHE = REPO / "runs" / "cache-pycoder"
TARGET = REPO.parent / "shared" / "models" / "pycoder-25m"
SIZES = {"1x": 200, "2x": 400, "4x": 800}
COMMON = ["--target", str(TARGET), "--data", str(DATA), "--cache-dir", str(CACHE), "--gen-max-new-tokens", "128",
          "--gen-batch-size", "32", "--eval-samples", "32", "--batch-size", "8", "--lr", "1e-3",
          "--warmup-steps", "50", "--save-every", "100", "--max-prompt-context", "128"]
TOP_LAYER = "12"  # pycoder-25m has 12 layers: id N is the final post-norm hidden state
# The tree every head drafts with: the CPU budget measured for eagle2 (specula/drafters/eagle.py).
TREE = {"total_tokens": 10, "depth": 5, "top_k": 2}


def heads(epochs: int) -> dict[str, list[str]]:
    """Run name -> `specula train` arguments."""
    runs = {}
    for size, count in SIZES.items():
        runs[f"eagle-{size}"] = ["eagle", "--train-samples", str(count), "--epochs", str(epochs)]
        runs[f"eagle3-{size}"] = ["eagle3", "--train-samples", str(count), "--epochs", str(epochs)]
    runs["eagle3-top-4x"] = ["eagle3", "--train-samples", str(SIZES["4x"]), "--epochs", str(epochs),
                             "--feature-layers", TOP_LAYER]
    return runs


def train(args: argparse.Namespace) -> None:
    for name, arguments in heads(args.epochs).items():
        out = RUNS / name
        if (out / "training_history.json").is_file():
            print(f"{name}: done", flush=True)
            continue
        command = SPECULA + ["train", arguments[0], *COMMON, "--out", str(out), *arguments[1:]]
        if (out / "checkpoint").is_dir():
            command.append("--resume")
        print(" ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=REPO)


def bench_config() -> str:
    lines = ["[bench]", f'target = "{TARGET}"', 'data = ["../shared/data/pycode/eval.jsonl"]', "limit = 20",
             "temperature = [0.0]", "max_new_tokens = 128", "seed = 0", 'dtype = "float32"', "threads = 2",
             f'out = "{DOCS / "bench"}"']
    labels = ["vanilla"]
    tables = []
    for name, arguments in heads(0).items():
        method = "eagle2" if arguments[0] == "eagle" else "eagle3"
        labels.append(name)
        tables += ["", f"[methods.{name}]", f'method = "{method}"', f'draft = "{RUNS / name}"']
        tables += [f"{key} = {value}" for key, value in TREE.items()]
    lines.insert(2, "methods = [" + ", ".join(f'"{label}"' for label in labels) + "]")
    return "\n".join(lines + tables) + "\n"


def bench(args: argparse.Namespace) -> None:
    RUNS.mkdir(parents=True, exist_ok=True)
    config = RUNS / "bench.toml"
    config.write_text(bench_config())
    subprocess.run(SPECULA + ["bench", "--config", str(config), "--no-profile"], check=True, cwd=REPO)


def final_eval(name: str) -> dict:
    history = json.loads((RUNS / name / "training_history.json").read_text())
    return [h["eval"] for h in history if "eval" in h][-1]


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads((DOCS / "bench" / "results.json").read_text())
    table = results["aggregates"]["0"]

    def overall(label: str) -> dict:
        return table[label]["overall"]

    ablation = [("EAGLE (eagle2 decoding)", "eagle-4x"), ("+ remove feature constraint", "eagle3-top-4x"),
                ("+ fused features (EAGLE-3)", "eagle3-4x")]
    sizes = list(SIZES)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(ablation))
    left.bar([x - 0.2 for x in xs], [overall(label)["tau"] for _, label in ablation], 0.4, label="τ")
    left.bar([x + 0.2 for x in xs], [overall(label)["speedup"] for _, label in ablation], 0.4, label="speedup")
    left.set_xticks(list(xs))
    left.set_xticklabels([name for name, _ in ablation], rotation=12, fontsize=8)
    left.set_title("(a) ablation, 4x data (800 samples)", fontsize=10)
    left.legend(fontsize=8)
    for kind in ("eagle", "eagle3"):
        right.plot([SIZES[s] for s in sizes], [overall(f"{kind}-{s}")["tau"] for s in sizes], marker="o",
                   label=kind)
    right.set_xscale("log", base=2)
    right.set_xticks([SIZES[s] for s in sizes])
    right.set_xticklabels([f"{s} ({SIZES[s]})" for s in sizes])
    right.set_xlabel("training samples")
    right.set_ylabel("τ (tokens per cycle)")
    right.set_title("(b) data scaling, pycode eval, T=0", fontsize=10)
    right.legend(fontsize=8)
    fig.suptitle("EAGLE-3 claims at pycoder-25m scale (same tree: 10 nodes, depth 5, top-k 2)", fontsize=10)
    fig.tight_layout()
    DOCS.mkdir(parents=True, exist_ok=True)
    fig.savefig(DOCS / "study.png", dpi=120)

    lines = ["| head | training samples | τ | speedup | held-out 0-α | 1-α | 2-α | 3-α |", "|---" * 8 + "|"]
    for name in heads(0):
        summary, evaluation = overall(name), final_eval(name)
        count = SIZES[name.rsplit("-", 1)[1]]
        lines.append(f"| {name} | {count} | {summary['tau']:.2f} | {summary['speedup']:.2f}× | "
                     + " | ".join(f"{evaluation[f'{n}-alpha']:.2f}" for n in range(4)) + " |")
    (DOCS / "study_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("train", "bench", "plot"))
    parser.add_argument("--epochs", type=int, default=3, help="epochs of every head (default: %(default)s)")
    args = parser.parse_args()
    {"train": train, "bench": bench, "plot": plot}[args.stage](args)


if __name__ == "__main__":
    main()
