#!/usr/bin/env bash
# Compressed exchange: does IsoLoCo's gain over DiLoCo survive 8-, 4- and 2-bit pseudo-gradients?
# The v1/v2 cell as v3 runs it (tiny preset, K 4, H 30, 4 × 64 bytes per worker step, AdamW inner, 10 outer rounds =
# 300 inner steps per worker, ≈ 0.66 tokens per parameter), each method at its tuned uncompressed config from study
# v3 (DiLoCo 0.7 @ μ 0, IsoLoCo 3.2 @ μ 0.8; their uncompressed runs are v3_base.jsonl's), every worker's Δ and the
# owners' update sent blockwise (128 entries per float32 scale, round to nearest) as int8, int4, fp4 or int2 (ternary),
# each with error feedback (β 0.95, on both legs: ":nearest:both") and without, 3 paired seeds. The 2-bit cells are
# retuned over three outer lrs (study/compression/compression.py picks by v3's rule: the lowest mean selection loss over the
# seeds). Resumable and claimable: run it in two processes.
source "$(dirname "$0")/../plan_env.sh"
O=study/compression/results
C="--cells 4:30 --batch 4 --steps 300"
S=$O/compress.jsonl
B=:nearest:both  # error feedback on both legs (each worker's Δ and the owners' update); the library's default since
#                 these cells is each worker's Δ only (the placement cells below are why)
for spec in int2:128:0.95$B int2:128:none int4:128:0.95$B int4:128:none int8:128:0.95$B int8:128:none \
            fp4:128:0.95$B fp4:128:none; do
    $R $C --seeds 0,1,2 --lrs diloco=0.7@0,isoloco=3.2 --compress $spec --out $S
done
for spec in int2:128:0.95$B int2:128:none; do  # the 2-bit retune: one lr below and one above each pick
    $R $C --seeds 0,1,2 --lrs diloco=0.5@0,diloco=1.0@0,isoloco=2.4,isoloco=4.2 --compress $spec --out $S
done
# where error feedback runs, at 2 bits (Compression.feedback): each worker's Δ only, the owner's update only, and
# both legs at β 0.8; each method at its uncompressed pick
for spec in int2:128:0.95:nearest:workers int2:128:0.95:nearest:owner int2:128:0.8$B; do
    $R $C --seeds 0,1,2 --lrs diloco=0.7@0,isoloco=3.2 --compress $spec --out $S
done
# IsoLoCo's 2-bit picks sat on the grid's lower edge (2.4): one lr past it, and the placement that kept its loss
# (each worker's Δ only) retuned over the same lrs and at β 0.8
for spec in int2:128:none int2:128:0.95$B int2:128:0.95:nearest:workers; do
    $R $C --seeds 0,1,2 --lrs isoloco=1.8,isoloco=2.4 --compress $spec --out $S
done
$R $C --seeds 0,1,2 --lrs isoloco=2.4,isoloco=3.2,diloco=0.7@0 --compress int2:128:0.8:nearest:workers --out $S
# the worker-only placement's picks on their grids' lower edges: one lr past each
$R $C --seeds 0,1,2 --lrs isoloco=1.2 --compress int2:128:0.95:nearest:workers --out $S
$R $C --seeds 0,1,2 --lrs isoloco=1.8 --compress int2:128:0.8:nearest:workers --out $S
