"""method="polar" (the Polar Express iteration, torch GEMMs on the CPU) against reference.py: its
schedule, accuracy on spectra, fallback, bf16 mode, GEMM choice, TF32 handling and auto's float64
rate. The contract every method keeps is tests/flatten/test_methods.py."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.flatten import coefficients, exact, gram, polar
from isoloco_kernels.flatten.gram import GramFallbackWarning
from isoloco_kernels.flatten.iteration_stats import FlattenFallbackWarning
from isoloco_kernels.flatten.registry import resolve_method
from isoloco_kernels.reference import iso_flatten_ref
from tests.helpers import DTYPES, TOL, gen, method_tol, rel_err, reset_tf32, spectrum, with_spectrum
from tests.helpers import cond as condition_number


def _gen(key) -> torch.Generator:
    return gen(("polar", key))


def _flatten_quiet(x: torch.Tensor, method: str = "polar") -> torch.Tensor:
    """iso_flatten that fails the test if the polar fallback fired."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlattenFallbackWarning)
        out = ik.iso_flatten(x, method=method)
    assert polar.last_stats().last_recomputed == ()
    return out


# ----------------------------------------------------------------------------------------------
# Coefficients: what the schedule is for, not its last digits

_EPS64 = float(np.finfo(np.float64).eps)


@pytest.mark.parametrize("module", [polar, gram], ids=["polar", "gram"])
def test_coefficient_table_matches_generator(module):
    s = coefficients.schedule(module.ELL, module.STEPS)
    assert len(module.COEFFS) == len(s.coeffs) == module.STEPS
    # A backward-stable 4×4 solve moves Remez's answer by ≲ cond·eps64 (×10 for the exchange
    # iterations); a row inherits the noise of the rows that fixed its interval, hence the running max.
    worst = 1.0
    for t, (got, want, cond) in enumerate(zip(module.COEFFS, s.coeffs, s.conds)):
        worst = max(worst, cond)
        np.testing.assert_allclose(got, want, rtol=10 * worst * _EPS64, atol=0, err_msg=f"row {t}")


def _compose(coeffs, sigma: np.ndarray):
    """Yield |1 − p_t(…p_0(σ))| after each step, in float64."""
    y = sigma.copy()
    for a, b, c in coeffs:
        y = a * y + b * y**3 + c * y**5
        yield np.abs(1 - y)


def _grid(ell: float) -> np.ndarray:
    return np.concatenate([np.geomspace(ell, 1.0, 20001), np.linspace(ell, 1.0, 20001)])


@pytest.mark.parametrize("ell,steps", [(2.5e-5, 10), (1e-8, 20), (2.5e-8, 15), (2.5e-8, 17), (1e-10, 24), (0.5, 4)])
def test_every_sigma_stays_within_the_schedule_bound(ell, steps):
    """Each step's promise: every σ in [ℓ0, 1] is within bounds[t] of 1 after step t (float64
    round-off of a quintic near 1 adds ~1e-15 a step)."""
    s = coefficients.schedule(ell, steps)
    for t, err in enumerate(_compose(s.coeffs, _grid(ell))):
        assert err.max() <= s.bounds[t] + 1e-14 * (t + 1), f"step {t}"
    assert s.bounds[-1] <= 1e-11  # every schedule above is long enough to converge


def test_shipped_table_keeps_its_documented_promises():
    """polar.py's docstring: 9 steps reach 2e-4, the 10th round-off; σ below ELL only grow."""
    err = list(_compose(polar.COEFFS, _grid(polar.ELL)))
    assert err[polar.STEPS - 2].max() < 2e-4
    assert err[-1].max() < 1e-8
    z = np.geomspace(1e-9, polar.ELL, 101)
    for a, b, c in polar.COEFFS:
        z2 = a * z + b * z**3 + c * z**5
        assert (z2 > z).all() and (z2 <= 1 + 1e-8).all()
        z = z2


def test_generator_is_defined_on_the_whole_range():
    """ℓ0 in [1e-10, 0.5] and 1 to 30 steps: a schedule, never an exception, bounds that never grow
    past the first step and that converge once there are enough steps."""
    for ell in [1e-10, 3e-9, 1e-8, 2.5e-8, 1e-6, 2.5e-5, 1e-3, 0.05, 0.5]:
        final = []
        for steps in range(1, 31):
            s = coefficients.schedule(ell, steps)
            assert len(s.coeffs) == steps and all(np.isfinite(s.coeffs).ravel())
            assert all(0 <= e <= 1 for e in s.bounds)
            final.append(s.bounds[-1])
        assert min(final) <= 1e-12, ell


@pytest.mark.parametrize("lo,hi", [(0.024, 1.0), (0.3, 1.7), (0.9, 1.1)])
def test_remez_equioscillates(lo, hi):
    a, b, c, e = coefficients.remez_odd_quintic(lo, hi)
    x = np.linspace(lo, hi, 200001)
    err = 1 - (a * x + b * x**3 + c * x**5)
    assert abs(np.abs(err).max() - e) <= 1e-9 * max(e, 1e-12) + 1e-15
    # the optimum alternates: error −E … +E … −E … +E at the ends and two interior points
    assert err[0] == pytest.approx(e, rel=1e-9) and err[-1] == pytest.approx(-e, rel=1e-9)
    assert err.max() == pytest.approx(e, rel=1e-6) and err.min() == pytest.approx(-e, rel=1e-6)
    with pytest.raises(ValueError, match="lo=0.5, hi=0.5"):
        coefficients.remez_odd_quintic(0.5, 0.5)


@pytest.mark.parametrize("delta", [1e-2, 3e-3, 1e-3])
def test_near_one_closed_form_is_the_minimax_to_leading_order(delta):
    """Where both are defined, the closed form's max error is within 1 + 4δ of Remez's (it is the
    minimax up to O(δ⁴)), and centred on 1 to the same order."""
    lo, hi = 1 - delta, 1 + delta
    *_, e = coefficients.remez_odd_quintic(lo, hi)
    a, b, c = coefficients.near_one_quintic(lo, hi)
    x = np.linspace(lo, hi, 200001)
    err = 1 - (a * x + b * x**3 + c * x**5)
    assert e <= np.abs(err).max() <= (1 + 4 * delta) * e
    assert abs(err[0] + err[-1]) <= 8 * delta * e  # the schedule recentres it anyway


def test_narrow_intervals_switch_on_conditioning():
    """The Remez system's condition grows like 2.8/δ²; past REMEZ_MAX_ERR/eps the step is closed form."""
    assert coefficients.remez_condition(0.9, 1.1) * _EPS64 < coefficients.REMEZ_MAX_ERR
    assert coefficients.remez_condition(1 - 1e-4, 1 + 1e-4) * _EPS64 > coefficients.REMEZ_MAX_ERR
    s = coefficients.schedule(2.5e-8, 17)  # once raised: Remez on [1 − 2.5e-6, 1 + 2.5e-6]
    assert s.conds[-1] == 0 and s.bounds[-1] <= 1e-15


def test_generator_refuses_nonsense():
    with pytest.raises(ValueError, match="ell"):
        coefficients.schedule(0.0, 10)
    with pytest.raises(ValueError, match="ell"):
        coefficients.schedule(1.0, 10)
    with pytest.raises(ValueError, match="steps"):
        coefficients.schedule(1e-3, 0)


# ----------------------------------------------------------------------------------------------
# Accuracy contract: fp32, cond ≤ 1e4, spectra × shapes (aspect up to 32), no fallback needed

SPECTRUM_SHAPES = [(3, 40, 40), (2, 16, 512), (2, 512, 16), (2, 24, 100), (1, 90, 37)]


@pytest.mark.parametrize("kind", ["geometric", "lowrank_noise", "flat"])
@pytest.mark.parametrize("shape", SPECTRUM_SHAPES, ids=str)
def test_fp32_contract_on_spectra(kind, shape):
    b, m, n = shape
    x = with_spectrum(b, m, n, spectrum(kind, min(m, n), cond=1e4), _gen((kind, shape)))
    x = x * 3.7  # not normalised
    x32 = x.to(torch.float32)
    out = _flatten_quiet(x32)
    assert out.dtype == torch.float32
    assert rel_err(out, iso_flatten_ref(x32)) <= TOL[("polar", torch.float32)]
    for i in range(b):  # every matrix, not only the batch
        assert rel_err(out[i], iso_flatten_ref(x32[i])) <= TOL[("polar", torch.float32)]


ODD_SHAPES = [(1, 9), (9, 1), (1, 1), (7, 7), (13, 5), (5, 13), (3, 6, 4), (4, 5, 17), (2, 33, 8)]


def test_float64_is_iterated_in_float64():
    x = with_spectrum(2, 30, 50, spectrum("geometric", 30, cond=1e4), _gen(5))
    # float64 GEMMs leave only the schedule's own error (measured 2.6e-12; float32 GEMMs: ~1e-6);
    # the residual check still passes
    assert rel_err(_flatten_quiet(x), iso_flatten_ref(x)) <= TOL[("polar", torch.float64)]


# ----------------------------------------------------------------------------------------------
# It knows when it failed


def test_ill_conditioned_matrices_fall_back_and_are_counted():
    g = _gen(7)
    good = with_spectrum(2, 24, 40, spectrum("geometric", 24, cond=1e3), g)
    bad = with_spectrum(2, 24, 40, spectrum("geometric", 24, cond=1e8), g)  # σ left mid-way
    x = torch.cat([good[:1], bad[:1], good[1:], bad[1:]])  # matrices 1 and 3 are ill-conditioned
    q, resid = polar.polar_factor(x)
    assert (resid[[1, 3]] > polar.CHECK_TOL).all() and (resid[[0, 2]] <= polar.CHECK_TOL).all()
    before = polar.last_stats()
    # float64: polar hands matrices 1 and 3 straight to the SVD (one warning, none from gram)
    with pytest.warns(FlattenFallbackWarning) as seen:
        out = ik.iso_flatten(x, method="polar")
    by_gram = [str(w.message) for w in seen if isinstance(w.message, GramFallbackWarning)]
    by_polar = [str(w.message) for w in seen if not isinstance(w.message, GramFallbackWarning)]
    assert len(by_polar) == 1 and re.search(r"2 of 4 matrices .* matrices \[1, 3\]", by_polar[0]), by_polar
    assert by_gram == []
    st = polar.last_stats()
    assert st.last_recomputed == (1, 3) and st.last_matrices == 4
    assert st.recomputed == before.recomputed + 2 and st.calls == before.calls + 1
    # float64: the recomputed matrices match the reference down to cond 1e8
    assert rel_err(out, iso_flatten_ref(x)) <= TOL[("polar", torch.float64)]
    assert rel_err(out[[1, 3]], iso_flatten_ref(x[[1, 3]])) <= TOL[("exact", torch.float64)]
    # float32: the flagged matrices are exactly what the exact path gives
    x32 = x.to(torch.float32)
    with pytest.warns(FlattenFallbackWarning) as seen:
        out32 = ik.iso_flatten(x32, method="polar")
    assert any("2 of 4" in str(w.message) for w in seen), [str(w.message) for w in seen]
    # float32: polar hands them to gram, whose own check hands them (cond 1e8) to svd: two warnings
    assert any(isinstance(w.message, GramFallbackWarning) and "2 of 2" in str(w.message) for w in seen)
    want = x32[[1, 3]].clone()
    exact.flatten_svd_(want)
    assert torch.equal(out32[[1, 3]], want)
    assert rel_err(out32[[0, 2]], iso_flatten_ref(x32[[0, 2]])) <= TOL[("polar", torch.float32)]


# ----------------------------------------------------------------------------------------------
# The bf16 mode and auto


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_polar_bf16_on_well_conditioned_input(dtype):
    x = with_spectrum(2, 12, 40, spectrum("geometric", 12, cond=1e2), _gen(11)).to(dtype)
    out = _flatten_quiet(x, method="polar_bf16")
    assert out.dtype == dtype
    assert rel_err(out, iso_flatten_ref(x)) <= TOL[("polar_bf16", dtype)]


@pytest.mark.parametrize("shape", [(4, 16, 16), (2, 16, 96), (2, 96, 16), (1, 40, 40)], ids=str)
def test_auto_on_cpu_is_an_exact_method_at_its_row(shape):
    x = torch.randn(shape, generator=_gen(12))
    served = resolve_method("auto", x)
    assert served in ("svd", "eigh")
    # the float64 result rounded to float32: measured 2.5e-8 (a float32 factorization: ≥ 3e-7)
    tol = method_tol(served, torch.float32, condition_number(x))
    assert rel_err(ik.iso_flatten(x, method="auto"), iso_flatten_ref(x)) <= tol


def test_polar_rejects_an_unknown_mode():
    x = torch.randn(1, 4, 5)
    with pytest.raises(ValueError, match="mode must be"):
        polar.flatten_polar_(x, mode="fp8")


# ---------------------------------------------------------------------------------------------
# TF32: the polar GEMMs run in IEEE float32 whatever the user switched on, and the user's
# setting comes back unchanged (torch >= 2.9 has two APIs; mixing them makes getters raise).


def _tf32_state() -> dict:
    """Every TF32 getter a user or cuBLAS may read, with "raises" where it raises."""
    getters = {
        "get_float32_matmul_precision": torch.get_float32_matmul_precision,
        "cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
        "cuda.matmul.fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
        "fp32_precision": lambda: torch.backends.fp32_precision,
        "mkldnn.matmul.fp32_precision": lambda: torch.backends.mkldnn.matmul.fp32_precision,
    }
    out = {}
    for name, get in getters.items():
        try:
            out[name] = get()
        except (RuntimeError, AttributeError) as e:
            out[name] = f"raises {type(e).__name__}"
    return out


def _set_user_tf32(state: str) -> None:
    if state == "legacy-allow_tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif state == "legacy-precision-high":
        torch.set_float32_matmul_precision("high")
    elif state == "new-cuda-matmul-tf32":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    elif state == "new-global-tf32":
        torch.backends.fp32_precision = "tf32"
    elif state != "default":
        raise ValueError(state)


@pytest.fixture
def restore_tf32():
    """Puts every TF32 setting back to torch's defaults after the test (and checks it did)."""
    start = _tf32_state()
    yield
    reset_tf32()
    assert _tf32_state() == start


TF32_STATES = ["default", "legacy-allow_tf32", "legacy-precision-high", "new-cuda-matmul-tf32", "new-global-tf32"]


@pytest.mark.parametrize("state", TF32_STATES)
def test_ieee_fp32_matmul_inside_and_the_user_setting_restored(restore_tf32, state):
    """Inside: cuBLAS's settings say IEEE under both APIs (and reading them does not raise,
    which it did for the new API's "tf32"); after: every getter reads as before."""
    _set_user_tf32(state)
    before = _tf32_state()
    with polar.ieee_fp32_matmul(True):
        inside = _tf32_state()
    assert _tf32_state() == before
    assert inside["cuda.matmul.allow_tf32"] is False
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert inside["cuda.matmul.fp32_precision"] == "ieee"
    if not before["get_float32_matmul_precision"].startswith("raises"):
        assert inside["get_float32_matmul_precision"] == "highest"


@pytest.mark.parametrize("state", TF32_STATES)
def test_ieee_fp32_matmul_restores_after_an_error(restore_tf32, state):
    _set_user_tf32(state)
    before = _tf32_state()
    with pytest.raises(KeyError), polar.ieee_fp32_matmul(True):
        raise KeyError("inside")
    assert _tf32_state() == before


def test_ieee_fp32_matmul_on_torch_without_the_new_api(restore_tf32, monkeypatch):
    """Torch < 2.9 (no fp32_precision settings): the legacy setting alone, saved and restored."""
    from isoloco_kernels.flatten import tf32

    monkeypatch.setattr(tf32, "_fp32_precision_props", lambda: None)
    torch.set_float32_matmul_precision("medium")
    with polar.ieee_fp32_matmul(True):
        assert torch.get_float32_matmul_precision() == "highest"
    assert torch.get_float32_matmul_precision() == "medium"


@pytest.mark.parametrize("state", TF32_STATES)
def test_polar_flatten_runs_under_every_user_tf32_state(restore_tf32, state):
    """The flatten (CPU here; the CUDA twin is in test_cuda_kernels.py) neither raises nor
    changes the setting, whatever TF32 state the user left."""
    _set_user_tf32(state)
    before = _tf32_state()
    x = with_spectrum(2, 12, 20, spectrum("geometric", 12, cond=1e2), torch.Generator().manual_seed(5))
    y = x.float()
    ik.iso_merge_([y], method="polar")
    assert rel_err(y, iso_flatten_ref(x)) <= TOL[("polar", torch.float32)]
    assert _tf32_state() == before


# ---------------------------------------------------------------------------------------------
# auto's float64 rate per CUDA device (flatten._fp64_rate), device properties mocked.

from isoloco_kernels.flatten import registry as flatten  # noqa: E402


@pytest.fixture
def fake_cuda(monkeypatch):
    """set(name, capability): one visible CUDA device with these properties; the cache cleared."""
    monkeypatch.delenv(flatten.FP64_RATE_ENV, raising=False)

    def set_device(name, capability):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        flatten._device_fp64_rate.cache_clear()

    yield set_device
    flatten._device_fp64_rate.cache_clear()


@pytest.mark.parametrize(
    "name,capability,rate",
    [
        pytest.param("NVIDIA H100 80GB HBM3", (9, 0), 1.0, id="H100"),
        pytest.param("NVIDIA H200", (9, 0), 1.0, id="H200"),
        pytest.param("NVIDIA H800", (9, 0), 0.0, id="H800"),
        pytest.param("NVIDIA H800 PCIe", (9, 0), 0.0, id="H800-PCIe"),
        pytest.param("NVIDIA H20", (9, 0), 0.0, id="H20"),
        pytest.param("NVIDIA A100-SXM4-80GB", (8, 0), 1.0, id="A100"),
        pytest.param("NVIDIA B200", (10, 0), 0.5, id="B200"),
        pytest.param("NVIDIA GeForce RTX 4090", (8, 9), 0.0, id="consumer"),
        pytest.param("NVIDIA L40S", (8, 9), 0.0, id="workstation"),
    ],
)
def test_fp64_rate_by_name_and_capability(fake_cuda, name, capability, rate):
    fake_cuda(name, capability)
    assert flatten._fp64_rate(torch.device("cuda")) == rate
    assert flatten._fp64_rate(torch.device("cuda", 0)) == rate


@pytest.mark.parametrize("name,gram_for_wide", [("NVIDIA H100 80GB HBM3", True), ("NVIDIA H20", False)])
def test_auto_keeps_weak_float64_parts_on_polar(fake_cuda, name, gram_for_wide):
    """A wide 1024×8192 matrix goes to gram on an H100 and stays on polar on an H20 (both sm_90)."""
    fake_cuda(name, (9, 0))
    assert flatten.gram_beats_polar(1024, 8192, flatten._fp64_rate(torch.device("cuda"))) is gram_for_wide


def test_fp64_rate_override(fake_cuda, monkeypatch):
    fake_cuda("NVIDIA H20", (9, 0))
    monkeypatch.setenv(flatten.FP64_RATE_ENV, "0.75")
    assert flatten._fp64_rate(torch.device("cuda")) == 0.75
    fake_cuda("NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setenv(flatten.FP64_RATE_ENV, "0")
    assert flatten._fp64_rate(torch.device("cuda")) == 0.0


@pytest.mark.parametrize("bad", ["fast", "-1", "nan"])
def test_fp64_rate_override_must_be_a_rate(fake_cuda, monkeypatch, bad):
    fake_cuda("NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setenv(flatten.FP64_RATE_ENV, bad)
    with pytest.raises(ValueError, match=f"ISOLOCO_FP64_RATE must be a number >= 0.*{bad}"):
        flatten._fp64_rate(torch.device("cuda"))


def test_fp64_rate_is_read_once_per_device(fake_cuda, monkeypatch):
    fake_cuda("NVIDIA H100 80GB HBM3", (9, 0))
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: calls.append(device) or "NVIDIA H100")
    for _ in range(3):
        flatten._fp64_rate(torch.device("cuda", 0))
    assert len(calls) == 1


@pytest.mark.parametrize("kappa", [4e4, 1e6])
def test_float64_residual_check_is_float64_sized(kappa):
    """float64 iterates in float64, so its residual check is float64-sized (CHECK_TOL_F64): a
    direction below the schedule's ELL (κ 4e4: 1.6e-4 passed float32's 5e-4 unflagged) is flagged
    and recomputed by the SVD, which keeps polar's float64 row at every condition number."""
    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=torch.float64))
    s = torch.ones(128, dtype=torch.float64)
    s[-1] = 1 / kappa
    x = ((u * s) @ v.T).unsqueeze(0)
    y = x.clone()
    polar.reset_stats()
    with pytest.warns(FlattenFallbackWarning, match="1 of 1"):
        polar.flatten_polar_(y)
    assert polar.last_stats().last_recomputed == (0,)
    assert rel_err(y, iso_flatten_ref(x)) <= TOL[("polar", torch.float64)]
    well = with_spectrum(2, 64, 96, spectrum("geometric", 64, 1e4), gen("f64-lifted"))
    z = well.clone()
    polar.reset_stats()
    polar.flatten_polar_(z)  # κ 1e4 is inside the schedule: no fallback
    assert polar.last_stats().last_recomputed == ()
    assert rel_err(z, iso_flatten_ref(well)) <= TOL[("polar", torch.float64)]
