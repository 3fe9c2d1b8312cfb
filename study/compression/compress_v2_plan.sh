#!/usr/bin/env bash
# Compression v2: the statistical 2- and 4-bit formats (stat2 per block of 256, stat4 per block of 1024: the
# entries centred, binned equal-width over ±kσ, each bin decoded to the mean of its entries, the centroid table on the
# wire; 0.078× and 0.141× an fp32 all-reduce's bytes on this model) and stochastic rounding, against today's int2 and
# int4 (compress_plan.sh), each with error feedback on each worker's Δ (the default
# placement) at β 0.95 and 0.8, and without. First the cheap base cell (K 4, H 30, 4 × 64, 10 rounds: each method at
# its uncompressed v3 pick, DiLoCo 0.7 @ 0, IsoLoCo 3.2 @ 0.8; ≈ 0.5 CPU-minutes a run), 3 paired seeds. Then the cell
# where the gain lives (K 16 × 75 rounds, each method at its v7 pick so far; ≈ 7 CPU-minutes a run) for fp32 (v6/v7's
# runs), int2 and stat2 at the base cell's best β. Resumable and claimable: run it in two processes.
source "$(dirname "$0")/../plan_env.sh"
O=study/compression/results/compress_v2.jsonl
C="--cells 4:30 --batch 4 --steps 300 --seeds 0,1,2 --lrs diloco=0.7@0,isoloco=3.2 --out $O"
for spec in stat2:256:0.95 stat2:256:0.8 stat2:256:none stat4:1024:0.95 int2:128:0.95:stochastic int2:128:0.8; do
    $R $C --compress $spec
done
C="--cells 16:30 --batch 4 --steps 2250 --eval-every 2 --seeds 0,1,2 --lrs diloco=0.7@0.8,isoloco=3.2 --out $O"
for spec in stat2:256:none int2:128:0.95:nearest:workers; do
    $R $C --compress $spec
done
# the 2-bit winner at the base cell on seeds 3 and 4, with its fp32 and today's int2 (worker feedback) beside it
C="--cells 4:30 --batch 4 --steps 300 --seeds 3,4 --lrs diloco=0.7@0,isoloco=3.2 --out $O"
$R $C
for spec in stat2:256:none int2:128:0.95:nearest:workers; do
    $R $C --compress $spec
done
