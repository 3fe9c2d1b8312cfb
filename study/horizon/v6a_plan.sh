#!/usr/bin/env bash
# Study v6, part A: the horizon. The base cell (tiny preset, 467,584 parameters; K 4, H 30, 4 × 64 bytes per worker
# step, AdamW inner) for 9,000 inner steps per worker = 300 outer rounds = 9,216,000 tokens ≈ 19.7 tokens per
# parameter (30,720 tokens a round), the length compute-optimal runs train to. Tuned at this horizon, around v3's
# 10-round optima (DiLoCo 0.7 @ 0, IsoLoCo 3.2 @ 0.8): DiLoCo over lr × μ ∈ {0, 0.5, 0.8}, IsoLoCo over four lrs at
# μ 0.8, DDP at the same tokens; both held-out splits scored every 10 rounds. Seed-0 picks on the selection split,
# seeds 1 and 2 of each method's best, test loss. Resumable and claimable like the other plans (study/.claims; a
# file named STOP in study/ ends a runner before its next run): run it in two processes.
source "$(dirname "$0")/../plan_env.sh"
O=study/horizon/results
A="--cells 4:30 --batch 4 --steps 9000 --eval-every 10"
# by value: the v3 picks and DDP first, then the rest of each grid
GRID=ddp=-,diloco=0.7@0,isoloco=3.2,diloco=0.5@0.5,isoloco=2.4,diloco=0.2@0.8,diloco=1.0@0,isoloco=4.2
GRID=$GRID,diloco=0.35@0.5,diloco=0.7@0.5,diloco=0.35@0.8,diloco=0.5@0
# past DiLoCo's μ 0.8 edge (0.35 @ 0.8 led the seed-0 grid from its top). Both picks are interior with these
# (DiLoCo 0.5 @ 0.8 between 0.35 and 0.7; IsoLoCo 3.2 between 2.4 and 4.2), so the far ends (isoloco=1.8,
# diloco=0.14@0.8, ~16 CPU-minutes) were cut.
GRID=$GRID,diloco=0.5@0.8,diloco=0.7@0.8
$R $A --seeds 0 --lrs $GRID --out $O/v6_horizon.jsonl
$R $A --seeds 1,2 --lrs $BEST --out $O/v6_horizon.jsonl
