#!/bin/bash
# Speed cost of row invariance: the same bench with our invariant kernels (default) and with them off
# (SPECULA_FLOAT32_KERNEL=0: MKL; SPECULA_ATTENTION_KERNEL=0: SDPA), alternating, on an otherwise idle machine.
cd "$(dirname "$0")/.."

mkdir -p runs/invariance-cost
for rep in 1; do
  for fmt in float32 q4_1; do
    for inv in on off; do
      if [ $inv = off ]; then E="SPECULA_FLOAT32_KERNEL=0 SPECULA_ATTENTION_KERNEL=0"; else E=""; fi
      env $E .venv/bin/specula bench --methods vanilla,eagle3 --weights $fmt --threads 1 \
        --limit 1 --max-new-tokens 128 --out runs/invariance-cost/$fmt-$inv-$rep --no-progress > runs/invariance-cost/$fmt-$inv-$rep.log 2>&1
      echo "$(date +%T) $fmt $inv $rep rc=$?"
    done
  done
done
