#!/usr/bin/env bash
# Study v7, part B: workers or rounds? K 16 × 75 rounds is where IsoLoCo led (v6 part C); K 4 × 75 rounds keeps its
# rounds at a quarter of its tokens (2,250 inner steps per worker, ≈ 4.9 tokens per parameter). If IsoLoCo leads
# there as much, the lead belongs to the early rounds, not to the workers. Both methods at v6's picks, 5 seeds: DiLoCo at
# K 4's (horizon/, 0.5 @ 0.8) and at K 16's (0.7 @ 0.8), IsoLoCo at 3.2 @ 0.8 (its pick at both), DDP at the same
# tokens. 20 runs of about a quarter of a K 16 × 75 run (≈ 2 CPU-minutes each). Resumable and claimable.
source "$(dirname "$0")/../plan_env.sh"
O=study/k_scaling/results/v7_workers_rounds.jsonl
C="--cells 4:30 --batch 4 --steps 2250 --eval-every 2"
$R $C --seeds 0,1,2,3,4 --lrs isoloco=3.2,diloco=0.5@0.8,diloco=0.7@0.8,ddp=- --out $O
