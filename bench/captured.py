"""Bucket sets from real pseudo-gradients: the averaged Δ the reference training loop saved.

Synthetic inputs (shapes.pseudo_gradient) have a clean power-law spectrum; real pseudo-gradients
are worse conditioned (bench/results/captured.md). This module turns a folder
written by `python -m isoloco_kernels.train --save-pseudo-gradients DIR` into bucket sets with the
same layout the flatten benchmark uses — a list of [B, m, n] tensors, matrices grouped by shape,
each stored tall (m ≥ n; Iso-C commutes with transposition) — and reports their condition numbers.

The committed sample, bench/data/captured/ (float16, < 2 MB; see bench/results/captured.md for the
commands that made it):

    bytes/isoloco/round_010.pt     tiny model, byte vocabulary, K 4, H 30, the 10th (last) round:
                                   every 2-D matrix (10 matrices, 256×128 … 128×512)
    bpe1024/isoloco/round_010.pt   the same run with --vocab 1024: the 1024×128 embedding and head
                                   and the middle block's 4 matrices (the rest is cut for size)

The files are in capture format 2 (a sha256 per tensor, checked at every load): the float16 files
first committed (format 1) were rewritten on 2026-12-03 with `slim` (every round and parameter, same
dtype), tensors bit-identical, so the checksums certify the bytes as committed, from then on.
Each file also holds `cond`: σ₁/σ_min of every matrix in float32, before the float16 cast. The
cast perturbs every entry by ~2.4e-4 relative, so condition numbers above ~1e3 are lower in the
stored matrices than in the run; `load_captured_sets` reports both.

Hook into a benchmark:

    from bench.captured import load_captured_sets
    for name, entry in load_captured_sets(device=device, dtype=dtype).items():
        entry["shapes"]  # [(B, m, n)], largest first, like shapes.bucket_shapes
        entry["src"]     # [B, m, n] tensors on `device` in `dtype` (never modify: clone first)
        entry["names"]   # per bucket, the parameter names of its matrices (transposed ones marked ᵀ)
        entry["cond"], entry["cond_stored"]  # per bucket, κ of each matrix (float32 run / as stored)

    python -m bench.captured report [DIR ...]      # condition numbers → markdown on stdout
    python -m bench.captured slim SRC DST --keep tok.weight,head.weight,blocks.1. --dtype float16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from isoloco_kernels.train.capture import SAVE_DTYPES, load_pseudo_gradients, save_capture

DATA = Path(__file__).resolve().parent / "data" / "captured"

__all__ = ["DATA", "load_captured_sets", "condition_number", "report", "slim"]


def condition_number(x: torch.Tensor) -> float:
    """σ₁/σ_min in float64 (inf for a singular matrix)."""
    s = torch.linalg.svdvals(x.detach().double().cpu())
    return float(s[0] / s[-1]) if float(s[-1]) > 0 else float("inf")


def _label(blob: dict) -> str:
    # <capture>/<mode>/round_NNN.pt → "captured-<capture>-<mode>-r<N>"
    return "captured-" + blob["run"].replace("/", "-") + f"-r{blob['round']}"


def load_captured_sets(
    folders: str | os.PathLike | list | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, dict]:
    """{set name: {"shapes", "src", "names", "cond", "cond_stored", "ref": None, "rounds"}}.

    One set per saved round (every round_*.pt under each folder; default: the committed sample).
    Only 2-D tensors enter the buckets; the 1-D norm gains are not flattened by IsoLoCo.
    """
    if folders is None:
        folders = [DATA]
    elif not isinstance(folders, (list, tuple)):
        folders = [folders]
    sets: dict[str, dict] = {}
    for folder in folders:
        root = Path(folder)
        for blob in load_pseudo_gradients(root):
            groups: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = defaultdict(list)
            for name, t in blob["delta"].items():
                if t.ndim != 2:
                    continue
                m, n = t.shape
                groups[(max(m, n), min(m, n))].append((name if m >= n else name + "ᵀ", t if m >= n else t.mT))
            order = sorted(groups, key=lambda k: -len(groups[k]) * k[0] * k[1])
            src = [torch.stack([t for _, t in groups[k]]).to(device=device, dtype=dtype) for k in order]
            names = [[n for n, _ in groups[k]] for k in order]
            cond_run = blob.get("cond", {})
            sets[_label(blob)] = {
                "shapes": [(len(groups[k]), k[0], k[1]) for k in order],
                "src": src,
                "names": names,
                "cond": [[cond_run.get(n.rstrip("ᵀ")) for n in ns] for ns in names],
                "cond_stored": [[condition_number(x) for x in b] for b in src],
                "stored_dtype": str(next(iter(blob["delta"].values())).dtype).replace("torch.", ""),
                "config": blob.get("config", {}),
                "ref": None,
            }
    return sets


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    return "inf" if x == float("inf") else f"{x:.3g}"


def report(sets: dict[str, dict]) -> str:
    """A markdown table: per set and per matrix group, median and max condition number."""
    lines = [
        "| set | stored as | matrices | κ median (run, fp32) | κ max (run, fp32) | κ median (stored) | κ max (stored) | worst matrix (run) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, e in sets.items():
        names = [n for ns in e["names"] for n in ns]
        run = [c for cs in e["cond"] for c in cs]
        stored = [c for cs in e["cond_stored"] for c in cs]
        have = [c for c in run if c is not None]
        worst = names[run.index(max(have))] if have else "—"
        lines.append(
            f"| {name} | {e['stored_dtype']} | {len(names)} | {_fmt(statistics.median(have) if have else None)} | "
            f"{_fmt(max(have) if have else None)} | {_fmt(statistics.median(stored))} | {_fmt(max(stored))} | {worst} |"
        )
    lines += ["", "Per matrix (κ in the run, float32 → κ as stored):", ""]
    for name, e in sets.items():
        cells = [
            f"{n} {tuple(b.shape[1:])} {_fmt(c)} → {_fmt(cs)}"
            for ns, b, cr, cst in zip(e["names"], e["src"], e["cond"], e["cond_stored"])
            for n, c, cs in zip(ns, cr, cst)
        ]
        lines.append(f"- {name}: " + "; ".join(cells))
    return "\n".join(lines)


def slim(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    rounds: list[int] | None = None,
    keep: list[str] | None = None,
    dtype: str = "float16",
    modes: list[str] | None = None,
) -> list[Path]:
    """Copy saved rounds from src to dst, keeping only some rounds/modes/parameters, cast to dtype.

    keep: parameter-name prefixes (None: every parameter). The float32 condition numbers stay.
    The copies are written in the current format (capture.py), with checksums: slimming a format 1
    capture onto itself with its own dtype and every parameter rewrites it in format 2, tensors
    bit-identical. A cast that overflows the dtype is refused (CaptureError), writing nothing more.
    """
    if dtype not in SAVE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
    out = []
    for blob in load_pseudo_gradients(src):
        if rounds and blob["round"] not in rounds or modes and blob["mode"] not in modes:
            continue
        delta = {
            n: t.to(SAVE_DTYPES[dtype])
            for n, t in blob["delta"].items()
            if keep is None or any(n.startswith(k) for k in keep)
        }
        cond = {n: c for n, c in blob.get("cond", {}).items() if n in delta}
        path = Path(dst) / blob["run"] / Path(blob["path"]).name
        out.append(
            save_capture(path, round=blob["round"], mode=blob["mode"], config=blob["config"], cond=cond, delta=delta)
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.captured")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="condition numbers of captured sets, as markdown")
    r.add_argument("folders", nargs="*", help="capture folders (default: the committed sample)")
    s = sub.add_parser("slim", help="copy a capture keeping some rounds/parameters, cast down")
    s.add_argument("src")
    s.add_argument("dst")
    s.add_argument("--rounds", default=None, help="comma list of rounds (default: all)")
    s.add_argument("--modes", default=None, help="comma list of modes (default: all)")
    s.add_argument("--keep", default=None, help="comma list of parameter-name prefixes (default: all)")
    s.add_argument("--dtype", default="float16", choices=sorted(SAVE_DTYPES))
    a = p.parse_args(argv)
    if a.cmd == "report":
        print(report(load_captured_sets(a.folders or None)))
    else:
        split = lambda x: None if x is None else [v for v in x.split(",") if v]
        rounds = None if a.rounds is None else [int(v) for v in split(a.rounds)]
        for path in slim(a.src, a.dst, rounds=rounds, keep=split(a.keep), dtype=a.dtype, modes=split(a.modes)):
            print(path, f"{path.stat().st_size / 1e6:.2f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
