#!/usr/bin/env bash
# Workers as they really arrive (study/arrival/arrival.py): IsoLoCo and DiLoCo, each at its pick, with
#   drop 0.25            every round a random 25 % of the K workers miss (weight 0; drawn from the seed, the same
#                        draw for both methods)
#   faulty 10            worker 0's Δ × 10 every round (a faulty worker), unclipped
#   faulty 10 + median   the same, each worker's Δ clipped per tensor to the median of the workers' norms
# 3 paired seeds each. A first look at K 16 × 10 rounds (v3's cell; picks DiLoCo 1.0 @ 0, IsoLoCo 4.2 @ 0.8;
# ≈ 2 CPU-minutes a run), then the cell where the gain lives, K 16 × 75 rounds at v6's token budget (each method at
# its pick there so far, DiLoCo 0.7 @ 0.8, IsoLoCo 3.2 @ 0.8: rerun at v7's picks if they move; ≈ 7 CPU-minutes a
# run). The clean runs (every worker delivering) are v3's and v6/v7's. Resumable and claimable: run it in two processes.
source "$(dirname "$0")/../plan_env.sh"
O=study/arrival/results/arrival.jsonl
for cell in "300 diloco=1@0,isoloco=4.2" "2250 diloco=0.7@0.8,isoloco=3.2 --eval-every 2"; do
    set -- $cell
    C="--cells 16:30 --batch 4 --steps $1 --seeds 0,1,2 --lrs $2 ${*:3} --out $O"
    $R $C --drop 0.25
    $R $C --faulty 10
    $R $C --faulty 10 --merge-clip median
done
