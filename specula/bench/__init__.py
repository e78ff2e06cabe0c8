"""Measurements: Spec-Bench-style runs (`specula bench`), the theory of α, γ and c (`specula calibrate`).

questions  question sets (turns / prompt / text JSONL, .gz), categories, --limit
config     TOML/JSON bench configs, method labels and options, the transformers baselines
runners    one timed generation per method: our decode loop or transformers generate
metrics    tokens/s, speedup (ratio of means), τ, acceptance by depth, greedy equality (pure functions)
suite      the interleaved run, results.json and resume
report     results.md and the plots
theory     the lecture's formulas and the tree-budget model
calibrate  measuring α, c and verification cost; predictions; hardware profiles (profile)
cli        add_bench_parser / add_calibrate_parser for `specula`
"""
