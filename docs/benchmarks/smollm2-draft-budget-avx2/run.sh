#!/usr/bin/env bash
# The single-stream draft budget (the default) against the same methods with --draft-budget off: 3 MT-bench
# questions per category, both turns, q4_1, one thread. Usage: run.sh T   (T = 0 or 1)
cd "$(dirname "$0")/../../.."  # the repository root
T=${1:-1}
.venv/bin/specula bench --target SmolLM2-135M-Instruct --data ../shared/data/mt_bench/question.jsonl --limit 3 \
  --temperature "$T" --max-new-tokens 128 --seed 0 --weights q4_1 --threads 1 --no-profile \
  --methods vanilla,suffix,suffix-off,suffix-n1,eagle3,eagle3-off \
  --option suffix-off.method=suffix --option suffix-off.draft_budget=off \
  --option suffix-n1.method=suffix --option suffix-n1.num_tokens=1 --option suffix-n1.draft_budget=off \
  --option eagle3-off.method=eagle3 --option eagle3-off.draft_budget=off \
  --out "docs/benchmarks/smollm2-draft-budget-avx2/t$T-$(git rev-parse --short HEAD)"
