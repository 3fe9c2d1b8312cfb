#!/usr/bin/env bash
# Study v7, part D: Muon inner steps at K 16 × 75 rounds (v6's token budget): MuLoCo (DiLoCo over Muon inner steps)
# against Muon-inner IsoLoCo, each tuned by part A's rule around v3's Muon picks at K 16 after 10 rounds (DiLoCo
# 1.0 @ 0.5, IsoLoCo 2.4 @ 0.8), DDP with Muon at the same tokens. Seed 0 over DiLoCo's lr × μ ∈ {0, 0.5, 0.8} and
# IsoLoCo's lr, then one point past each best's edge, seed 1 of each method's three best, seeds 0–4 at the pick by
# the mean of seeds 0–1 (`v7 jobs --inner muon`). About 11 seed-0, 2 edge, 6 seed-1 and 8 final runs of ≈ 8
# CPU-minutes: ≈ 3.5 CPU-hours. Run after part A at K 16. Resumable and claimable: run it in two processes.
source "$(dirname "$0")/../plan_env.sh"
O=study/k_scaling/results/v7_muon.jsonl
C="--cells 16:30 --batch 4 --steps 2250 --eval-every 2 --inner muon"
$R $C --seeds 0 --lrs diloco=1@0.5,isoloco=2.4,ddp=-,diloco=0.7@0.5,diloco=1.4@0.5,isoloco=1.8,isoloco=3.2 --out $O
$R $C --seeds 0 --lrs diloco=0.7@0.8,diloco=1@0.8,diloco=1.4@0,diloco=2@0 --out $O
source study/k_scaling/stages.sh  # plan_env.sh has made the repository root the working folder
v7_stages 16 muon
