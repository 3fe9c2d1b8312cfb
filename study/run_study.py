"""The DiLoCo vs IsoLoCo study: paired runs over K and H, an outer-lr grid per method, seeds.

One JSON line per run is appended to --out as soon as the run ends. Runs found in any
results/*.jsonl are skipped and a job is claimed (results/.claims/) before it starts, so several
processes can share the job list and an interrupted study resumes where it stopped.
`summarize.py` turns the lines into the table and plots.

    python study/run_study.py --seeds 0 --out study/results/seed0.jsonl
    python study/run_study.py --seeds 0,1 --part grid --cells 4:30 --out study/results/grid.jsonl

Design (see README.md): cells (K, H) = (4, 30), (8, 30), (2, 30), (4, 100) at a fixed budget of
300 inner steps per worker (R = 10 rounds at H = 30, R = 3 at H = 100); DiLoCo outer lr in
{0.5, 0.7, 1.0} (μ 0.9), IsoLoCo in {1.2, 1.8, 2.4} (μ 0.8), isoloco-sgd at 1.0, and the
data-matched DDP baseline; run order in `jobs`. The seed fixes the global init and every worker's
data order, so all methods of one seed see identical bytes.

Study v2 (`--part v2`): every method at its default outer lr — DDP, plain averaging (avg, outer
SGD lr 1 μ 0), DiLoCo 0.7, Iso-C without momentum (isoloco-sgd 3.0), IsoLoCo 1.8 — for each
`--init` (gpt2, torch) and `--vocab`; its records carry "study": "v2", "init", "vocab" and the
per-round divergence measurements, and summarize.py keeps them out of the v1 tables:

    python study/run_study.py --part v2 --init gpt2,torch --cells 4:30 --seeds 0,1 --out study/results/v2_init.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode
from summarize import read_jsonl  # study/ is on sys.path: this file runs as a script

STEPS_PER_WORKER = 300
EVAL_WINDOWS = 1024  # per split: the paired-difference noise of 64 windows hid gaps ≤ 0.05
CELLS = [(4, 30), (8, 30), (2, 30), (4, 100)]  # most informative first
DEFAULTS = [("diloco", 0.7), ("isoloco", 1.8)]
NEIGHBOURS = [("diloco", 1.0), ("isoloco", 2.4), ("diloco", 0.5), ("isoloco", 1.2)]


PARTS = ("all", "defaults", "grid", "extra", "v2")
# study methods that are a loop mode with other settings: name -> (mode, TrainConfig fields)
VARIANTS = {  # the embedding and head unflattened, at IsoLoCo's outer lr or with DiLoCo's tuned step (lr 0.35, μ 0.9)
    "isoloco-noemb": ("isoloco", {"iso_skip": ("tok.", "head.")}),
    "isoloco-noemb-dl": ("isoloco", {"iso_skip": ("tok.", "head."), "iso_skip_outer": (0.35, 0.9)}),
}
# study v2's "torch" init is the loop's torch-pos1 today (the position table N(0, 1)); its records
# keep the name "torch", so a v2 run is repeated, and found finished, under the meaning it had
V2_INITS = {"torch": "torch-pos1"}
V2_METHODS = [("ddp", None), ("avg", 1.0), ("diloco", 0.7), ("isoloco-sgd", 3.0), ("isoloco", 1.8)]


def jobs(cells, part: str = "all") -> list[tuple[int, int, str, float | None]]:
    """Run order: the released configs in every cell, then the outer-lr grid, then the DDP
    baselines of the other cells and Iso-C without momentum, so a study stopped early (CPU time
    on the machine it ran on was scarce) still holds complete, paired comparisons."""
    defaults = [(4, 30, "ddp", None)] if (4, 30) in cells else []
    defaults += [(K, H, m, lr) for K, H in cells for m, lr in DEFAULTS]
    grid = [(K, H, m, lr) for K, H in cells for m, lr in NEIGHBOURS]
    extra = [(K, H, "ddp", None) for K, H in cells if H != 100]  # ddp does not depend on H
    extra += [(K, H, "isoloco-sgd", 1.0) for K, H in cells]
    v2 = [(K, H, m, lr) for K, H in cells for m, lr in V2_METHODS]
    chosen = {"all": defaults + grid + extra, "defaults": defaults, "grid": grid, "extra": extra, "v2": v2}[part]
    return list(dict.fromkeys(chosen))


def key(rec: dict) -> tuple:
    # records from before the selection / test split lack eval_split: they were scored on 64 windows
    # over the whole held-out text, and a rerun today is another run
    return (rec["seed"], rec["workers"], rec["inner_steps"], rec["mode"], rec["outer_lr"],
            rec.get("study", "v1"), rec.get("init", "gpt2"), rec.get("vocab", 256), rec["rounds"],
            rec.get("eval_split", "whole"), rec.get("eval_windows", 64))


def finished(folder: Path) -> set:
    return {key(r) for f in folder.glob("*.jsonl") for r in read_jsonl(f)}


def claim(folder: Path, k: tuple) -> bool:
    """True if this process may run job k (no other process has claimed it)."""
    d = folder / ".claims"
    d.mkdir(exist_ok=True)
    try:
        os.close(os.open(d / "_".join(map(str, k)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", required=True, help="comma list, e.g. 0,1")
    p.add_argument("--out", required=True, help="JSONL file to append to (its folder holds all results)")
    p.add_argument("--cells", default=None, help="K:H,... (default: all)")
    p.add_argument("--part", choices=PARTS, default="all")
    p.add_argument("--lrs", default=None,
                   help="run only these outer lrs instead of a part, e.g. diloco=0.35,isoloco=3.2 (ddp=- for DDP)")
    p.add_argument("--init", default="gpt2", help="v2: comma list of inits (gpt2, torch)")
    p.add_argument("--vocab", type=int, default=256, help="v2: 256 (bytes) or a BPE vocabulary size")
    p.add_argument("--eval-windows", type=int, default=EVAL_WINDOWS,
                   help="held-out windows in each split (selection: pick lrs; test: report) (default %(default)s)")
    p.add_argument("--steps", type=int, default=STEPS_PER_WORKER,
                   help="inner steps per worker (the token budget); rounds = steps // H")
    a = p.parse_args()
    study = "v2" if a.part == "v2" else "v1"
    inits = [x for x in a.init.split(",") if x]
    if study == "v1" and (inits != ["gpt2"] or a.vocab != 256 or a.steps != STEPS_PER_WORKER):
        p.error("--init, --vocab and --steps are study v2 settings: add --part v2")
    torch.set_num_threads(1)  # one core per study process
    torch.use_deterministic_algorithms(True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    cells = CELLS if a.cells is None else [tuple(int(x) for x in c.split(":")) for c in a.cells.split(",")]
    corpus = load_corpus()
    cache = out.parent / ".tokenizers"  # BPE tokenizers, trained once on the training split
    todo = jobs(cells, a.part)
    if a.lrs:  # extend the grid where its best point sits on an edge
        pairs = [(m, None if v == "-" else float(v)) for m, v in (x.split("=") for x in a.lrs.split(","))]
        todo = [(K, H, m, lr) for K, H in cells for m, lr in pairs]
    todo = [(K, H, mode, lr, init, seed) for init in inits for K, H, mode, lr in todo for seed in seeds]
    if study == "v2":  # the paired DiLoCo / IsoLoCo runs of every init first, seed by seed; then the rest
        todo.sort(key=lambda j: (j[2] not in ("diloco", "isoloco"), j[5]))
    for K, H, mode, lr, init, seed in todo:
        rounds = a.steps // H
        if rounds < 1:
            p.error(f"--steps {a.steps} is less than one round at H = {H}")
        k = (seed, K, H, mode, lr, study, init, a.vocab, rounds, "halves", a.eval_windows)
        if k in finished(out.parent) or not claim(out.parent, k):
            continue
        run, fields = VARIANTS.get(mode, (mode, {}))
        cfg = TrainConfig(workers=K, inner_steps=H, rounds=rounds, seed=seed,
                          init=V2_INITS.get(init, init) if study == "v2" else init, vocab=a.vocab,
                          divergence=study == "v2", eval_windows=a.eval_windows, **fields)
        if lr is not None:
            cfg = replace(cfg, outer_lr={run: lr})
        t0, c0 = time.perf_counter(), time.process_time()
        r = run_mode(run, Setup(cfg, corpus, cache_dir=cache))
        r.update(mode=mode, seed=seed, workers=K, inner_steps=H, rounds=cfg.rounds, outer_lr=lr,
                 eval_split="halves", eval_windows=a.eval_windows,
                 cpu_s=time.process_time() - c0, wall_s=time.perf_counter() - t0)
        if study == "v2":
            r.update(study="v2", init=init, vocab=a.vocab)
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")
        fl = "diverged" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        print(f"seed {seed} K={K} H={H} {mode} lr={lr} {init} vocab {a.vocab}: final {fl}  "
              f"({r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s cpu)", flush=True)


if __name__ == "__main__":
    main()
