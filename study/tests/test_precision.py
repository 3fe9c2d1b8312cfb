"""Study v4's comparison flattens (study/precision/flattens.py), its runner settings (--part v4, --iso-method,
--spectra) and its summary (study/precision/v4.py): how exact must the flatten be for training?"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isoloco_kernels.flatten import registry as flatten
from isoloco_kernels.reference import iso_flatten_ref
from study.common.records import run_key
from study.precision import flattens, v4
from study.tests.helpers import study_record
from tests.helpers import flatness as helpers_flatness
from tests.helpers import rel_err

STUDY = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # fresh interpreters that train


@pytest.fixture(scope="module")
def F():
    return flattens


def _matrix(m: int, n: int, sigma, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U diag(σ) Vᵀ in float32, U, V) with random orthonormal U [m, r], V [n, r]."""
    g = torch.Generator().manual_seed(seed)
    s = torch.as_tensor(sigma, dtype=torch.float64)
    r = len(s)
    u, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
    return ((u * s) @ v.T).float(), u, v


def _logspaced(m: int, n: int, cond: float, seed: int = 0) -> torch.Tensor:
    r = min(m, n)
    return _matrix(m, n, torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), r), seed)[0]


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)])
def test_exact_based_flattens_match_reference(F, shape):
    x = _logspaced(*shape, cond=100.0)  # every σ ≥ 1e-2·σ₁: the 1e-3 cut keeps all of them
    ref = iso_flatten_ref(x)
    assert rel_err(F.run_method("svd_cut1e-3", x), ref) < 1e-6
    for name, rel in F.NOISE.items():
        out = F.run_method(name, x)
        assert rel_err(out, ref) == pytest.approx(rel, rel=1e-5)  # the noise has exactly that size
        assert torch.equal(out, F.run_method(name, x))  # seeded by Δ: deterministic


def test_noise_leaves_the_global_generator_alone(F):
    x = _logspaced(16, 8, cond=10.0)
    state = torch.get_rng_state()
    F.run_method("svd_noise1e-1", x)
    assert torch.equal(state, torch.get_rng_state())


def test_pe_bf16_matches_reference_at_bfloat16_accuracy(F):
    x = _logspaced(64, 32, cond=10.0)
    out = F.run_method("pe_bf16", x)
    assert rel_err(out, iso_flatten_ref(x)) < 3e-2
    assert F.flatness(out, x) < 3e-2


def test_pe_bf16_fills_a_null_space_that_polar_bf16_certifies_away(F):
    # rank 4 of 16: the unchecked bfloat16 steps lift round-off in the null directions toward 1
    x = _matrix(32, 16, [1.0, 0.7, 0.4, 0.2])[0]
    assert F.flatness(F.run_method("pe_bf16", x), x) > 0.1
    with pytest.warns(flatten.polar.RECORDER.warning):
        assert F.flatness(F.run_method("polar_bf16", x), x) < 1e-3


def test_ns5_keeps_the_directions_and_spreads_the_spectrum(F):
    x, u, v = _matrix(64, 32, torch.logspace(0, -2, 32))
    out = F.run_method("ns5", x).to(torch.float64)
    core = u.T @ out @ v  # diagonal where the singular directions are x's
    off = core - torch.diag_embed(core.diagonal())
    assert off.norm() / core.norm() < 3e-2
    sx = torch.linalg.svdvals(x.double())
    ratio = core.diagonal() / (sx.sum() / 32)
    assert 0.5 < ratio.min() and ratio.max() < 1.4  # Muon's quintic: σ of X in roughly [0.7, 1.2]
    assert F.flatness(out, x) > 0.15  # not flat
    assert rel_err(out, iso_flatten_ref(x)) < 0.4
    # the output is s̄·X with s̄ = ⟨Δ, X⟩ / r0 (X: the NS5 iterate)
    x3 = F.ns5_factor(x.unsqueeze(0)).double()[0]
    sbar = (x.double() * x3).sum() / 32
    assert torch.allclose(out, sbar * x3, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("tau, kept", [("svd_cut1e-3", 4), ("svd_cut1e-2", 3), ("svd_cut3e-2", 2)])
def test_rank_cut_zeroes_the_tail_before_the_mean(F, tau, kept):
    sigma = [1.0, 0.5, 0.02, 0.005, 1e-4]
    x, u, v = _matrix(8, 5, sigma)
    out = F.run_method(tau, x).to(torch.float64)
    sbar = sum(sigma[:kept]) / 5  # the cut values count as zeros in the mean over r0 = 5
    want = sbar * u[:, :kept] @ v[:, :kept].T
    assert rel_err(out, want) < 1e-6
    so = torch.linalg.svdvals(out)
    assert torch.allclose(so[:kept], torch.full((kept,), sbar, dtype=torch.float64), rtol=1e-5)
    assert so[kept:].max() < 1e-6 * sbar
    assert F.flatness(out, x) == pytest.approx(1.0, abs=1e-5)  # a dropped direction counts as 1


def test_zero_and_batched_inputs(F):
    for name in F.STUDY_FLATTENS:
        assert torch.equal(F.run_method(name, torch.zeros(6, 4)), torch.zeros(6, 4))
        xb = torch.stack([_logspaced(12, 20, 10.0, seed=s) for s in range(3)])
        out = F.run_method(name, xb)
        for b in range(3):  # a batch is its matrices one by one (the noise is seeded by the whole batch)
            if not name.startswith("svd_noise"):
                assert rel_err(out[b], F.run_method(name, xb[b])) < 1e-5


def test_flatness_is_the_tests_definition(F):
    x = _logspaced(40, 24, cond=1e3)
    for name in ("ns5", "fast", "svd_cut1e-2", "svd_noise1e-1"):
        out = F.run_method(name, x)
        assert F.flatness(out, x) == pytest.approx(helpers_flatness(out, x), rel=1e-12)
    err, flat = F.error_and_flatness("svd", x)
    assert err < 1e-6 and flat < 1e-5


def test_register_makes_them_library_methods(F, monkeypatch):
    registry = flatten.Registry(flatten.METHODS)
    monkeypatch.setattr(flatten, "METHODS", registry)  # this test's copy: the library's stays as it is
    names = F.register()
    assert set(names) == set(F.STUDY_FLATTENS) and all(n in registry for n in names)
    from isoloco_kernels import iso_flatten

    x = _logspaced(24, 16, 30.0)
    assert torch.equal(iso_flatten(x, method="ns5"), F.run_method("ns5", x))
    assert F.register() == names  # idempotent


def test_the_library_does_not_export_them(F):
    r = subprocess.run(
        [sys.executable, "-c", "from isoloco_kernels.flatten import METHODS; print(sorted(METHODS))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert not any(name in r.stdout for name in F.STUDY_FLATTENS)


def test_v4_runs_keep_methods_apart_and_measure_spectra(tmp_path):
    out, spectra = tmp_path / "r.jsonl", tmp_path / "spectra" / "s.jsonl"
    cmd = [sys.executable, str(STUDY / "run_study.py"), "--part", "v4", "--cells", "2:2", "--steps", "4"]
    cmd += ["--eval-windows", "4", "--batch", "2", "--seq-len", "16", "--seeds", "0", "--lrs", "isoloco=1.8"]
    cmd += ["--iso-method", "svd,fast,ns5", "--spectra", str(spectra), "--out", str(out)]
    for _ in range(2):  # the second run finds every job finished
        subprocess.run(cmd, check=True, capture_output=True, cwd=STUDY.parent, timeout=600)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["study"], r["iso_method"], r["v3"]["iso_method"]) for r in recs] == [
        ("v4", m, m) for m in ("svd", "fast", "ns5")
    ]
    key = run_key
    assert len({key(r) for r in recs}) == 3
    assert recs[1]["flatten_stats"]["matrices"] > 0 and "flatten_stats" not in recs[2]
    lines = [json.loads(x) for x in spectra.read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2]  # first, middle (= first here) and last of 2 rounds
    assert ast.literal_eval(lines[0]["key"]) == key(recs[0])
    mat = lines[0]["matrices"]["head.weight"]
    assert mat["methods"]["svd"][0] < 1e-6 and mat["methods"]["svd_cut1e-2"][1] > 0.5
    assert {"fast", "ns5", "pe_bf16", "polar_bf16", "svd_noise3e-1"} <= set(mat["methods"])
    s = v4.summarize_v4(recs, lines)
    (row,) = s.values()
    assert row["methods"]["svd"]["change"] is None and row["methods"]["ns5"]["change"]["seeds"] == [0]
    assert row["methods"]["ns5"]["error"]["n"] == 2 * len(lines[0]["matrices"])


def test_v4_settings_need_part_v4(tmp_path):
    cmd = [sys.executable, str(STUDY / "run_study.py"), "--seeds", "0", "--out", str(tmp_path / "r.jsonl")]
    r = subprocess.run(cmd + ["--iso-method", "svd"], capture_output=True, text=True, cwd=STUDY.parent)
    assert r.returncode == 2 and "--part v4" in r.stderr
    cmd += ["--part", "v4", "--lrs", "diloco=0.7"]
    r = subprocess.run(cmd + ["--iso-method", "svd"], capture_output=True, text=True, cwd=STUDY.parent)
    assert r.returncode == 2 and "Iso-C modes" in r.stderr
    r = subprocess.run(cmd + ["--iso-method", "nope"], capture_output=True, text=True, cwd=STUDY.parent)
    assert r.returncode == 2 and "--iso-method" in r.stderr


def _rec(method, seed, test, study="v4", lr=3.2, **extra):
    r = study_record("isoloco", lr, 0.8, seed, test, test, batch=4, mu=None) | {"study": study, **extra}
    if study == "v4":
        r["iso_method"] = r["v3"]["iso_method"] = method
    return r


def test_v4_pairs_each_method_with_svd_and_picks_the_loosest_within_budget():
    base = [2.26, 2.27, 2.28]
    recs = [_rec("svd", s, base[s]) for s in range(3)]
    recs += [_rec("auto", s, base[s] + 1e-8, study="v3") for s in range(3)]  # v3's exact runs join as "auto"
    recs += [_rec("auto", 0, 9.9, study="v3", lr=2.4)]  # another config: not this row's
    recs += [_rec("fast", s, base[s] + d) for s, d in enumerate((0.002, -0.001, 0.002))]
    recs += [_rec("ns5", s, base[s] + d) for s, d in enumerate((0.02, 0.03, 0.025))]
    recs += [_rec("svd_noise3e-1", s, base[s] + d) for s, d in enumerate((0.02, -0.03, 0.05))]  # interval holds 0
    recs += [_rec("svd_cut1e-2", s, base[s] + d) for s, d in enumerate((-0.02, -0.021, -0.019))]
    s = v4.summarize_v4(recs, [])
    (row,) = s.values()
    m = row["methods"]
    assert list(m)[:4] == ["svd", "svd_noise3e-1", "ns5", "fast"]  # the anchor, then loosest first
    assert m["fast"]["change"]["per_seed"] == pytest.approx([0.002, -0.001, 0.002])
    assert m["auto"]["change"]["mean"] == pytest.approx(1e-8) and m["auto"]["change"]["seeds"] == [0, 1, 2]
    v = v4.verdict(s)
    assert v["per_method"]["ns5"]["within"] == []  # +0.025, interval clear of 0
    assert v["per_method"]["svd_noise3e-1"]["within"] == []  # interval holds 0, but the mean is +0.013
    assert v["loosest"] == v["loosest_method"] == "fast"
    assert len(v["cut_gains"]["svd_cut1e-2"]) == 1
    text = v4.markdown_v4(s) + v4.markdown_verdict(v, s)
    assert "| v1/v2 cell | `fast` |" in text and "+0.001 (+0.002, -0.001, +0.002)" in text
    assert "loosest method (the noise diagnostics aside) within it in every cell: `fast`" in text
    recs += [_rec("svd_noise1e-1", s, base[s] + d) for s, d in enumerate((0.001, -0.002, 0.0))]
    v = v4.verdict(v4.summarize_v4(recs, []))
    assert (v["loosest"], v["loosest_method"]) == ("svd_noise1e-1", "fast")
