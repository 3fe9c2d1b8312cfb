#!/usr/bin/env bash
# Study v3: does IsoLoCo's gain survive bigger batches, other inner lrs, a tuned DiLoCo (outer lr and
# momentum), more workers, longer rounds, a Muon inner optimizer, a wider model? The jobs in priority
# order: every cell's seed-0 grid (lrs are picked on the selection split of seed 0), then seeds 1
# and 2 of each method's best config (`--lrs best:...`), cheap cells first, so a plan stopped early
# still holds paired comparisons. Run it in two processes at once (one core each); claims in
# study/.claims keep them from running a job twice, and finished runs are skipped, so an
# interrupted plan resumes. Every run is scored on 1,024 windows of each held-out split, at the end.
set -u
cd "$(dirname "$0")/../.."
R="python study/run_study.py --part v3"
O=study/cells/results
# DiLoCo: outer lr at μ 0.9 (its released μ), 0.5 and 0 (plain averaging with an lr)
DL=diloco=0.35,diloco=0.7,diloco=1.0,diloco=0.7@0.5,diloco=1.0@0.5,diloco=1.0@0,diloco=1.4@0,diloco=2.0@0
IL=isoloco=1.8,isoloco=2.4,isoloco=3.2  # v2: IsoLoCo's best lr grows with K (2.4 at K 4, 3.2 at K 8, 4.2 at K 16)
BEST=best:diloco,isoloco,ddp
A16="--cells 4:30 --batch 16"
MU="--cells 4:30 --inner muon"
LRH="--cells 4:30 --inner-lr 6e-3"
LRL="--cells 4:30 --inner-lr 1.5e-3"
WIDE="--cells 4:30 --model tiny-wide"
BASE="--cells 4:30"  # v1/v2's regime (batch 4 × 64, AdamW 3e-3), scored as v3 scores, DiLoCo's μ tuned too
# 1. seed-0 grids at K 4, H 30: (a) batch 16 × 64, (e) Muon inner steps (MuLoCo vs Muon-inner IsoLoCo),
#    (b) inner AdamW lr 6e-3 and 1.5e-3 (v1/v2: 3e-3), (g) d 256 (~4× the block weights), and v1/v2's own cell
$R $A16 --seeds 0 --lrs $DL,$IL,isoloco=4.2,ddp=- --out $O/v3_batch.jsonl
$R $MU --seeds 0 --lrs $DL,$IL,isoloco=1.2,ddp=- --out $O/v3_muon.jsonl
$R $LRH --seeds 0 --lrs $DL,$IL,ddp=- --out $O/v3_innerlr.jsonl
$R $LRL --seeds 0 --lrs $DL,$IL,isoloco=4.2,ddp=- --out $O/v3_innerlr.jsonl
$R $WIDE --seeds 0 --lrs $DL,$IL,ddp=- --out $O/v3_wide.jsonl
$R $BASE --seeds 0 --lrs $DL,$IL,ddp=- --out $O/v3_base.jsonl
# 1b. one point past each seed-0 optimum that sat on its grid's edge (at its μ)
$R $A16 --seeds 0 --lrs diloco=1.4@0.5 --out $O/v3_batch.jsonl
$R $LRL --seeds 0 --lrs diloco=0.5@0.5,isoloco=5.6 --out $O/v3_innerlr.jsonl
$R $LRH --seeds 0 --lrs diloco=0.7@0 --out $O/v3_innerlr.jsonl
$R $WIDE --seeds 0 --lrs diloco=0.7@0,isoloco=4.2 --out $O/v3_wide.jsonl
$R $BASE --seeds 0 --lrs diloco=0.7@0,isoloco=1.2 --out $O/v3_base.jsonl
$R $BASE --seeds 0 --lrs diloco=0.5@0,isoloco=4.2 --out $O/v3_base.jsonl
$R $MU --seeds 0 --lrs diloco=1.4@0.5 --out $O/v3_muon.jsonl
# 2. seeds 1 and 2 of each method's best config there (a `best:` job waits for grid jobs in flight)
$R $A16 --seeds 1,2 --lrs $BEST --out $O/v3_batch.jsonl
$R $MU --seeds 1,2 --lrs $BEST --out $O/v3_muon.jsonl
$R $LRH --seeds 1,2 --lrs $BEST --out $O/v3_innerlr.jsonl
$R $LRL --seeds 1,2 --lrs $BEST --out $O/v3_innerlr.jsonl
$R $WIDE --seeds 1,2 --lrs $BEST --out $O/v3_wide.jsonl
$R $BASE --seeds 1,2 --lrs $BEST --out $O/v3_base.jsonl
# 2b. (h) PyTorch's default init with a GPT-style position table N(0, 0.02) (v2's "torch" drew it N(0, 1)):
#    grid, then the best configs on seeds 1 and 2
TI="--cells 4:30 --init torch"
$R $TI --seeds 0 --lrs $DL,$IL,isoloco=4.2,ddp=- --out $O/v3_init.jsonl
$R $TI --seeds 0 --lrs diloco=0.5@0.5,diloco=0.35@0.5 --out $O/v3_init.jsonl  # past DiLoCo's edge (0.7 @ 0.5)
$R $TI --seeds 1,2 --lrs $BEST --out $O/v3_init.jsonl
# 3. the costlier cells, most asked-about first, each its seed-0 grid (trimmed to the region the
#    cheap cells' optima fall in) then seeds 1 and 2 of its best configs: (e) Muon at K 16, (a) K 8
#    at batch 16, (d) H 100 at R 10, (c) K 32, (a) batch 16 × 128 at K 4 and 8, (f) BPE-8192 at K 8 past v2's
#    edges, (d) H 300 at R 10, (a) batch 32 × 64 at K 4, (c) K 64. A plan stopped early leaves whole cells, not half ones.
DLS=diloco=0.35,diloco=0.7,diloco=1.0@0.5,diloco=0.7@0.5,diloco=1.0@0,diloco=1.4@0
cell() {  # cell ARGS... -- LRS OUT: the seed-0 grid, then the best configs on seeds 1 and 2
  local args=() lrs out
  while [ "$1" != "--" ]; do args+=("$1"); shift; done
  lrs=$2 out=$3
  $R "${args[@]}" --seeds 0 --lrs "$lrs" --out "$out"
  $R "${args[@]}" --seeds 1,2 --lrs $BEST --out "$out"
}
cell --cells 16:30 --inner muon -- $DLS,diloco=1.4@0.5,isoloco=1.8,isoloco=2.4,isoloco=3.2,ddp=- $O/v3_muon.jsonl
cell --cells 8:30 --batch 16 -- $DLS,isoloco=2.4,isoloco=3.2,isoloco=4.2,ddp=- $O/v3_batch.jsonl
cell --cells 8:30 --batch 16 -- diloco=1.4@0.5 $O/v3_batch.jsonl  # past DiLoCo's edge
cell --cells 4:100 --steps 1000 -- $DLS,isoloco=1.8,isoloco=2.4,isoloco=3.2,ddp=- $O/v3_h.jsonl
cell --cells 4:100 --steps 1000 -- diloco=2.0@0 $O/v3_h.jsonl  # past DiLoCo's edge
cell --cells 32:30 -- $DLS,isoloco=3.2,isoloco=4.2,isoloco=5.6,ddp=- $O/v3_k.jsonl
cell --cells 32:30 -- diloco=2.0@0 $O/v3_k.jsonl  # past DiLoCo's edge
cell --cells 4:30 --batch 16 --seq-len 128 -- $DLS,isoloco=1.8,isoloco=2.4,isoloco=3.2,ddp=- $O/v3_batch.jsonl
cell --cells 4:30 --batch 16 --seq-len 128 -- diloco=1.4@0.5,isoloco=4.2 $O/v3_batch.jsonl  # past both edges
cell --cells 8:30 --batch 16 --seq-len 128 -- $DLS,isoloco=2.4,isoloco=3.2,isoloco=4.2,ddp=- $O/v3_batch.jsonl
cell --cells 8:30 --batch 16 --seq-len 128 -- diloco=1.4@0.5 $O/v3_batch.jsonl  # past DiLoCo's edge
cell --cells 8:30 --vocab 8192 -- diloco=0.175,diloco=0.35,diloco=0.7@0.5,diloco=1.0@0,isoloco=2.4,isoloco=3.2,isoloco=4.2,ddp=- $O/v3_bpe.jsonl
cell --cells 8:30 --vocab 8192 -- diloco=0.5@0.5,diloco=1.0@0.5,diloco=1.4@0,isoloco=1.8 $O/v3_bpe.jsonl  # past the edges
# (f) v2's ablation under BPE (embedding and head unflattened) on a grid past v2's edge (2.4)
$R --cells 8:30 --vocab 8192 --seeds 0 --lrs isoloco-noemb=1.8,isoloco-noemb=2.4,isoloco-noemb=3.2,isoloco-noemb=4.2 --out $O/v3_bpe.jsonl
$R --cells 8:30 --vocab 8192 --seeds 1,2 --lrs best:isoloco-noemb --out $O/v3_bpe.jsonl
cell --cells 4:300 --steps 3000 -- diloco=0.7,diloco=0.7@0.5,diloco=1.0@0.5,diloco=1.4@0.5,diloco=1.0@0,diloco=1.4@0,diloco=2.0@0,isoloco=1.2,isoloco=1.8,isoloco=2.4,isoloco=3.2,ddp=- $O/v3_h.jsonl
# (a) the tokens of 16 × 128 at 64-byte sequences: sequence length or tokens per step?
cell --cells 4:30 --batch 32 -- $DLS,isoloco=1.8,isoloco=2.4,isoloco=3.2,ddp=- $O/v3_batch.jsonl
cell --cells 64:30 -- diloco=0.35,diloco=0.7@0.5,diloco=1.4@0,isoloco=3.2,isoloco=4.2,isoloco=5.6,ddp=- $O/v3_k.jsonl
