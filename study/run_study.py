"""The DiLoCo vs IsoLoCo study: paired runs over K and H, an outer-lr grid per method, seeds.

One JSON line per run is appended to --out as soon as the run ends, and runs already in the file
are skipped, so an interrupted study resumes where it stopped. `summarize.py` turns the lines
into the table and plots.

    python study/run_study.py --seed 0 --out study/results/seed0.jsonl

Design (see README.md): cells (K, H) = (4, 30), (8, 30), (2, 30), (4, 100) at a fixed budget of
300 inner steps per worker (R = 10 rounds at H = 30, R = 3 at H = 100); DiLoCo outer lr in
{0.5, 0.7, 1.0} (μ 0.9), IsoLoCo in {1.2, 1.8, 2.4} (μ 0.8), isoloco-sgd at 1.0, and the
data-matched DDP baseline; run order in `jobs`. The seed fixes the global init and every worker's data order, so all
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
DEFAULTS = [("diloco", 0.7), ("isoloco", 1.8)]
NEIGHBOURS = [("diloco", 1.0), ("isoloco", 2.4), ("diloco", 0.5), ("isoloco", 1.2)]


def jobs(cells) -> list[tuple[int, int, str, float | None]]:
    """Run order: the released configs in every cell, then the outer-lr grid, then the DDP
    baselines of the other cells and Iso-C without momentum, so a study stopped early (CPU time
    on the machine it ran on was scarce) still holds complete, paired comparisons."""
    out = [(4, 30, "ddp", None)]
    out += [(K, H, m, lr) for K, H in cells for m, lr in DEFAULTS]
    out += [(K, H, m, lr) for K, H in cells for m, lr in NEIGHBOURS]
    out += [(K, H, "ddp", None) for K, H in cells if H != 100]  # ddp does not depend on H
    out += [(K, H, "isoloco-sgd", 1.0) for K, H in cells]
    return list(dict.fromkeys(out))


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
    for K, H, mode, lr in jobs(cells):
        if (a.seed, K, H, mode, lr) in done:
            continue
        cfg = TrainConfig(workers=K, inner_steps=H, rounds=STEPS_PER_WORKER // H, seed=a.seed)
        if lr is not None:
            cfg = replace(cfg, outer_lr={mode: lr})
        t0, c0 = time.perf_counter(), time.process_time()
        r = run_mode(mode, Setup(cfg, corpus))
        r.update(seed=a.seed, workers=K, inner_steps=H, rounds=cfg.rounds, outer_lr=lr,
                 cpu_s=time.process_time() - c0, wall_s=time.perf_counter() - t0)
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")
        done.add((a.seed, K, H, mode, lr))
        fl = "diverged" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        print(f"seed {a.seed} K={K} H={H} {mode} lr={lr}: final {fl}  "
              f"({r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s cpu)", flush=True)


if __name__ == "__main__":
    main()
