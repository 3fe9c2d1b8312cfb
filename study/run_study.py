"""The DiLoCo vs IsoLoCo study: paired runs over K and H, an outer-lr grid per method, seeds.

One JSON line per run is appended to --out as soon as the run ends, and runs already in the file
are skipped, so an interrupted study resumes where it stopped. `summarize.py` turns the lines
into the table and plots.

    python study/run_study.py --seed 0 --out study/results/seed0.jsonl

Design (see README.md): cells (K, H) = (4, 30), (8, 30), (2, 30), (4, 100) at a fixed budget of
300 inner steps per worker (R = 10 rounds at H = 30, R = 3 at H = 100); DiLoCo outer lr in
{0.5, 0.7, 1.0} (μ 0.9), IsoLoCo in {1.2, 1.8, 2.4} (μ 0.8), isoloco-sgd at 1.0, and the
data-matched DDP baseline. The seed fixes the global init and every worker's data order, so all
methods of one seed see identical bytes.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode

STEPS_PER_WORKER = 300
CELLS = [(4, 30), (8, 30), (2, 30), (4, 100)]  # most informative first
GRID = [("ddp", None), ("diloco", 0.7), ("isoloco", 1.8), ("diloco", 0.5), ("diloco", 1.0),
        ("isoloco", 1.2), ("isoloco", 2.4), ("isoloco-sgd", 1.0)]


def key(rec: dict) -> tuple:
    return (rec["seed"], rec["workers"], rec["inner_steps"], rec["mode"], rec["outer_lr"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cells", default=None, help="K:H,... (default: all)")
    a = p.parse_args()
    torch.set_num_threads(1)  # one core per study process; two processes share a 2-core machine
    torch.use_deterministic_algorithms(True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        done = {key(json.loads(line)) for line in out.read_text().splitlines() if line.strip()}
    cells = CELLS if a.cells is None else [tuple(int(x) for x in c.split(":")) for c in a.cells.split(",")]
    corpus = load_corpus()
    for K, H in cells:
        cfg = TrainConfig(workers=K, inner_steps=H, rounds=STEPS_PER_WORKER // H, seed=a.seed)
        for mode, lr in GRID:
            rec_key = (a.seed, K, H, mode, lr)
            if rec_key in done:
                continue
            c = cfg if lr is None else replace(cfg, outer_lr={mode: lr})
            t0, c0 = time.perf_counter(), time.process_time()
            r = run_mode(mode, Setup(c, corpus))
            r.update(seed=a.seed, workers=K, inner_steps=H, rounds=c.rounds, outer_lr=lr,
                     cpu_s=time.process_time() - c0, wall_s=time.perf_counter() - t0)
            with out.open("a") as f:
                f.write(json.dumps(r) + "\n")
            done.add(rec_key)
            fl = "diverged" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
            print(f"seed {a.seed} K={K} H={H} {mode} lr={lr}: final {fl}  "
                  f"({r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s cpu)", flush=True)


if __name__ == "__main__":
    main()
