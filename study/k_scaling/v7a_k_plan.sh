#!/usr/bin/env bash
# Study v7, part A at K 8 × 150 or K 32 × 38 rounds (study/k_scaling/v7.py; v6's token budget, ≈ 19.7 tokens per
# parameter at K 8, ≈ 20.0 at K 32): `bash study/k_scaling/v7a_k_plan.sh 8` (then 32). The grids are K 16's
# (v7a_plan.sh) narrowed around its picks: DiLoCo over the lr at μ 0.8 (and one point at μ 0.9) at a constant outer lr,
# warmed up + cosine and with a momentum warm-up at K 16's pick; norm_mean over lr × μ; IsoLoCo over lr at μ 0.8, at μ 0.9 and
# warmed up + cosine at its pick; DDP at 1× and 1.5× the inner lr. Then, each method at its own stage (`v7 jobs
# --stage next`), one seed-0 point past the edge of its best, seed 1 of its three best, seeds 0–4 at its pick by the
# mean of seeds 0–1. About 18 seed-0, 3–4 edge, 11 seed-1 and 12 final runs of ≈ 7–9 CPU-minutes each: ≈ 5.5 CPU-hours a K.
# Resumable and claimable like the other plans: run it in two processes.
source "$(dirname "$0")/../plan_env.sh"
K=${1:?usage: v7a_k_plan.sh K (8 or 32)}
case $K in
    8) STEPS=4500 EVERY=5 ;;
    32) STEPS=1140 EVERY=1 ;;
    *) echo "K must be 8 or 32 (K 16 is v7a_plan.sh)" >&2; exit 2 ;;
esac
O=study/k_scaling/results/v7_fixed_compute.jsonl
C="--cells $K:30 --batch 4 --steps $STEPS --eval-every $EVERY"
# by value: each method's K 16 pick and its neighbours first, DDP, then the schedules and the rest of each grid
$R $C --seeds 0 --lrs diloco=0.7@0.8,isoloco=3.2,ddp=-,norm_mean=0.5@0.8,diloco=0.5@0.8,diloco=1@0.8 --out $O
# DiLoCo's pick at K 16 is the momentum warm-up (1.0 @ 0.8 by seeds 0–1, then 0.7 @ 0.8): it runs second
$R $C --seeds 0 --outer-schedule momentum-warmup --lrs diloco=0.7@0.8,diloco=1@0.8 --out $O
$R $C --seeds 0 --lrs isoloco=2.4,isoloco=4.2,norm_mean=0.35@0.8,norm_mean=0.7@0.8 --out $O
$R $C --seeds 0 --inner-lr 0.0045 --lrs ddp=- --out $O
$R $C --seeds 0 --lrs isoloco=3.2@0.9,norm_mean=0.5@0.5 --out $O
$R $C --seeds 0 --outer-schedule warmup-cosine --lrs diloco=0.7@0.8,isoloco=3.2 --out $O
# DiLoCo at a constant lr off μ 0.8: μ 0.9 only. At K 16 every μ 0 and 0.5 point (0.7–2.0 @ 0, 0.7–1.4 @ 0.5, seed 0)
# scored 0.14 or more behind its pick (1.646), and at K 8 the best constant lr at μ 0.8 already trails the momentum
# warm-up's best by 0.05: the four runs here before (0.7 and 1 @ 0.5, 1 and 1.4 @ 0; ≈ 30 CPU-minutes a K) are cut.
$R $C --seeds 0 --lrs diloco=0.5@0.9 --out $O
source study/k_scaling/stages.sh  # plan_env.sh has made the repository root the working folder
v7_stages "$K" adamw
