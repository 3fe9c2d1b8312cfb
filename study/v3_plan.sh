#!/usr/bin/env bash
# Study v3: does IsoLoCo's gain survive bigger batches, other inner lrs, a tuned DiLoCo (outer lr and
# momentum), more workers, longer rounds, a Muon inner optimizer, a wider model? The jobs in priority
# order: seed 0 of every cell's grid first, so a plan stopped early still holds paired comparisons.
# Run it in two processes at once (one core each); claims in results/.claims keep them from running a
# job twice, and finished runs are skipped, so an interrupted plan resumes. Every run is scored on
# 1,024 windows of each held-out split (selection: pick lrs; test: report), at the end only.
set -u
cd "$(dirname "$0")/.."
R="python study/run_study.py --part v3"
O=study/results
DL=diloco=0.35,diloco=0.7,diloco=1.0
IL=isoloco=1.8,isoloco=2.4,isoloco=3.2  # v2: IsoLoCo's best lr grows with K (2.4 at K 4, 3.2 at K 8, 4.2 at K 16)
IL8=$IL,isoloco=4.2
# (a) per-worker batch 16 × 64 bytes (4× v2's tokens per step), K 4, H 30
$R --cells 4:30 --batch 16 --seeds 0 --lrs $DL,$IL,ddp=- --out $O/v3_batch.jsonl
# (e) Muon inner steps (MuLoCo = Muon inner + DiLoCo outer) vs Muon-inner IsoLoCo, K 4
$R --cells 4:30 --inner muon --seeds 0 --lrs $DL,$IL,ddp=- --out $O/v3_muon.jsonl
# (b) inner AdamW lr 6e-3 and 1.5e-3 (v1/v2: 3e-3), batch 4, K 4
$R --cells 4:30 --inner-lr 6e-3 --seeds 0 --lrs $DL,$IL --out $O/v3_innerlr.jsonl
$R --cells 4:30 --inner-lr 1.5e-3 --seeds 0 --lrs $DL,$IL --out $O/v3_innerlr.jsonl
# a tuned DiLoCo: its outer momentum at the lrs around its v1/v2 optimum
$R --cells 4:30 --batch 16 --seeds 0 --lrs diloco=0.7@0.5,diloco=0.5@0.7,diloco=1.4@0,diloco=0.35@0.7 --out $O/v3_batch.jsonl
$R --cells 4:30 --inner muon --seeds 0 --lrs diloco=0.7@0.5,diloco=0.5@0.7 --out $O/v3_muon.jsonl
# grids whose seed-0 optimum sat on an edge: one point beyond it
$R --cells 4:30 --batch 16 --seeds 0 --lrs isoloco=4.2 --out $O/v3_batch.jsonl
$R --cells 4:30 --inner muon --seeds 0 --lrs diloco=1.4,isoloco=1.2 --out $O/v3_muon.jsonl
# seeds 1 and 2 of the same grids
$R --cells 4:30 --batch 16 --seeds 1,2 --lrs $DL,$IL,isoloco=4.2,ddp=- --out $O/v3_batch.jsonl
$R --cells 4:30 --inner muon --seeds 1,2 --lrs $DL,diloco=1.4,isoloco=1.2,$IL,ddp=- --out $O/v3_muon.jsonl
$R --cells 4:30 --inner-lr 6e-3 --seeds 1,2 --lrs $DL,$IL --out $O/v3_innerlr.jsonl
$R --cells 4:30 --inner-lr 1.5e-3 --seeds 1,2 --lrs $DL,$IL --out $O/v3_innerlr.jsonl
# (g) a wider model (d 256: ~4× the block weights), K 4, H 30
$R --cells 4:30 --model tiny-wide --seeds 0 --lrs $DL,$IL,ddp=- --out $O/v3_wide.jsonl
# (a) batch 16 × 128 and K 8
$R --cells 4:30 --batch 16 --seq-len 128 --seeds 0 --lrs $DL,$IL,ddp=- --out $O/v3_batch.jsonl
$R --cells 8:30 --batch 16 --seeds 0 --lrs $DL,$IL8,ddp=- --out $O/v3_batch.jsonl
# (e) Muon at K 16
$R --cells 16:30 --inner muon --seeds 0 --lrs $DL,$IL8 --out $O/v3_muon.jsonl
# (d) H 100 and 300 at R 10 (the budget grows with H), K 4
$R --cells 4:100 --steps 1000 --seeds 0 --lrs $DL,$IL --out $O/v3_h.jsonl
$R --cells 4:300 --steps 3000 --seeds 0 --lrs diloco=0.7,diloco=1.0,isoloco=1.8,isoloco=2.4 --out $O/v3_h.jsonl
# (c) K 32 and 64 with grids
$R --cells 32:30 --seeds 0 --lrs $DL,isoloco=2.4,isoloco=3.2,isoloco=4.2,isoloco=5.6 --out $O/v3_k.jsonl
$R --cells 64:30 --seeds 0 --lrs diloco=0.35,diloco=0.7,isoloco=3.2,isoloco=4.2,isoloco=5.6 --out $O/v3_k.jsonl
# (f) BPE-8192 at K 8 (v2: IsoLoCo's best lr 3.2 on its grid's upper edge, DiLoCo's 0.35 on its lower one)
$R --cells 8:30 --vocab 8192 --seeds 0 --lrs diloco=0.175,diloco=0.35,diloco=0.7,isoloco=2.4,isoloco=3.2,isoloco=4.2,isoloco=5.6 --out $O/v3_bpe.jsonl
