#!/usr/bin/env bash
# Study v6, part C: K at fixed compute. Part A's token budget (9,216,000 tokens, ≈ 19.7 per parameter) split over
# K workers: K 16 / 2 / 8 (the order of value) at 75 / 600 / 150 rounds of H 30 (2,250 / 18,000 / 4,500 inner steps
# per worker), fewer synchronizations at larger K. Each method tuned cheaply: 3 lrs around v3's optimum at that K
# (DiLoCo at μ 0.5 or 0 as v3 found, IsoLoCo at μ 0.8), DDP at the same tokens, seed-0 picks, seeds 1 and 2 of the
# picks; one point past a pick on its grid's edge is added by hand after the seed-0 grid. DiLoCo also at μ 0.8 (0.5 and
# 0.7), where part A found its optimum at this token budget: K 16's μ-0 grid fell monotonically to its edge (seed 0,
# selection 1.95 / 1.86 / 1.79 at lr 0.7 / 1.0 / 1.4), far behind IsoLoCo (1.52); at μ 0.8 it fell to its edge too
# (1.76 / 1.71 at 0.5 / 0.7), so 1.0 and 1.4 @ 0.8 follow; with the pick at μ 0.8, the top of the μ grid, 0.35 and 0.5 @ 0.9
# (the same and a higher lr / (1 − μ)) follow too, then 0.7 @ 0.9 (the official DiLoCo config). Resumable and claimable.
source "$(dirname "$0")/../plan_env.sh"
O=study/k_scaling/results/v6_fixed_compute.jsonl
for cell in "16:30 2250 diloco=0.7@0,diloco=1.0@0,diloco=1.4@0,isoloco=3.2,isoloco=4.2,isoloco=5.6,ddp=-,diloco=2.0@0,diloco=0.5@0.8,diloco=0.7@0.8,isoloco=2.4,diloco=1.0@0.8,diloco=1.4@0.8,diloco=0.35@0.9,diloco=0.5@0.9,diloco=0.7@0.9" \
            "2:30 18000 diloco=0.5@0.5,diloco=0.7@0.5,diloco=1.0@0.5,isoloco=1.8,isoloco=2.4,isoloco=3.2,ddp=-,diloco=0.5@0.8" \
            "8:30 4500 diloco=0.7@0.5,diloco=1.0@0.5,diloco=1.4@0.5,isoloco=2.4,isoloco=3.2,isoloco=4.2,ddp=-,diloco=0.5@0.8"; do
    set -- $cell
    C="--cells $1 --batch 4 --steps $2 --eval-every $(( $2 / 30 / 30 > 0 ? $2 / 30 / 30 : 1 ))"
    $R $C --seeds 0 --lrs "$3" --out $O
    $R $C --seeds 1,2 --lrs $BEST --out $O
done
