#!/usr/bin/env bash
# The cell where the gain lives, K 16 × 75 rounds (v6's token budget; each method at its pick there so far, DiLoCo
# 0.7 @ 0.8, IsoLoCo 3.2 @ 0.8; ≈ 7 CPU-minutes a run), 3 paired seeds, IsoLoCo and DiLoCo at 2 bits: stat2:256
# without feedback (the base cell's best 2-bit spec for IsoLoCo) and with tracking (feedback "ef21", β 1). The fp32
# runs beside them are v6/v7's. Then, for the loss-against-bits plot at this cell, today's 2-bit default (int2:128,
# feedback on each worker's Δ at β 0.95) and 4 bits without feedback (int4:128, free at the base cell). It replaces
# compress_v2_plan.sh's K 16 loop. Resumable and claimable (two runners: 21 runs, ≈ 2.5–3.5 CPU-hours).
source "$(dirname "$0")/../plan_env.sh"
O=study/compression/results/compress_v2.jsonl
C="--cells 16:30 --batch 4 --steps 2250 --eval-every 2 --seeds 0,1,2 --lrs diloco=0.7@0.8,isoloco=3.2 --out $O"
for spec in stat2:256:none stat2:256:1:nearest:ef21 int2:128:0.95:nearest:workers int4:128:none; do
    $R $C --compress $spec
done
