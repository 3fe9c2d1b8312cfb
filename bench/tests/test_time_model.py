"""bench/time_model.py: the calibration reproduces the run it was fitted on, every candidate is
priced from the registry's own work models, and the committed table is what the script prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import time_model as tm
from isoloco_kernels.flatten import polar
from isoloco_kernels.flatten import registry as flatten

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run():
    return tm.load_run(tm.RUN)


def test_fitted_efficiencies_are_fractions_of_the_ceilings(run):
    eff = tm.fit_efficiency(run)
    assert set(eff) == {"fp32", "fp64", "bf16", "tf32x3", "tf32x2"}
    assert all(0.05 < e <= 1.0 for e in eff.values()), eff


@pytest.mark.parametrize("candidate", ["polar", "gram", "auto", "polar_bf16 as run"])
def test_calibration_reproduces_the_run_it_was_fitted_on(run, candidate):
    """One efficiency per GEMM unit, fitted over both sets, predicts each measured median within
    15 % (the spread between the two sets' own efficiencies)."""
    ceil, eff = tm.ceilings_of(run), tm.fit_efficiency(run)
    medians = tm._medians(run)
    impl = tm.MEASURED_NAMES[candidate]
    for set_name in ("llama-178m", "llama-1b"):
        t, flops = tm.predict(candidate, set_name, ceil, eff)
        assert abs(t / medians[(impl, set_name)]["median_s"] - 1) < 0.15, (candidate, set_name)
        if candidate != "polar_bf16 as run":  # the run recorded the FLOPs its model counted
            assert sum(flops.values()) == pytest.approx(sum(medians[(impl, set_name)]["flops"].values()), rel=1e-9)


def test_candidates_are_priced_from_the_registry(run):
    ceil, eff = tm.ceilings_of(run), tm.fit_efficiency(run)
    _, flops = tm.predict("fast", "llama-178m", ceil, eff)
    want: dict = {}
    for b, m, n in tm.bucket_shapes([s for _, s in tm.decoder_weight_shapes(tm.SETS["llama-178m"])]):
        for u, f in flatten.flops_per_dtype("fast", max(m, n), min(m, n), "fp32").items():
            want[u] = want.get(u, 0.0) + b * f
    assert flops == pytest.approx(want)
    assert set(flops) == {polar.TF32X3, polar.TF32X2, "bf16", "fp64"}
    # more work on a slower unit never predicts less time
    t_fast, _ = tm.predict("fast", "llama-1b", ceil, eff)
    t_bf16, _ = tm.predict("bf16 only", "llama-1b", ceil, eff)
    assert t_fast > t_bf16


def test_the_committed_table_is_what_the_script_prints(run):
    committed = (ROOT / "bench" / "results" / "time_model.md").read_text()
    assert tm.table(run) in committed, "regenerate: python bench/time_model.py --out bench/results/time_model.md"


# -- the Nesterov op's bytes per element: the model's extra reads are the reads the checks make ----------


def _tensors(n=3, size=(16, 24)):
    import torch

    g = torch.Generator().manual_seed(0)
    return [[torch.randn(size, generator=g) for _ in range(n)] for _ in range(3)]


def test_nesterov_routes_read_what_the_model_says(monkeypatch):
    """bare: the op reads param, buffer and update once more for its checks; bounds: nothing more; step:
    the optimizer's pass over grads and params, then the op with bounds (its own buffers not re-read)."""
    import torch

    import isoloco_kernels as ik
    from tests.helpers import CheckReads

    per = {r: tm.nesterov_bytes(r) for r in ("bare", "bounds", "step")}
    extra_passes = {r: (v["bytes"] - v["floor"]) // 4 for r, v in per.items()}  # float32: 4 bytes a pass
    reads = CheckReads(monkeypatch)
    P, B, U = _tensors()
    size = sum(p.numel() for p in P)
    torch.ops.isoloco.nesterov_outer_(P, B, U, 0.7, 0.9)
    assert reads.elements == extra_passes["bare"] * size
    bounds = [float(t.abs().max()) for t in (*P, *B, *U)]
    reads.elements = 0
    torch.ops.isoloco.nesterov_outer_(P, B, U, 0.7, 0.9, bounds)
    assert reads.elements == extra_passes["bounds"] * size == 0
    opt = ik.IsoLoCo([p.requires_grad_() for p in P], lr=0.7, momentum=0.9, iso=False)
    for p, u in zip(P, U):
        p.grad = u
    opt.step()  # its momentum buffers made; from now on trusted
    reads.elements = 0
    opt.step()
    assert reads.elements == extra_passes["step"] * size
    assert per["bounds"]["best_share_of_copy"] == 1.0 and per["bare"]["best_share_of_copy"] == 20 / 32
