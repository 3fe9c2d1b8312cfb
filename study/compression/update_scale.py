"""How finely the owner's update must be scaled: the relative error ‖deq(Q(x)) − x‖ / ‖x‖ of 2-bit quantization of
every committed real pseudo-gradient (bench/data/captured: the reference loop's means at K 4, H 30) as it is (the
mean Δ) and after Iso-C (its flat-spectrum output, what the Iso-C owner leg sends), per block of 32 … 1024
entries, per row and per matrix (one scale, or one centroid table, for the whole matrix).

    python -m study.compression.update_scale   # writes study/compression/results/update_scale.json and prints the table

The blocks call the library's own encoders (compress/codec.py `quantize_blocks`, compress/stat.py
`encode_stat_blocks`) on rows of `block` entries; per row and per matrix hand them the matrix's rows, or the
whole matrix as one row. Bytes per entry count the codes (2 bits) and the float32 scales or tables."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from isoloco_kernels import iso_flatten
from isoloco_kernels.compress import Compression
from isoloco_kernels.compress.codec import quantize_blocks
from isoloco_kernels.compress.stat import encode_stat_blocks

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "study" / "compression" / "results" / "update_scale.json"
BLOCKS = (32, 128, 256, 1024)


def _matrices():
    out = []
    for f in sorted((ROOT / "bench" / "data" / "captured").glob("*/*/round_*.pt")):
        for name, d in torch.load(f, weights_only=False)["delta"].items():
            if d.ndim == 2 and min(d.shape) > 1:
                out.append((f"{f.parent.parent.name}/{f.parent.name}/{f.stem}: {name}", d.to(torch.float64)))
    return out


def _decoded(x: torch.Tensor, fmt: str, rows: torch.Tensor) -> torch.Tensor:
    """x's entries after 2-bit quantization of `rows` (x reshaped, each row one block)."""
    nb, b = rows.shape
    if fmt == "stat2":
        deq = encode_stat_blocks(rows, rows.numel(), Compression("stat2", 256))[2]
    else:
        deq = quantize_blocks(rows, Compression("int2", 128), 0, 0, 0)[2]
    return deq.view(-1)[: x.numel()]


def _blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = -flat.numel() % b
    return torch.cat([flat, flat.new_zeros(pad)]).view(-1, b)


def _error(x: torch.Tensor, fmt: str, how) -> float:
    rows = _blocks(x, how) if isinstance(how, int) else (x if how == "row" else x.reshape(1, -1))
    return float((_decoded(x, fmt, rows) - x.reshape(-1)).norm() / x.norm())


def _bits(fmt: str, how, shape) -> float:
    """Bits per entry on the wire: 2 for the code, plus the float32 scale or table per block."""
    floats = 4 if fmt == "stat2" else 1
    n = math.prod(shape)
    blocks = -(-n // how) if isinstance(how, int) else (shape[0] if how == "row" else 1)
    return 2 + 32 * floats * blocks / n


def main() -> dict:
    ways = [*BLOCKS, "row", "matrix"]
    cells: dict = {}
    mats = _matrices()
    for what in ("mean", "iso_c"):
        for fmt in ("int2", "stat2"):
            for how in ways:
                errs, bits = [], []
                for _, d in mats:
                    x = iso_flatten(d) if what == "iso_c" else d
                    errs.append(_error(x, fmt, how))
                    bits.append(_bits(fmt, how, d.shape))
                cells[f"{what} {fmt} {how}"] = {
                    "rel_error_mean": sum(errs) / len(errs),
                    "rel_error_max": max(errs),
                    "bits_per_entry_mean": sum(bits) / len(bits),
                }
    out = {"matrices": len(mats), "cells": cells}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(mats)} matrices; relative error mean (max), bits per entry")
    for key, c in cells.items():
        print(f"{key:24s} {c['rel_error_mean']:.3f} ({c['rel_error_max']:.3f})  {c['bits_per_entry_mean']:.3f}")
    return out


if __name__ == "__main__":
    main()
