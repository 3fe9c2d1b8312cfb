"""Study v5 part A's mechanism measures and report (study/capacity/v5_mechanism.py) on spectra and records whose
answer is known."""

from __future__ import annotations

import json
import math

import pytest
import torch

from study.capacity import v5_mechanism as vm


def test_mechanism_measures_of_known_spectra():
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(40, 8, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(8, 8, generator=g, dtype=torch.float64))  # Δ is 40 × 8: r = 8
    flat = vm.spectrum_stats(u @ v.mT)  # 8 equal singular values
    assert flat["r"] == 8 and flat["eff_rank"] == pytest.approx(8) and flat["flat"] == pytest.approx(1)
    assert flat["iso_move"] == pytest.approx(0, abs=1e-12)  # Iso-C leaves a flat Δ where it is
    s = torch.tensor([1.0, 0.5, 0.25, 0.125, 0, 0, 0, 0], dtype=torch.float64)
    steep = vm.spectrum_stats((u * s) @ v.mT)
    p = s[:4] / s[:4].sum()
    assert steep["eff_rank"] == pytest.approx(math.exp(-(p * p.log()).sum()), rel=1e-9)
    assert steep["flat"] == pytest.approx(float(s.sum() / 8 / 1.0))  # σ̄ over all r = 8 values
    want = 1 - float(s.sum() / (s.norm() * math.sqrt(4)))  # cos(Δ, UVᵀ over the 4 kept directions)
    assert steep["iso_move"] == pytest.approx(want, rel=1e-9)


def test_mechanism_report_reads_its_records(tmp_path, monkeypatch):
    out = tmp_path / "m.jsonl"
    monkeypatch.setattr(vm, "OUT", out)
    spectra = {str(r): {"w": {"r": 8, "eff_rank": 4.0, "flat": 0.5, "iso_move": 0.1}} for r in vm.ROUNDS_SEEN}
    cell = next(iter(vm.CELLS))
    with out.open("w") as f:
        for mode, base in (("diloco", 2.0), ("isoloco", 1.9)):
            loss = [base + 1 - 0.1 * k for k in range(11)]
            f.write(json.dumps({"cell": cell, "mode": mode, "heldout_loss": loss, "spectra": spectra}) + "\n")
    text = vm.report()
    assert f"| {cell} | -0.100 / -0.100 / -0.100 | 0.50 → 0.50 | 0.500 → 0.500 | 0.100 → 0.100 |" in text
    assert vm.done() == {(cell, "diloco"), (cell, "isoloco")}
    vm.plot(tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 1000
