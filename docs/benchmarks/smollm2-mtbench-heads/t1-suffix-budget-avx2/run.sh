#!/usr/bin/env bash
# Does a shorter or stricter suffix draft pay at T=1 on this AVX2 machine? 3 MT-bench questions per category.
cd "$(dirname "$0")/../../../.."  # the repository root
.venv/bin/specula bench --target SmolLM2-135M-Instruct --data ../shared/data/mt_bench/question.jsonl --limit 3 \
  --temperature 1 --max-new-tokens 128 --seed 0 --weights q4_1 --threads 1 --no-profile \
  --methods vanilla,suffix,suffix-n1,suffix-n2,suffix-p5 \
  --option suffix-n1.method=suffix --option suffix-n1.num_tokens=1 \
  --option suffix-n2.method=suffix --option suffix-n2.num_tokens=2 \
  --option suffix-p5.method=suffix --option suffix-p5.min_prob=0.5 \
  --out docs/benchmarks/smollm2-mtbench-heads/t1-suffix-budget-avx2
