#!/usr/bin/env bash
# Study v7, part A at K 16 (study/k_scaling/v7.py): v6's token budget as K 16 × 75 rounds, each method tuned there.
# v6's K 16 runs (v6c_plan.sh: DiLoCo lr × μ ∈ {0, 0.8, 0.9} at a constant outer lr, IsoLoCo 2.4–5.6 @ 0.8, DDP at
# the base inner lr) count as this screen's seed 0 where they match; this plan adds, seed 0: DiLoCo at μ 0.5 and
# 1.7 @ 0 (between v6's 1.4 and 2.0), DiLoCo warmed up + cosine around v6's picks and a momentum warm-up at its pick,
# the norm-preserving merge (norm_mean, outer Nesterov) over lr × μ, IsoLoCo warmed up + cosine and at μ 0.9, DDP at
# 1.5× and 2× the inner lr. Then one seed-0 point past the edge of each method's best, seed 1 of each method's three best, then seeds 0–4 at the pick by the mean of seeds
# 0–1 (v7.py `jobs`). Most valuable first: the schedule that removes DiLoCo's mid-run dip, then the step-size
# control. Resumable and claimable like the other plans: run it in two processes.
source "$(dirname "$0")/../plan_env.sh"
O=study/k_scaling/results/v7_fixed_compute.jsonl
C="--cells 16:30 --batch 4 --steps 2250 --eval-every 2"
$R $C --seeds 0 --outer-schedule warmup-cosine --lrs diloco=0.7@0.8,diloco=1@0.8,diloco=0.5@0.9 --out $O
$R $C --seeds 0 --lrs diloco=0.7@0.5,diloco=1@0.5,diloco=1.4@0.5 --out $O
$R $C --seeds 0 --inner-lr 0.0045 --lrs ddp=- --out $O
$R $C --seeds 0 --inner-lr 0.006 --lrs ddp=- --out $O
$R $C --seeds 0 --outer-schedule warmup-cosine --lrs isoloco=3.2,isoloco=4.2 --out $O
# norm_mean's step is the workers' mean norm (≈ 1/0.64 of the mean's at K 16): at 0.7 and 1.0 @ 0.8 it was far behind
# DiLoCo (1.905, 2.216), so its grid goes down from 0.7, not up
$R $C --seeds 0 --lrs norm_mean=0.7@0.8,norm_mean=1@0.8,norm_mean=0.5@0.8,norm_mean=0.35@0.8 --out $O
$R $C --seeds 0 --lrs norm_mean=0.5@0.5,norm_mean=0.7@0.5,norm_mean=1@0 --out $O
$R $C --seeds 0 --lrs isoloco=3.2@0.9,diloco=1.7@0 --out $O
$R $C --seeds 0 --outer-schedule warmup-cosine --lrs diloco=0.7@0.9,diloco=1.4@0 --out $O
$R $C --seeds 0 --outer-schedule momentum-warmup --lrs diloco=0.7@0.8 --out $O
source study/k_scaling/stages.sh  # plan_env.sh has made the repository root the working folder
v7_stages 16 adamw
