#!/usr/bin/env bash
# K 16 × 75 rounds, IsoLoCo with stat2:256 without feedback retuned one outer lr down (2.4 @ 0.8, where its 2-bit
# picks sat at the base cell: Iso-C lifts the quantization noise at the bottom of the spectrum to the mean σ, so a
# smaller step may pay less for it), 3 paired seeds beside k16_plan.sh's 3.2. Resumable and claimable.
source "$(dirname "$0")/../plan_env.sh"
O=study/compression/results/compress_v2.jsonl
$R --cells 16:30 --batch 4 --steps 2250 --eval-every 2 --seeds 0,1,2 --lrs isoloco=2.4 --out $O --compress stat2:256:none
