#!/usr/bin/env bash
# Study v2 beyond the first slice (v2_init.jsonl): the jobs in priority order. Run this script in
# two processes at once (one core each); claims in study/.claims keep them from running a job twice,
# and finished runs are skipped, so an interrupted plan resumes. (The order was revised once while
# it ran, after the K = 16 and H-sweep runs had taken 2-4x the CPU time first measured.)
set -u
cd "$(dirname "$0")/../.."
R="python study/run_study.py --part v2"
O=study/init_scale/results
$R --init gpt2,torch --cells 4:30,8:30 --seeds 2 --lrs diloco=0.7,isoloco=1.8 --out $O/v2_init.jsonl
$R --cells 16:30 --seeds 0,1,2 --lrs diloco=0.7,isoloco=1.8 --out $O/v2_k.jsonl
$R --cells 4:10,4:30,4:100 --steps 1200 --seeds 0,1,2 --lrs diloco=0.7,isoloco=1.8 --out $O/v2_h.jsonl
$R --cells 8:30 --vocab 8192 --seeds 0,1,2 --lrs diloco=0.7,isoloco=1.8 --out $O/v2_bpe.jsonl
$R --init gpt2,torch --cells 4:30,8:30 --seeds 2 --lrs ddp=-,avg=1.0,isoloco-sgd=3.0 --out $O/v2_init.jsonl
$R --cells 4:30 --steps 1200 --seeds 0,1,2 --lrs ddp=- --out $O/v2_h.jsonl
$R --cells 32:30 --seeds 0 --lrs diloco=0.7,isoloco=1.8 --out $O/v2_k.jsonl
# outer-lr grids, seed 0 first: DiLoCo 0.35 and IsoLoCo 2.4 were the best points at H = 30 in v1
$R --cells 4:10,4:30,4:100 --steps 1200 --seeds 0 --lrs diloco=0.35,isoloco=2.4 --out $O/v2_h.jsonl
$R --cells 16:30 --seeds 0 --lrs ddp=-,isoloco-sgd=3.0 --out $O/v2_k.jsonl
$R --cells 8:30 --vocab 8192 --seeds 0 --lrs ddp=-,isoloco-sgd=3.0,avg=1.0 --out $O/v2_bpe.jsonl
$R --cells 8:30 --vocab 8192 --seeds 0 --lrs diloco=0.35,isoloco=2.4 --out $O/v2_bpe.jsonl
$R --cells 16:30 --seeds 0 --lrs diloco=0.35,isoloco=2.4 --out $O/v2_k.jsonl
$R --init torch --cells 4:30 --seeds 0,1 --lrs isoloco=3.2 --out $O/v2_init.jsonl
$R --init torch --cells 8:30 --seeds 0,1 --lrs diloco=0.35,isoloco=2.4 --out $O/v2_init.jsonl
$R --cells 4:10,4:30,4:100 --steps 1200 --seeds 1 --lrs diloco=0.35,isoloco=2.4 --out $O/v2_h.jsonl
$R --cells 32:30 --seeds 1 --lrs diloco=0.7,isoloco=1.8 --out $O/v2_k.jsonl
$R --cells 16:30 --seeds 1,2 --lrs ddp=-,isoloco-sgd=3.0 --out $O/v2_k.jsonl
$R --cells 8:30 --vocab 8192 --seeds 1,2 --lrs ddp=-,isoloco-sgd=3.0,avg=1.0 --out $O/v2_bpe.jsonl
$R --cells 4:300 --steps 3000 --seeds 0 --lrs diloco=0.7,isoloco=1.8 --out $O/v2_h.jsonl
# the best DiLoCo lr of the H-sweep grid sat on its lower edge: one more point below it
$R --cells 4:10,4:30,4:100 --steps 1200 --seeds 0,1 --lrs diloco=0.175 --out $O/v2_h.jsonl
$R --cells 4:10,4:30,4:100 --steps 1200 --seeds 2 --lrs diloco=0.35,isoloco=2.4 --out $O/v2_h.jsonl
# grids whose best point sat on an edge: DiLoCo up at H = 100, IsoLoCo up at H = 30 and 100
$R --cells 4:100 --steps 1200 --seeds 0,1 --lrs diloco=1.0 --out $O/v2_h.jsonl
$R --cells 4:30,4:100 --steps 1200 --seeds 0,1 --lrs isoloco=3.2 --out $O/v2_h.jsonl
$R --cells 16:30 --seeds 1 --lrs diloco=0.35,isoloco=2.4 --out $O/v2_k.jsonl
$R --cells 8:30 --vocab 8192 --seeds 1 --lrs diloco=0.35,isoloco=2.4 --out $O/v2_bpe.jsonl
# the remaining grids whose best point sat on an edge: one point beyond it, seeds 0 and 1
$R --cells 4:10 --steps 1200 --seeds 0,1 --lrs diloco=0.0875,isoloco=1.2 --out $O/v2_h.jsonl
$R --cells 8:30 --vocab 8192 --seeds 0,1 --lrs diloco=0.175,isoloco=3.2 --out $O/v2_bpe.jsonl
$R --cells 16:30 --seeds 0,1 --lrs diloco=0.175,isoloco=3.2 --out $O/v2_k.jsonl
$R --cells 8:30 --seeds 0,1 --lrs diloco=0.175,isoloco=3.2 --out $O/v2_k.jsonl
$R --init torch --cells 8:30 --seeds 0,1 --lrs diloco=1.0 --out $O/v2_init.jsonl
$R --init torch --cells 4:30 --seeds 0,1 --lrs isoloco=4.2 --out $O/v2_init.jsonl
$R --cells 2:30 --seeds 0,1 --lrs diloco=0.175,isoloco=3.2 --out $O/v2_k.jsonl
# after those: the edges that moved (IsoLoCo up at K = 8 and 16 and at K = 8 with PyTorch init, DiLoCo down at K = 2)
$R --cells 8:30 --seeds 0,1 --lrs isoloco=4.2 --out $O/v2_k.jsonl
$R --cells 16:30 --seeds 0,1 --lrs isoloco=4.2 --out $O/v2_k.jsonl
$R --init torch --cells 8:30 --seeds 0,1 --lrs isoloco=3.2 --out $O/v2_init.jsonl
$R --cells 2:30 --seeds 0,1 --lrs diloco=0.0875 --out $O/v2_k.jsonl
$R --init torch --cells 8:30 --seeds 0,1 --lrs isoloco=4.2 --out $O/v2_init.jsonl
$R --cells 16:30 --seeds 0,1 --lrs isoloco=5.6 --out $O/v2_k.jsonl
# ablation: IsoLoCo with the embedding and head unflattened (isoloco-noemb), BPE-8192 and bytes at K = 8
$R --cells 8:30 --vocab 8192 --seeds 0,1,2 --lrs isoloco-noemb=1.8 --out $O/v2_bpe.jsonl
$R --cells 8:30 --seeds 0,1,2 --lrs isoloco-noemb=1.8 --out $O/v2_k.jsonl
$R --cells 8:30 --vocab 8192 --seeds 0,1 --lrs isoloco-noemb=2.4 --out $O/v2_bpe.jsonl
$R --cells 8:30 --seeds 0,1 --lrs isoloco-noemb=2.4,isoloco-noemb=3.2 --out $O/v2_k.jsonl
# the same with DiLoCo's tuned outer step on the embedding and head (isoloco-noemb-dl), at IsoLoCo's tuned lr
$R --cells 8:30 --vocab 8192 --seeds 0,1 --lrs isoloco-noemb-dl=2.4 --out $O/v2_bpe.jsonl
$R --cells 8:30 --seeds 0,1 --lrs isoloco-noemb-dl=3.2 --out $O/v2_k.jsonl
