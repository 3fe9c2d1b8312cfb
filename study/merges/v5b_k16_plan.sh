#!/usr/bin/env bash
# Study v5, part B at K 16: the two best merges of part B besides the mean (Iso-C and Iso-CTS, both with the
# Nesterov outer step) against DiLoCo, each tuned cheaply around its K 4 optimum (DiLoCo μ 0: lr 0.5 / 0.7 / 1.0;
# Iso-C μ 0.8: 2.4 / 3.2 / 4.2; Iso-CTS μ 0.8: 1.2 / 1.8 / 2.4), v3's scoring, seed-0 picks on seeds 1 and 2.
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
R="nice -n 15 python study/run_study.py --part v3 --cells 16:30"
O=study/merges/results/v5_merges_k16.jsonl
$R --seeds 0 --lrs diloco=0.5@0,diloco=0.7@0,diloco=1.0@0,isoloco=2.4,isoloco=3.2,isoloco=4.2 --out $O
$R --seeds 0 --lrs iso_cts=1.2,iso_cts=1.8,iso_cts=2.4 --out $O
$R --seeds 1,2 --lrs best:diloco,isoloco,iso_cts --out $O
# one point past each seed-0 optimum on its grid's top edge (DiLoCo 1.0 @ 0, Iso-C 4.2, Iso-CTS 2.4), then seeds 1
# and 2 of the best again
$R --seeds 0 --lrs diloco=1.4@0,isoloco=5.6,iso_cts=3.2 --out $O
$R --seeds 1,2 --lrs best:diloco,isoloco,iso_cts --out $O
