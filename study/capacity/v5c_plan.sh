#!/usr/bin/env bash
# Study v5, part C: depth. The `small` preset (d 256, 6 layers: ~13× the tiny model's block weights) at the v1/v2
# cell (K 4, H 30, 4 × 64 bytes per worker step; v3's scoring), each method tuned cheaply around its v3 optimum
# there (DiLoCo μ 0: lr 0.5 / 0.7 / 1.0; IsoLoCo μ 0.8: lr 2.4 / 3.2 / 4.2), seed-0 picks scored on seeds 1 and 2,
# with the data-matched DDP baseline. Resumable and claimable as v5_plan.sh.
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
R="nice -n 15 python study/run_study.py --part v3 --cells 4:30 --model small"
O=study/capacity/results/v5_depth.jsonl
$R --seeds 0 --lrs diloco=0.5@0,diloco=0.7@0,diloco=1.0@0,isoloco=2.4,isoloco=3.2,isoloco=4.2,ddp=- --out $O
$R --seeds 1,2 --lrs best:diloco,isoloco,ddp --out $O
# one point past DiLoCo's seed-0 optimum on its grid's edge (1.0 @ 0, high), then seeds 1 and 2 of the best again
$R --seeds 0 --lrs diloco=1.4@0 --out $O
$R --seeds 1,2 --lrs best:diloco,isoloco,ddp --out $O
