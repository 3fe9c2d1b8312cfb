#!/usr/bin/env bash
# Study v5, part B: which merge of the K workers' deltas helps DiLoCo (the paper's comparison) at the v1/v2 cell
# (K 4, H 30, 4 × 64 bytes per worker step, the tiny model; v3's scoring). Each merge with the Nesterov outer step
# (μ 0.8, IsoLoCo's) and with outer SGD (μ 0), over 3 outer lrs at its official default options (merges/options.py);
# the spectral merges (TSV-M, Iso-CTS) around Iso-C's lrs, the sparse ones (TIES, DARE: 10 % dropped) around the
# mean's. Mean (DiLoCo, tuned at μ 0.9 / 0.5 / 0) and Iso-C with Nesterov (IsoLoCo) are v3's grids of this cell.
# Seed-0 picks are scored on seeds 1 and 2. Resumable and claimable as capacity/v5_plan.sh; a file named
# STOP in study/ ends a runner before its next run.
set -u
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
R="nice -n 15 python study/run_study.py --part v3 --cells 4:30"
O=study/merges/results/v5_merges.jsonl
NESTEROV=tsv=2.4,tsv=3.2,tsv=4.2,iso_cts=2.4,iso_cts=3.2,iso_cts=4.2,ties=0.35,ties=0.5,ties=0.7,dare=0.35,dare=0.5,dare=0.7
SGD=isoloco-sgd=2.0,isoloco-sgd=3.0,isoloco-sgd=4.2,tsv-sgd=2.0,tsv-sgd=3.0,tsv-sgd=4.2,iso_cts-sgd=2.0,iso_cts-sgd=3.0
SGD=$SGD,iso_cts-sgd=4.2,ties-sgd=0.5,ties-sgd=0.7,ties-sgd=1.0,dare-sgd=0.5,dare-sgd=0.7,dare-sgd=1.0
$R --seeds 0 --lrs $NESTEROV --out $O
$R --seeds 1,2 --lrs best:tsv,iso_cts,ties,dare --out $O
$R --seeds 0 --lrs $SGD --out $O
$R --seeds 1,2 --lrs best:isoloco-sgd,tsv-sgd,iso_cts-sgd,ties-sgd,dare-sgd --out $O
# one point past each seed-0 optimum on its grid's edge (tsv, iso_cts 2.4 low; ties, dare 0.35 low; isoloco-sgd and
# iso_cts-sgd 4.2 high; ties-sgd 0.5 low), then seeds 1 and 2 of the best again (nothing reruns where the edge loses)
$R --seeds 0 --lrs tsv=1.8,iso_cts=1.8,ties=0.25,dare=0.25,isoloco-sgd=5.6,iso_cts-sgd=5.6,ties-sgd=0.35 --out $O
$R --seeds 1,2 --lrs best:tsv,iso_cts,ties,dare,isoloco-sgd,tsv-sgd,iso_cts-sgd,ties-sgd,dare-sgd --out $O
# a second point past the optima still on an edge after the first (tsv, iso_cts 1.8 low; ties 0.25 low;
# isoloco-sgd, iso_cts-sgd 5.6 high), then seeds 1 and 2 of the best again; what stays on an edge is reported so
$R --seeds 0 --lrs tsv=1.2,iso_cts=1.2,ties=0.18,isoloco-sgd=7.5,iso_cts-sgd=7.5 --out $O
$R --seeds 1,2 --lrs best:tsv,iso_cts,ties,isoloco-sgd,iso_cts-sgd --out $O
