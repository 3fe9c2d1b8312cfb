#!/usr/bin/env bash
# Study v5, part A at K 8: the 32 × 64 cell (the tokens per step of 16 × 128 at 64-byte sequences) with 8 workers, as
# v3 ran its batch cells at K 4 and 8. Tuned as study/capacity/v5_plan.sh, around v3's K-8 optima at batch 16 (DiLoCo 1.0 @ 0.5,
# IsoLoCo 3.2 @ 0.8): seed-0 picks on the selection split, seeds 1 and 2 of each method's best, test loss. Resumable and
# claimable like the other plans (study/.claims; a file named STOP in study/ ends a runner before its next run).
source "$(dirname "$0")/../plan_env.sh"
O=study/capacity/results
A1K8="--cells 8:30 --batch 32"
GRID=diloco=0.7@0.5,diloco=1.0@0.5,diloco=1.4@0.5,isoloco=2.4,isoloco=3.2,isoloco=4.2,ddp=-
$R $A1K8 --seeds 0 --lrs $GRID --out $O/v5_tokens_k8.jsonl
$R $A1K8 --seeds 1,2 --lrs $BEST --out $O/v5_tokens_k8.jsonl
