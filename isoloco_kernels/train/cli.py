"""`python -m isoloco_kernels.train`: train DDP / DiLoCo / IsoLoCo on the same data and compare.

With no flags: K=8 workers, H=30 inner steps, 12 rounds, the tiny (~0.5M) byte-level model on
Python's standard-library source; prints a table of final held-out loss per mode, on the
selection and the test split of the held-out text, and writes results.json and loss.png under
--out. --vocab N trains a BPE tokenizer on the training split first (cached in --out); --init picks
the initialisation, --inner the inner optimizer; --save-pseudo-gradients DIR saves the averaged Δ
of chosen rounds. Every option, the data, the memory the run needs and every output folder (by
writing a file there) are checked before any training starts.

Under torchrun (`torchrun --nproc_per_node=K -m isoloco_kernels.train ...`) each of the K ranks trains
one worker and the ranks average over torch.distributed (dist.py); --outer sharded splits the outer
step over the ranks.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from .args import SWEEPABLE, build_parser
from .capture import SAVE_DTYPES, PseudoGradientWriter, parse_rounds
from .config import MERGING_MODES, OUTER_DEFAULTS, TrainConfig, check_device
from .data import check_fits, load_corpus
from .dist import check_outer, torchrun_launch
from .loop import Comm, Setup, check_memory, run_mode
from .optimizers import check_outer_step
from .report import mode_table, outer_note, plot, sweep_table
from .tokenizer import tokenize


def check_folder(flag: str, path: str | os.PathLike, files: Sequence[str] = ()) -> None:
    """A folder the run will create or write into, checked by writing: the missing folders are
    created, a file is written in the deepest and removed, and the folders the probe made are
    removed again. ValueError names the path when it, or a parent, is a file, when the write fails
    (a read-only mount, a full disk, /proc: whatever os.access says), or when one of `files` (names
    the run will write there) exists and is not a file."""
    p = Path(path)
    first = next(q for q in (p, *p.parents) if q.exists() or q.is_symlink())
    if not first.is_dir():
        what = "is" if first == p else f"lies under {first}, which is"
        raise ValueError(f"{flag} {path} {what} a file, not a folder")
    made = []
    try:
        for q in reversed(p.parents[: len(p.parents) - len(first.parents) - 1] if first != p else ()):
            q.mkdir()
            made.append(q)
        if first != p:
            p.mkdir()
            made.append(p)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=p)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror}: {e.filename})") from None
    finally:
        for q in reversed(made):
            try:
                q.rmdir()
            except OSError:
                pass
    for name in files:
        f = p / name
        if (f.exists() or f.is_symlink()) and not f.is_file():
            raise ValueError(f"{flag} {path}: {f} exists and is not a file, so it cannot be written")


def check_disk(flag: str, path: str | os.PathLike, need: int) -> None:
    """ValueError when the file system holding path (or its nearest existing parent) has less than
    `need` bytes free."""
    p = Path(path)
    first = next(q for q in (p, *p.parents) if q.exists())
    free = shutil.disk_usage(first).free
    if need > free:
        raise ValueError(
            f"{flag} {path}: the run would write {need / 2**30:.2f} GiB there but "
            f"{free / 2**30:.2f} GiB is free; save fewer rounds (--save-rounds) or a smaller "
            "--save-dtype"
        )


def capture_run(mode: str, param: str | None, value) -> str:
    """The sub-folder of --save-pseudo-gradients one run writes: the mode, plus the swept value."""
    return mode if param is None else f"{mode}_{param}{value}"


def _progress_factory(quiet: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None

    def make(label: str, total: int):
        if quiet or tqdm is None:
            return None, (lambda: None)
        bar = tqdm(total=total, desc=label, unit="step", leave=True, dynamic_ncols=True)
        last = [0]

        def cb(done, loss):
            bar.update(done - last[0])
            last[0] = done
            if loss is not None and done % 10 == 0:
                bar.set_postfix_str(f"held-out {loss:.3f}", refresh=False)

        return cb, bar.close

    return make


def main(argv=None) -> int:
    parser = build_parser()
    launch = torchrun_launch(parser)  # None unless started by torchrun: then one worker per rank
    a = parser.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cpus = os.cpu_count() or 1
    if a.threads is not None and not 1 <= a.threads <= cpus:
        parser.error(f"--threads must be in 1..{cpus} (this machine's CPUs), got {a.threads}")
    outer_modes = [m for m in a.mode if m in OUTER_DEFAULTS]
    per_mode = lambda v: {m: v for m in outer_modes} if isinstance(v, float) else (v or {})
    outer_lr, outer_momentum = per_mode(a.outer_lr), per_mode(a.outer_momentum)
    same = ("model", "workers", "inner_steps", "rounds", "batch", "seq_len", "tie_embeddings", "inner_lr", "warmup")
    same += (
        "inner",
        "iso_method",
        "merge",
        "outer_schedule",
        "eval_windows",
        "seed",
        "vocab",
        "init",
        "iso_skip_outer",
        "compress",
        "drop",
        "faulty",
        "merge_clip",
    )
    base = TrainConfig(
        **{k: getattr(a, k) for k in same},  # the flags named as TrainConfig's fields
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        device=device,
        divergence=not a.no_divergence,
        iso_skip=tuple(x for x in a.iso_skip.split(",") if x),
    )
    param, values = a.sweep if a.sweep else (None, [None])
    cfgs = [base if param is None else replace(base, **{SWEEPABLE[param]: v}) for v in values]
    # Every check runs before any training: settings, data, and that the data fits each config.
    save_rounds = {}
    try:
        check_device(device)
        for c in cfgs:
            c.validate()
        if a.merge != "iso_c" and not any(m in MERGING_MODES for m in a.mode):
            raise ValueError(
                f"--merge {a.merge} applies to the Iso-C modes ({', '.join(MERGING_MODES)}); --mode {','.join(a.mode)} "
                "has none of them, so it would be ignored"
            )
        # options of the outer step, given to modes that have none (ddp alone): refused, not ignored
        unused = [(f"--compress {a.compress}", a.compress is not None)]
        unused.append((f"--outer-schedule {a.outer_schedule}", a.outer_schedule != "constant"))
        unused += [(f"--drop {a.drop}", a.drop > 0), (f"--faulty {a.faulty}", a.faulty != 1)]
        unused.append((f"--merge-clip {a.merge_clip}", a.merge_clip is not None))
        for flag, given in unused:
            if given and not outer_modes:
                raise ValueError(
                    f"{flag} applies to the modes with an outer step ({', '.join(OUTER_DEFAULTS)}); --mode "
                    f"{','.join(a.mode)} has none of them, so it would be ignored"
                )
        check_outer(launch, cfgs, param, device, a.outer)
        if launch is not None and base.ragged():
            raise ValueError(
                "--drop, --faulty and --merge-clip simulate the workers in one process; not under torchrun"
            )
        if a.compress is not None and launch is not None and a.outer != "sharded":
            raise ValueError("--compress under torchrun needs --outer sharded (an all-reduce cannot sum packed bytes)")
        check_folder("--out", a.out, ["results.json", "loss.png"])
        if a.save_pseudo_gradients is not None:
            save_rounds = {c.rounds: parse_rounds(a.save_rounds, c.rounds) for c in cfgs}
            if not any(m in OUTER_DEFAULTS for m in a.mode):
                raise ValueError("--save-pseudo-gradients needs a mode with an outer step (not ddp alone)")
            check_folder("--save-pseudo-gradients", a.save_pseudo_gradients)
            need = 0
            for v, c in zip(values, cfgs):
                per_round = c.n_params() * SAVE_DTYPES[a.save_dtype].itemsize
                for m in (m for m in a.mode if m in OUTER_DEFAULTS):
                    run = capture_run(m, param, v)
                    check_folder(
                        "--save-pseudo-gradients",
                        Path(a.save_pseudo_gradients) / run,
                        []
                        if len(save_rounds[c.rounds]) > 1000
                        else [f"round_{r:03d}.pt" for r in save_rounds[c.rounds]],
                    )
                    need += len(save_rounds[c.rounds]) * per_round
            check_disk("--save-pseudo-gradients", a.save_pseudo_gradients, need)
        corpus = load_corpus(a.data, a.max_bytes)
        for c in cfgs:  # tokens ≤ bytes: what does not fit in bytes does not fit in tokens
            check_fits(corpus, c.workers, c.batch, c.model_config().seq_len)
        # before the tokenizer trainer allocates for the vocabulary
        check_memory(cfgs, a.mode, lambda c: 1 if launch is not None else c.workers)
        for c in cfgs:  # each outer step once, on stand-in params (K is bounded by now): what it cannot run fails here
            for m in a.mode:
                check_outer_step(m, c)
        corpus = tokenize(corpus, a.vocab, a.out)  # byte-level: unchanged; BPE: trained or loaded
        for c in cfgs:
            check_fits(corpus, c.workers, c.batch, c.model_config().seq_len)
    except ValueError as e:
        parser.error(str(e))
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    if launch is not None:
        launch.start(device)

    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=device.startswith("cuda"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    make_progress = _progress_factory(a.quiet)
    say = print
    if launch is not None:
        make_progress = launch.progress(make_progress)
        say = print if launch.is_main else (lambda *args, **kwargs: None)
    t_start = time.perf_counter()
    setup0 = Setup(cfgs[0], corpus)
    say(
        f"model {a.model}: {setup0.n_params:,} params, seq {setup0.mcfg.seq_len}, vocab {a.vocab}, init {a.init}, "
        f"inner {a.inner}; "
        f"data: {corpus.source}, {corpus.train.numel():,} train / {corpus.heldout.numel():,} held-out "
        f"{corpus.unit}; device {device}",
        file=sys.stderr,
    )
    per_value = []
    for v, c in zip(values, cfgs):
        setup = setup0 if c is cfgs[0] else Setup(c, corpus)
        if min(setup.eval_windows) < c.eval_windows and c is cfgs[0]:
            say(
                f"warning: --eval-windows {c.eval_windows}: each half of the held-out text holds only "
                f"{setup.eval_windows[0]} / {setup.eval_windows[1]} windows of {setup.mcfg.seq_len} {corpus.unit} "
                "(selection / test); those are scored",
                file=sys.stderr,
            )
        runs = []
        for m in a.mode:
            tag = m if param is None else f"{m} {param}={v}"
            cb, close = make_progress(tag, c.workers * c.inner_steps * c.rounds)
            capture = None
            if a.save_pseudo_gradients is not None and m in OUTER_DEFAULTS and (launch is None or launch.is_main):
                capture = PseudoGradientWriter(
                    a.save_pseudo_gradients,
                    capture_run(m, param, v),
                    save_rounds[c.rounds],
                    a.save_dtype,
                    m,
                    c.as_dict(),
                )
            try:
                runs.append(
                    run_mode(m, setup, Comm(c.workers) if launch is None else launch.comm(c), cb, capture=capture)
                )
            finally:
                close()
            if launch is not None:
                launch.check_run(runs[-1])
            if "diverged" in runs[-1]:
                say(f"warning: {tag} diverged: {runs[-1]['diverged']}", file=sys.stderr)
        per_value.append(runs)

    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu_threads": torch.get_num_threads(),
            "device": device,
            "torch": torch.__version__,
        },
        "data": corpus.describe(),
        "params": setup0.n_params,
        "wall_s": time.perf_counter() - t_start,
    }
    if param is None:
        result.update(config=base.as_dict(), modes={r["mode"]: r for r in per_value[0]})
        table = mode_table(per_value[0])
        note = outer_note(per_value[0], base.workers)
        table += f"\n\n{note}" if note else ""
    else:
        result.update(
            config=base.as_dict(),
            sweep={
                "param": param,
                "values": values,
                "runs": [
                    {"config": c.as_dict(), "modes": {r["mode"]: r for r in runs}} for c, runs in zip(cfgs, per_value)
                ],
            },
        )
        table = sweep_table(param, values, per_value)
    if a.save_pseudo_gradients is not None:
        result["pseudo_gradients"] = {
            "dir": a.save_pseudo_gradients,
            "dtype": a.save_dtype,
            "rounds": {str(k): list(v) for k, v in save_rounds.items()},
        }
    if launch is not None:
        result["launch"] = launch.describe()
        launch.close()
        if not launch.is_main:
            return 0
    (out / "results.json").write_text(json.dumps(result, indent=1))
    wrote_png = plot(out / "loss.png", per_value, param, values)
    print(table)
    print(
        f"\nwall {result['wall_s']:.0f} s; wrote {out / 'results.json'}"
        + (f" and {out / 'loss.png'}" if wrote_png else " (no PNG: matplotlib is not installed)")
    )
    return 0
