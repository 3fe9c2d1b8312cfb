#!/usr/bin/env bash
# Study v6, part B: outer schedules at the horizon (after part A: study/horizon/v6a_plan.sh). Each method at its part-A pick
# (best: reads the constant-schedule grid of the 300-round cell; scheduled runs never join that grid), 3 seeds:
#   warmup          the outer lr linear over the first 5 % of rounds (15 of 300)
#   warmup-cosine   that, then a cosine decay of the outer lr to 0.1× (and, seed 0, a step or two above each pick)
#   momentum-warmup DiLoCo's μ linear from 0 over the first 15 rounds (through μ = 0: SGD's semantics)
# and IsoLoCo at 10 rounds (v3's base cell pick) with a 2-round warm-up: does the first-round overshoot go?
# The cheap 10-round cells first. Resumable and claimable like the other plans: run it in two processes.
source "$(dirname "$0")/../plan_env.sh"
O=study/horizon/results
A="--cells 4:30 --batch 4 --steps 9000 --eval-every 10"
S=$O/v6_schedules.jsonl
# 10 rounds scored after every round: both methods at their v3 picks as they are, then IsoLoCo warmed up
$R --cells 4:30 --batch 4 --steps 300 --eval-every 1 --seeds 0,1,2 --lrs best:isoloco,diloco --out $S
$R --cells 4:30 --batch 4 --steps 300 --eval-every 1 --seeds 0,1,2 --lrs best:isoloco --outer-schedule warmup --out $S
$R $A --seeds 0,1,2 --lrs best:isoloco,diloco --outer-schedule warmup --out $S
$R $A --seeds 0,1,2 --lrs best:isoloco,diloco --outer-schedule warmup-cosine --out $S
# the cosine's own lr: a decaying schedule may want a higher peak than the constant pick (seed 0, selection split)
$R $A --seeds 0 --lrs diloco=0.7@0.8,diloco=1.0@0.8,isoloco=4.2 --outer-schedule warmup-cosine --out $S
$R $A --seeds 0,1,2 --lrs best:diloco --outer-schedule momentum-warmup --out $S
