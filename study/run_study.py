"""The DiLoCo vs IsoLoCo study: paired runs over K and H, an outer-lr grid per method, seeds.

One JSON line per run is appended to --out (study/<question>/results/<file>.jsonl) as soon as the run
ends. Runs found in any question's results/*.jsonl are skipped and a job is claimed (study/.claims/)
before it starts, so several processes can share the job list and an interrupted study resumes where it
stopped (`study_folder`: an --out outside study/<question>/results/ makes its own folder a scratch study).
`summarize.py` turns the lines into the tables and plots (v1's are frozen in cells/notes.md).

    python study/run_study.py --seeds 0 --out study/cells/results/seed0.jsonl
    python study/run_study.py --seeds 0,1 --part grid --cells 4:30 --out study/cells/results/grid.jsonl

Design (see README.md): cells (K, H) = (4, 30), (8, 30), (2, 30), (4, 100) at a fixed budget of
300 inner steps per worker (R = 10 rounds at H = 30, R = 3 at H = 100); DiLoCo outer lr in
{0.5, 0.7, 1.0} (μ 0.9), IsoLoCo in {1.2, 1.8, 2.4} (μ 0.8), isoloco-sgd at 1.0, and the
data-matched DDP baseline; run order in `jobs`. The seed fixes the global init and every worker's
data order, so all methods of one seed see identical bytes.

Study v2 (`--part v2`): every method at its default outer lr — DDP, plain averaging (avg, outer
SGD lr 1 μ 0), DiLoCo 0.7, Iso-C without momentum (isoloco-sgd 3.0), IsoLoCo 1.8 — for each
`--init` (gpt2, torch) and `--vocab`; its records carry "study": "v2", "init", "vocab" and the
per-round divergence measurements, and summarize.py tables them apart:

    python study/run_study.py --part v2 --init gpt2,torch --cells 4:30 --seeds 0,1 --out study/init_scale/results/v2_init.jsonl

Study v3 (`--part v3`): the regime knobs v1/v2 held fixed — `--batch`, `--seq-len`, `--inner-lr`,
`--inner muon`, `--model` — and the outer momentum per job (`--lrs diloco=0.7@0.5` is lr 0.7, μ 0.5).
Every v3 run is scored on `--eval-windows` (default 1,024) windows of each held-out split, only at
the end (`--eval-every` rounds between scores), and records its settings under "v3"; the plan is
study/cells/v3_plan.sh:

    python study/run_study.py --part v3 --cells 4:30 --batch 16 --seeds 0 --lrs diloco=0.7,isoloco=1.8 --out study/cells/results/v3_batch.jsonl

Study v4 (`--part v4`): v3's settings and scoring, with IsoLoCo's flatten method as one more setting
(`--iso-method`, a comma list: any method of the library's registry or a study-only one of flattens.py,
registered for this process). Its records carry "study": "v4", "iso_method" and the method inside the
settings under "v3" (so the run keys of two methods differ), and the fallback counts of the
residual-checked methods. `--spectra FILE` also captures the averaged Δ of the seed-0 "svd" run in the
first, middle and last round and appends each method's relative error against reference.py and its
flatness on every matrix to FILE (one line per round). A file named STOP in the study folder (study/STOP)
stops a runner before its next run (any part); the plan is study/precision/v4_plan.sh:

    python study/run_study.py --part v4 --cells 4:30 --seeds 0,1,2 --lrs isoloco=3.2 --iso-method svd,fast --out study/precision/results/v4_base.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script: the study's modules are study.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode
from isoloco_kernels.train.config import OUTER_DEFAULTS
from study.common.records import read_jsonl, results_files, run_key
from study.precision.spectra import capture_rounds, write_spectra

STEPS_PER_WORKER = 300
EVAL_WINDOWS = 1024  # per split: the paired-difference noise of 64 windows hid gaps ≤ 0.05
CELLS = [(4, 30), (8, 30), (2, 30), (4, 100)]  # most informative first
DEFAULTS = [("diloco", 0.7), ("isoloco", 1.8)]
NEIGHBOURS = [("diloco", 1.0), ("isoloco", 2.4), ("diloco", 0.5), ("isoloco", 1.2)]
STOP_FILE = "STOP"  # in the study folder: start no further run (the one in flight finishes)
PARTS = ("all", "defaults", "grid", "extra", "v2", "v3", "v4")
# study methods that are a loop mode with other settings: name -> (mode, TrainConfig fields)
VARIANTS = {  # the embedding and head unflattened, at IsoLoCo's outer lr or with DiLoCo's tuned step (lr 0.35, μ 0.9)
    "isoloco-noemb": ("isoloco", {"iso_skip": ("tok.", "head.")}),
    "isoloco-noemb-dl": ("isoloco", {"iso_skip": ("tok.", "head."), "iso_skip_outer": (0.35, 0.9)}),
}
# study v5 part B: the paper's other merges as study methods, each an Iso-C mode with TrainConfig.merge set:
# "tsv" with the Nesterov outer step (the isoloco mode, μ 0.8), "tsv-sgd" with outer SGD (isoloco-sgd, μ 0)
MERGE_VARIANTS = ("tsv", "iso_cts", "ties", "dare", "norm_mean")  # norm_mean: study v7's step-size control
for _merge in MERGE_VARIANTS:
    VARIANTS[_merge] = ("isoloco", {"merge": _merge})
    VARIANTS[f"{_merge}-sgd"] = ("isoloco-sgd", {"merge": _merge})
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


# study v3's regime settings: flag -> (TrainConfig field, type); a record keeps them under "v3",
# together with the job's outer momentum ("mu", None: the mode's default)
V3_SETTINGS = {
    "batch": ("batch", int),
    "seq_len": ("seq_len", int),
    "inner_lr": ("inner_lr", float),
    "inner": ("inner", str),
    "model": ("model", str),
    "eval_every": ("eval_every", int),
    "outer_schedule": ("outer_schedule", str),  # v6: in a run's settings only when not "constant"
    "compress": ("compress", str),  # compressed exchange (study/compression/): in a run's settings only when set
    # workers as they arrive (study/arrival/): in a run's settings only when set
    "drop": ("drop", float),
    "faulty": ("faulty", float),
    "merge_clip": ("merge_clip", str),
}


#: settings whose runs never join a tuning grid (common.grids.grids): the grid is constant-schedule, uncompressed,
#: every worker delivering alike
OFF_GRID = ("outer_schedule", "compress", "drop", "faulty", "merge_clip")


def parse_lrs(text: str) -> list[tuple[str, float | None, float | None]]:
    """ "diloco=0.7,isoloco=1.8@0.9,ddp=-" -> [(mode, outer lr, outer momentum or None)]."""
    out = []
    for item in (x for x in text.split(",") if x):
        mode, _, v = item.partition("=")
        lr, _, mu = v.partition("@")
        out.append((mode, None if lr == "-" else float(lr), float(mu) if mu else None))
    return out


def study_folder(out: Path) -> Path:
    """The study an --out file belongs to: study/ for study/<question>/results/<file>.jsonl; for any other
    --out its own folder (a scratch study). The study folder holds the claims (.claims/), the BPE tokenizer
    cache (.tokenizers/) and STOP; its run records are common.records.results_files(folder)."""
    return out.parent.parent.parent if out.parent.name == "results" else out.parent


def finished(folder: Path) -> set:
    """The run keys of every record of the study in `folder` (each question's results)."""
    return {run_key(r) for f in results_files(folder) for r in read_jsonl(f)}


def claim_name(k: tuple) -> str:
    name = "_".join(map(str, k))
    if len(name) > 150:  # v3 keys carry their settings: a digest keeps the file name short
        name = "_".join(map(str, k[:-1])) + "_" + hashlib.sha1(repr(k[-1]).encode()).hexdigest()[:16]
    return name


def cell_of(k: tuple) -> tuple:
    """The cell a run key belongs to: everything but seed, mode, outer lr and μ."""
    seed, K, H, mode, lr, study, init, vocab, rounds, split, windows, v3 = k
    return (K, H, study, init, vocab, rounds, split, windows, tuple(kv for kv in v3 or () if kv[0] != "mu"))


def grid_settings(v3: dict) -> dict:
    """The settings of the grid (common.grids.grids: constant schedule, uncompressed; any μ) a `best:` job picks from."""
    return {**{k: v for k, v in v3.items() if k not in OFF_GRID}, "mu": None}


def wait_for_grids(folder: Path, cells: set, limit_s: float = 3600.0, poll_s: float = 20.0) -> bool:
    """Block while another process still runs a seed-0 (grid) job of one of these cells (`cell_of`
    values): a `best:` job picks its configs from the finished grid, not from part of it. A claim
    holds its run key; an empty one (written before claims held keys) counts when its K and H
    match. A claim left by a killed run waits out limit_s (then False)."""
    t0 = time.time()
    prefixes = tuple(f"0_{c[0]}_{c[1]}_" for c in cells)

    def ours(claim_file: Path) -> bool:
        text = claim_file.read_text().strip()
        if not text:
            return claim_file.name.startswith(prefixes)
        return cell_of(ast.literal_eval(text)) in cells

    while True:
        done = {claim_name(k) for k in finished(folder) if k[0] == 0}
        busy = [c.name for c in (folder / ".claims").glob("0_*") if c.name not in done and ours(c)]
        if not busy:
            return True
        if time.time() - t0 > limit_s:
            return False
        print(f"waiting for {len(busy)} grid job(s) in flight before picking the best configs", flush=True)
        time.sleep(poll_s)


def code_version() -> str | None:
    """The commit the runner's tree is at (a trailing "+" when its Python sources have uncommitted changes), kept in every record;
    None outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "isoloco_kernels/*.py", "study/*.py"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def claim(folder: Path, k: tuple) -> bool:
    """True if this process may run job k (no other process has claimed it); the claim holds k."""
    d = folder / ".claims"
    d.mkdir(exist_ok=True)
    try:
        fd = os.open(d / claim_name(k), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(repr(k))
    return True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", required=True, help="comma list, e.g. 0,1")
    p.add_argument("--out", required=True, help="JSONL file to append to: study/<question>/results/<file>.jsonl")
    p.add_argument("--cells", default=None, help="K:H,... (default: all)")
    p.add_argument("--part", choices=PARTS, default="all")
    p.add_argument(
        "--lrs",
        default=None,
        help="run only these outer lrs instead of a part, e.g. diloco=0.35,isoloco=3.2 (ddp=- for DDP; "
        "v3: diloco=0.7@0.5 sets μ too, and best:diloco,isoloco,ddp runs each mode's best config so far in the cell)",
    )
    p.add_argument("--init", default="gpt2", help="v2: comma list of inits (gpt2, torch)")
    p.add_argument("--vocab", type=int, default=256, help="v2: 256 (bytes) or a BPE vocabulary size")
    p.add_argument(
        "--eval-windows",
        type=int,
        default=EVAL_WINDOWS,
        help="held-out windows in each split (selection: pick lrs; test: report) (default %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=STEPS_PER_WORKER,
        help="inner steps per worker (the token budget); rounds = steps // H",
    )
    p.add_argument("--batch", type=int, default=4, help="v3: sequences per worker per inner step")
    p.add_argument("--seq-len", type=int, default=64, help="v3: sequence length")
    p.add_argument("--inner-lr", type=float, default=3e-3, help="v3: the inner optimizer's peak lr")
    p.add_argument("--inner", default="adamw", choices=("adamw", "muon"), help="v3: inner optimizer")
    p.add_argument("--model", default="tiny", help="v3: a model preset (tiny, tiny-wide, ...)")
    p.add_argument(
        "--eval-every", type=int, default=None, help="v3: rounds between held-out scores (default: only the last round)"
    )
    p.add_argument(
        "--outer-schedule",
        default="constant",
        help="v6: the outer optimizer's schedule (train.config.OUTER_SCHEDULES: warmup, warmup-cosine, momentum-warmup)",
    )
    p.add_argument("--compress", default=None, help="v3: compress the outer exchange (a compress.parse spec)")
    p.add_argument("--drop", type=float, default=None, help="v3: the fraction of workers that miss each round")
    p.add_argument("--faulty", type=float, default=None, help="v3: a factor on worker 0's Δ every round")
    p.add_argument("--merge-clip", default=None, help="v3: clip each worker's Δ before the merge (median)")
    p.add_argument("--iso-method", default=None, help="v4: comma list of IsoLoCo flatten methods (library or study)")
    p.add_argument("--spectra", default=None, help="v4: JSONL for the error and flatness of every method on Δ")
    a = p.parse_args()
    study = a.part if a.part in ("v2", "v3", "v4") else "v1"
    iso_methods = [None]
    if study == "v4":
        from study.precision import flattens

        names = flattens.register()
        from isoloco_kernels.flatten.iteration_stats import FlattenFallbackWarning
        from isoloco_kernels.flatten.registry import METHODS

        iso_methods = [m for m in (a.iso_method or "").split(",") if m]
        if not iso_methods or any(m not in METHODS for m in iso_methods):
            p.error(f"--part v4 needs --iso-method, a comma list of {tuple(METHODS)}")
        warnings.simplefilter("ignore", FlattenFallbackWarning)  # the records count the fallbacks
        spectra_methods = [m for m in METHODS if m not in ("auto", "eigh", "gram")] + [
            m for m in names if m not in METHODS
        ]
    elif a.iso_method or a.spectra:
        p.error("--iso-method and --spectra are study v4 settings: add --part v4")
    inits = [x for x in a.init.split(",") if x]
    if study == "v1" and (inits != ["gpt2"] or a.vocab != 256 or a.steps != STEPS_PER_WORKER):
        p.error("--init, --vocab and --steps are study v2/v3 settings: add --part v2 or v3")
    v3 = None
    if study in ("v3", "v4"):
        if not a.lrs:
            p.error(f"--part {study} runs the jobs that --lrs names")
        v3 = {
            "batch": a.batch,
            "seq_len": a.seq_len,
            "inner_lr": a.inner_lr,
            "inner": a.inner,
            "model": a.model,
            "eval_every": a.eval_every or a.steps,
        }  # rounds ≤ steps: the last only
        if a.outer_schedule != "constant":  # absent otherwise: the run keys of every earlier record stay as they are
            v3["outer_schedule"] = a.outer_schedule
        if a.compress is not None:  # likewise
            v3["compress"] = a.compress
        for name in ("drop", "faulty", "merge_clip"):  # likewise
            if getattr(a, name) is not None:
                v3[name] = getattr(a, name)
    elif (
        a.batch,
        a.seq_len,
        a.inner_lr,
        a.inner,
        a.model,
        a.eval_every,
        a.outer_schedule,
        a.compress,
        a.drop,
        a.faulty,
        a.merge_clip,
    ) != ((4, 64, 3e-3, "adamw", "tiny", None, "constant", None, None, None, None)):
        p.error(
            "--batch, --seq-len, --inner-lr, --inner, --model, --eval-every, --outer-schedule, --compress, --drop, "
            "--faulty and --merge-clip are "
            "study v3 settings: add --part v3 or v4"
        )
    if a.spectra and Path(a.spectra).resolve().parent == Path(a.out).resolve().parent:
        p.error("--spectra must not sit beside --out: that folder's *.jsonl files are run records")
    torch.set_num_threads(1)  # one core per study process
    torch.use_deterministic_algorithms(True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = study_folder(out)
    seeds = [int(s) for s in a.seeds.split(",")]
    cells = CELLS if a.cells is None else [tuple(int(x) for x in c.split(":")) for c in a.cells.split(",")]
    corpus = load_corpus()
    code = code_version()
    cache = folder / ".tokenizers"  # BPE tokenizers, trained once on the training split
    todo = [(K, H, m, lr, None) for K, H, m, lr in jobs(cells, a.part if study not in ("v3", "v4") else "defaults")]
    best = (a.lrs or "").startswith("best:")
    if a.lrs and not best:  # extend the grid where its best point sits on an edge
        todo = [(K, H, m, lr, mu) for K, H in cells for m, lr, mu in parse_lrs(a.lrs)]
    if study == "v4" and (best or any(m not in ("isoloco", "isoloco-sgd") for _, _, m, _, _ in todo)):
        p.error("--part v4 runs the Iso-C modes (isoloco, isoloco-sgd) at the outer lrs --lrs names")
    # v4: each method on every seed before the next method (the plan lists the methods by priority)
    todo = [
        (K, H, mode, lr, mu, init, seed, im)
        for init in inits
        for K, H, mode, lr, mu in todo
        for im in iso_methods
        for seed in seeds
    ]

    def key_of(seed, K, H, mode, lr, init, settings) -> tuple:
        return run_key(
            {
                "seed": seed,
                "workers": K,
                "inner_steps": H,
                "mode": mode,
                "outer_lr": lr,
                "study": study,
                "init": init,
                "vocab": a.vocab,
                "rounds": a.steps // H,
                "eval_split": "halves",
                "eval_windows": a.eval_windows,
                "v3": settings,
            }
        )

    if best:  # each method's best config so far in the cell, on more seeds
        if study != "v3":
            p.error("--lrs best:MODES picks from study v3's grids: add --part v3")
        from study.common.grids import best_jobs

        grid = {k: v for k, v in v3.items() if k not in OFF_GRID}  # the grid best: reads
        grid_cells = {
            cell_of(key_of(0, K, H, "", None, init, {**grid, "mu": None})) for init in inits for K, H in cells
        }
        if not wait_for_grids(folder, grid_cells):
            print(
                "warning: grid jobs still claimed after an hour (a killed run's claim?): picking from the grid as it is"
            )
        recs = [r for f in results_files(folder) for r in read_jsonl(f)]
        mu0 = {m: mu for m, (_, mu) in OUTER_DEFAULTS.items()}
        mu0.update({v: mu0.get(run) for v, (run, _) in VARIANTS.items()})
        setting = tuple(v3[k] for k in ("batch", "seq_len", "inner", "inner_lr", "model"))
        todo = [
            (K, H, mode, lr, mu, init, seed, None)
            for init in inits
            for K, H in cells
            for mode, lr, mu in best_jobs(
                recs, (K, H, a.steps // H, a.vocab, init, *setting), a.lrs[5:].split(","), mu0
            )
            for seed in seeds
        ]
    if study == "v2":  # the paired DiLoCo / IsoLoCo runs of every init first, seed by seed; then the rest
        todo.sort(key=lambda j: (j[2] not in ("diloco", "isoloco"), j[6]))
    for K, H, mode, lr, mu, init, seed, iso_method in todo:
        if (folder / STOP_FILE).exists():  # a plan stopped between runs, no run cut short
            print(f"{folder / STOP_FILE} exists: no more runs", flush=True)
            break
        rounds = a.steps // H
        if rounds < 1:
            p.error(f"--steps {a.steps} is less than one round at H = {H}")
        settings = None if v3 is None else {**v3, "mu": mu}
        if iso_method is not None:
            settings["iso_method"] = iso_method
        k = key_of(seed, K, H, mode, lr, init, settings)
        if k in finished(folder) or not claim(folder, k):
            continue
        run, fields = VARIANTS.get(mode, (mode, {}))
        if v3 is not None:
            fields = {**fields, **{V3_SETTINGS[n][0]: v for n, v in v3.items()}}
        cfg = TrainConfig(
            workers=K,
            inner_steps=H,
            rounds=rounds,
            seed=seed,
            init=V2_INITS.get(init, init) if study == "v2" else init,
            vocab=a.vocab,
            divergence=study == "v2",
            eval_windows=a.eval_windows,
            **fields,
        )
        if lr is not None:
            cfg = replace(cfg, outer_lr={run: lr})
        if mu is not None:
            cfg = replace(cfg, outer_momentum={run: mu})
        capture, captured = None, {}
        if iso_method is not None:
            cfg = replace(cfg, iso_method=iso_method)
            stats = METHODS[iso_method].stats
            if stats is not None:
                stats.reset()
            if a.spectra and seed == 0 and iso_method == "svd":
                capture = capture_rounds(captured, {1, (rounds + 1) // 2, rounds})
        t0, c0 = time.perf_counter(), time.process_time()
        r = run_mode(run, Setup(cfg, corpus, cache_dir=cache), capture=capture)
        r.update(
            mode=mode,
            seed=seed,
            workers=K,
            inner_steps=H,
            rounds=cfg.rounds,
            outer_lr=lr,
            eval_split="halves",
            eval_windows=a.eval_windows,
            cpu_s=time.process_time() - c0,
            wall_s=time.perf_counter() - t0,
            code=code,
        )
        if study in ("v2", "v3", "v4"):
            r.update(study=study, init=init, vocab=a.vocab)
        if settings is not None:
            r["v3"] = settings
        if iso_method is not None:
            r.update(study="v4", iso_method=iso_method)
            if stats is not None:
                last = stats.last()
                r["flatten_stats"] = {"matrices": last.matrices, "recomputed": last.recomputed}
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")
        if captured:
            write_spectra(Path(a.spectra), k, captured, spectra_methods, rounds)
        fl = "diverged" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        print(
            f"seed {seed} K={K} H={H} {mode} lr={lr} μ={mu} {init} vocab {a.vocab} {settings or ''}: final {fl}  "
            f"({r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s cpu)",
            flush=True,
        )


if __name__ == "__main__":
    main()
