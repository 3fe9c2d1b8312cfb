#!/usr/bin/env bash
# Study v5, part A: at 16 × 128 tokens per worker step IsoLoCo's gain over a tuned DiLoCo vanished (v3) while it held
# at 16 × 64 and at K 32. Which of the three changed it: the tokens per step, the sequence length, or a tiny model
# saturating? Two cells at K 4, H 30 (v3's scoring: 1,024 windows per split, seed-0 picks, seeds 1 and 2 of each
# method's best), each method tuned cheaply around its v3 optimum at its v3 momentum (DiLoCo μ 0.5, IsoLoCo μ 0.8):
#   A1  32 × 64 bytes: the tokens per step of 16 × 128 at v1/v2's sequence length (v3 started it and cut it);
#   A2  16 × 128 with the tiny-wide model (d 256: ~4× the block weights): capacity at the cell that lost the gain.
# Part B (the paper's merges, `--merge`) and C follow in a later plan. Finished runs are skipped and jobs are
# claimed (study/.claims), so the plan resumes where it stopped and may run in two processes; a file named STOP in
# study/ ends a runner before its next run.
source "$(dirname "$0")/../plan_env.sh"
O=study/capacity/results
A1="--cells 4:30 --batch 32"
A2="--cells 4:30 --batch 16 --seq-len 128 --model tiny-wide"
GRID=diloco=0.7@0.5,diloco=1.0@0.5,diloco=1.4@0.5,isoloco=1.8,isoloco=2.4,isoloco=3.2,ddp=-
$R $A1 --seeds 0 --lrs $GRID --out $O/v5_tokens.jsonl
$R $A1 --seeds 1,2 --lrs $BEST --out $O/v5_tokens.jsonl
$R $A2 --seeds 0 --lrs $GRID --out $O/v5_capacity.jsonl
$R $A2 --seeds 1,2 --lrs $BEST --out $O/v5_capacity.jsonl
# one point past each A1 seed-0 optimum that sat on its grid's edge (DiLoCo 0.7 @ 0.5 low, IsoLoCo 3.2 high), then
# seeds 1 and 2 of the best again (the same configs when the edges lose: nothing reruns)
$R $A1 --seeds 0 --lrs diloco=0.5@0.5,isoloco=4.2 --out $O/v5_tokens.jsonl
$R $A1 --seeds 1,2 --lrs $BEST --out $O/v5_tokens.jsonl
# one point past each A2 seed-0 optimum on its grid's edge (DiLoCo 0.7 @ 0.5 low, IsoLoCo 3.2 high), then seeds 1 and 2
$R $A2 --seeds 0 --lrs diloco=0.5@0.5,isoloco=4.2 --out $O/v5_capacity.jsonl
$R $A2 --seeds 1,2 --lrs $BEST --out $O/v5_capacity.jsonl
