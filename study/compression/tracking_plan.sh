#!/usr/bin/env bash
# The base cell (K 4, H 30, 4 × 64, 10 rounds; each method at its uncompressed v3 pick, DiLoCo 0.7 @ 0, IsoLoCo 3.2
# @ 0.8, as compress_v2_plan.sh; ≈ 0.5 CPU-minutes a run), 3 paired seeds: tracking (feedback "ef21": each worker
# sends the correction to its tracked estimate of its Δ, the owner merges its tracked estimate of the mean) with
# stat2:256 at β 1 and 0.9 and with int2:128 at β 1; and stat2:256 without feedback keeping the norm gains (skip
# vectors: 0.079× an fp32 all-reduce) or the norm gains and the two vocabulary matrices (0.209×) in full
# precision. The fp32 and stat2:256 runs beside them are compress_v2_plan.sh's. Resumable and claimable.
source "$(dirname "$0")/../plan_env.sh"
O=study/compression/results/compress_v2.jsonl
C="--cells 4:30 --batch 4 --steps 300 --seeds 0,1,2 --lrs diloco=0.7@0,isoloco=3.2 --out $O"
for spec in stat2:256:1:nearest:ef21 stat2:256:0.9:nearest:ef21 int2:128:1:nearest:ef21 stat2:256:none:skip=vectors stat2:256:none:skip=vectors+vocab=256; do
    $R $C --compress $spec
done
