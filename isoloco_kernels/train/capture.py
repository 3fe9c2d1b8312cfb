"""Saving and loading the averaged pseudo-gradients of chosen rounds (--save-pseudo-gradients DIR).

Layout: DIR/<run>/round_<r>.pt, one file per saved round, <run> the mode (plus the swept value in
a sweep). Each file is a dict (format 2)

    format     2
    round      the 1-based round (the Δ the r-th outer step consumed)
    mode       the training mode
    delta      {parameter name: averaged Δ = mean_k(θ − θ_k)}, on the CPU, in the saved dtype
    checksums  {name: sha256 of that tensor's dtype, shape and bytes}
    cond       {name: σ₁/σ_min of the float32 Δ before any down-cast} for the 2-D ones
    config     the run's TrainConfig as a dict

Load with `load_pseudo_gradients(DIR)`; bench/captured.py builds bucket sets from them. Every file
is checked as it loads, and a bad one is a `CaptureError` (a ValueError) naming the file and what is
wrong: empty, cut short or not a torch file, a missing key, a tensor whose bytes do not match their
checksum, a non-finite entry. Format 1 files (written before checksums: no "format" key) still load,
with a `CaptureFormatWarning` saying their bytes cannot be verified; `python -m bench.captured slim`
rewrites them in format 2.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

import torch

from .divergence import spectrum

SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FORMAT = 2  # the format written; 1 (no checksums) is still read
KEYS = ("round", "mode", "config", "cond", "delta")  # every format; format 2 adds "format", "checksums"


class CaptureError(ValueError):
    """A saved pseudo-gradient file that cannot be used; the message names the file."""


class CaptureFormatWarning(UserWarning):
    """A format 1 file: it has no checksums, so corrupted bytes that stay finite go unseen."""


def tensor_checksum(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (C order): the same on every machine."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)}:".encode())
    h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b"")
    return h.hexdigest()


def save_capture(path: str | os.PathLike, *, round: int, mode: str, config: dict, cond: dict, delta: dict) -> Path:
    """Write one saved round in the current format, atomically (a reader never sees half a file).

    Raises CaptureError, writing nothing, when a tensor is not finite (a cast to a narrower dtype
    that overflowed, or a Δ that already was not).
    """
    path = Path(path)
    for n, t in delta.items():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise CaptureError(
                f"{path}: tensor {n} has {bad} non-finite entries of {t.numel()} in {str(t.dtype).removeprefix('torch.')}"
                " (does the Δ fit that dtype? --save-dtype float32 keeps it)"
            )
    blob = {
        "format": FORMAT,
        "round": round,
        "mode": mode,
        "config": config,
        "cond": cond,
        "delta": delta,
        "checksums": {n: tensor_checksum(t) for n, t in delta.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(blob, tmp)
    os.replace(tmp, path)
    return path


def load_capture(path: str | os.PathLike) -> dict:
    """One saved round, checked (see the module docstring); CaptureError names the file and the fault."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CaptureError(f"{path}: cannot be read ({e.strerror})") from None
    if size == 0:
        raise CaptureError(f"{path} is empty (0 bytes)")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except (
        EOFError,
        OSError,
        RuntimeError,
        pickle.UnpicklingError,
        zipfile.BadZipFile,
        ValueError,
        KeyError,
        AttributeError,
        TypeError,
        IndexError,
        UnicodeDecodeError,
    ) as e:
        raise CaptureError(
            f"{path} is not a readable torch file, truncated or corrupted "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if not isinstance(blob, dict):
        raise CaptureError(f"{path} holds a {type(blob).__name__}, not a saved round (a dict)")
    fmt = blob.get("format", 1)
    if fmt not in (1, FORMAT):
        raise CaptureError(f"{path} has format {fmt!r}; this version reads formats 1 and {FORMAT}")
    missing = [k for k in KEYS + (("checksums",) if fmt == FORMAT else ()) if k not in blob]
    if missing:
        raise CaptureError(f"{path} lacks {', '.join(missing)}: not a complete saved round")
    delta = blob["delta"]
    if (
        not isinstance(delta, dict)
        or not delta
        or not all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in delta.items())
    ):
        raise CaptureError(f"{path}: 'delta' must be a non-empty dict of parameter name → tensor")
    if not isinstance(blob["cond"], dict) or not isinstance(blob["config"], dict):
        raise CaptureError(f"{path}: 'cond' and 'config' must be dicts")
    if isinstance(blob["round"], bool) or not isinstance(blob["round"], int) or blob["round"] < 1:
        raise CaptureError(f"{path}: 'round' must be an integer ≥ 1, got {blob['round']!r}")
    if fmt == FORMAT:
        sums = blob["checksums"]
        if not isinstance(sums, dict) or set(sums) != set(delta):
            extra = sorted(set(sums) ^ set(delta)) if isinstance(sums, dict) else "all"
            raise CaptureError(f"{path}: the checksums do not list exactly the saved tensors (differ in {extra})")
        for n, t in delta.items():
            if tensor_checksum(t) != sums[n]:
                raise CaptureError(f"{path}: tensor {n} does not match its checksum: the file is corrupted")
    else:
        warnings.warn(
            f"{path}: no checksum (format 1): corrupted bytes that stay finite cannot be detected; "
            "`python -m bench.captured slim` rewrites it in format 2",
            CaptureFormatWarning,
            stacklevel=3,
        )
    for n, t in delta.items():
        bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
        if bad:
            raise CaptureError(f"{path}: tensor {n} has {bad} non-finite entries of {t.numel()}")
    blob["format"] = fmt
    return blob


def parse_rounds(spec: str, rounds: int) -> Sequence[int]:
    """'all' (a range: never a list of every round), or a sorted list of 1-based rounds from a comma
    list of numbers and 'first', 'mid', 'last'."""
    if spec == "all":
        return range(1, rounds + 1)
    names = {"first": 1, "mid": (rounds + 1) // 2, "last": rounds}
    out = set()
    for part in spec.split(","):
        part = part.strip()
        if part in names:
            out.add(names[part])
            continue
        try:
            r = int(part)
        except ValueError:
            raise ValueError(
                f"--save-rounds takes all, or a comma list of rounds/first/mid/last, got {spec!r}"
            ) from None
        if not 1 <= r <= rounds:
            raise ValueError(f"--save-rounds: round {r} is outside 1..{rounds} (the run has {rounds} rounds)")
        out.add(r)
    return sorted(out)


class PseudoGradientWriter:
    """The capture callback of one run: writes the chosen rounds under folder/run."""

    def __init__(self, folder: str | os.PathLike, run: str, rounds: Iterable[int], dtype: str, mode: str, config: dict):
        if dtype not in SAVE_DTYPES:
            raise ValueError(f"save dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
        self.dir = Path(folder) / run
        self.rounds = rounds if isinstance(rounds, range) else set(rounds)
        self.dtype = SAVE_DTYPES[dtype]
        self.mode, self.config = mode, config
        self.written: list[Path] = []

    def __call__(self, rnd: int, names: Sequence[str], mean_delta: Sequence[torch.Tensor]) -> None:
        if rnd not in self.rounds:
            return
        cond = {n: spectrum(d)["cond"] for n, d in zip(names, mean_delta) if d.ndim == 2}
        delta = {n: d.detach().to("cpu", self.dtype, copy=True) for n, d in zip(names, mean_delta)}
        path = save_capture(
            self.dir / f"round_{rnd:03d}.pt", round=rnd, mode=self.mode, config=self.config, cond=cond, delta=delta
        )
        self.written.append(path)


def load_pseudo_gradients(folder: str | os.PathLike) -> list[dict]:
    """Every saved round under folder (recursively), sorted by run and round, each checked by
    `load_capture`; each dict as saved plus "run" (its folder relative to `folder`) and "path"."""
    root = Path(folder)
    if not root.is_dir():
        raise CaptureError(f"pseudo-gradient folder {root} does not exist")
    out = []
    for p in sorted(root.rglob("round_*.pt")):
        blob = load_capture(p)
        blob["run"] = p.parent.relative_to(root).as_posix()
        blob["path"] = str(p)
        out.append(blob)
    return out
