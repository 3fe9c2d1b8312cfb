"""method="fast", the training grade (isoloco_kernels/flatten/fast.py): a flat spectrum on every input, its
error bands by condition number, the rank certificate and its fallback, on the CPU with the GPU's
numerics (the precise steps as emulated 3xTF32, the rest bfloat16), and each step's GEMMs spied for
the precision they run in. The registry-wide contract
(shapes, dtypes, views, zeros, bad input, entry points) runs in tests/flatten/test_methods.py."""

from __future__ import annotations

import warnings

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.flatten import fast, fast_gram, polar
from isoloco_kernels.flatten.iteration_stats import FlattenFallbackWarning
from isoloco_kernels.reference import iso_flatten_ref
from tests.helpers import (
    FLATNESS,
    captured_pseudo_gradients,
    cond,
    flatness,
    gen,
    method_tol,
    rel_err,
    spectrum,
    with_spectrum,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PRECISE = [pytest.param(None, id="native"), pytest.param(polar.TF32X3, id="tf32x3")]


def _fast(x: torch.Tensor, precise=None) -> tuple[torch.Tensor, tuple]:
    """(result, indices the certificate sent to the fallback) of fast's direct route on a copy of x,
    its later steps in bfloat16 as on a GPU (the Gram route: tests/flatten/test_fast_gram.py)."""
    y = x.clone()
    fast.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlattenFallbackWarning)
        fast.flatten_fast_(y if y.ndim == 3 else y.unsqueeze(0), precise=precise, low=torch.bfloat16, route="direct")
    return y, fast.last_stats().last_recomputed


SPECTRA = [("geometric", 1e2), ("geometric", 1e3), ("lowrank_noise", 1e3), ("geometric", 1e4), ("lowrank_noise", 1e4)]


@pytest.mark.parametrize("precise", PRECISE)
@pytest.mark.parametrize("kind,kappa", SPECTRA)
@pytest.mark.parametrize("shape", [(2, 48, 130), (1, 130, 48), (2, 64, 64)])
def test_flat_spectrum_and_error_band_on_conditioned_spectra(kind, kappa, shape, precise):
    b, m, n = shape
    x = with_spectrum(b, m, n, spectrum(kind, min(m, n), kappa), gen((kind, kappa, shape))).float()
    out, recomputed = _fast(x, precise)
    assert recomputed == ()  # κ ≤ 1e4 is inside the certified range: no fallback
    assert flatness(out, x) <= FLATNESS["fast"]
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", x.dtype, kappa)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_every_dtype_keeps_the_contract(dtype):
    x = with_spectrum(3, 40, 96, spectrum("geometric", 40, 1e2), gen(("dtype", str(dtype)))).to(dtype)
    out, _ = _fast(x)
    assert out.dtype == dtype
    assert flatness(out, x) <= FLATNESS["fast"] + (2e-2 if dtype in (torch.float16, torch.bfloat16) else 0)
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", dtype, cond(x))


def test_captured_pseudo_gradients():
    """Every committed real pseudo-gradient (bench/data/captured: condition numbers to ~1e5): flat
    and within 0.3 (measured ≤ 1e-2), with the precise steps as the GPU runs them (3xTF32)."""
    for name, d in captured_pseudo_gradients():
        out, _ = _fast(d, polar.TF32X3)
        out = out.reshape(d.shape)
        assert flatness(out, d) <= FLATNESS["fast"], name
        assert rel_err(out, iso_flatten_ref(d)) <= method_tol("fast", d.dtype, 1e5), name


def test_the_issues_rank3_matrix_keeps_its_null_space_empty():
    """A rank-3 512 × 128 product: bfloat16 steps would lift the null space's round-off to 1
    (polar_bf16 returned a relative error of 6.5 here before it certified rank). fast's certificate
    sends it to polar, which hands it on to the exact path: the reference result, null space zero."""
    g = gen("rank3-512x128")
    x = (torch.randn(1, 512, 3, generator=g) @ torch.randn(1, 3, 128, generator=g)).contiguous()
    for method in ("fast", "polar_bf16"):
        with pytest.warns(FlattenFallbackWarning, match=r"1 of 1 matrices of shape \(512, 128\)"):
            out = ik.iso_flatten(x, method=method)
        assert rel_err(out, iso_flatten_ref(x)) <= 1e-5, method
        s = torch.linalg.svdvals(out[0].double())
        assert s[3:].max() <= 1e-5 * s[0], method  # the null directions stay (numerically) zero


@pytest.mark.parametrize("kappa", [1e6, 1e7])
def test_beyond_the_certified_range_falls_back_and_stays_flat(kappa):
    x = with_spectrum(2, 32, 90, spectrum("geometric", 32, kappa), gen(("beyond", kappa))).float()
    out, recomputed = _fast(x)
    assert recomputed == (0, 1)
    assert flatness(out, x) <= 1e-3  # the fallback is float32-accurate
    assert rel_err(out, iso_flatten_ref(x)) <= 1e-3


def test_only_the_uncertified_matrices_fall_back():
    ok = with_spectrum(3, 24, 60, spectrum("geometric", 24, 1e2), gen("mixed-ok")).float()
    ok[1] = with_spectrum(1, 24, 60, spectrum("geometric", 24, 1e7), gen("mixed-bad"))[0].float()
    out, recomputed = _fast(ok)
    assert recomputed == (1,)
    assert flatness(out, ok) <= FLATNESS["fast"]


def test_the_certificate_reads_singular_values():
    """polar.certify against svdvals: true exactly when σ_min ≥ floor (zero rows masked)."""
    g = gen("certify")
    for floor in (1e-3, 1e-2, 0.1):
        x = torch.randn(16, 8, 20, generator=g, dtype=torch.float64) * torch.logspace(-3, 0, 16)[:, None, None]
        smin = torch.linalg.svdvals(x)[:, -1]
        want = smin >= floor
        clear = ((smin / floor).log().abs() > 1e-6).nonzero().flatten()  # not on the boundary
        assert torch.equal(polar.certify(x, floor)[clear], want[clear])
    z = torch.randn(1, 6, 20, generator=g)
    z[0, 2] = 0  # a zero row is not a null direction of the flatten (it stays zero exactly)
    assert bool(polar.certify(z, 1e-3)[0])
    z[0, 4] = z[0, 0]  # a repeated row is
    assert not bool(polar.certify(z, 1e-3)[0])


def test_the_precision_placement_is_what_keeps_the_contract():
    """The same schedule with every step in bfloat16 misses the κ 1e3 band (the small directions
    are rounded away before they are lifted), and the certificate alone cannot see that: this is
    what the float32-accurate first steps buy, and what the band test above would catch."""
    x = with_spectrum(2, 64, 160, spectrum("lowrank_noise", 64, 1e3), gen("placement")).float()
    q, _ = polar.polar_factor(x, fast.COEFFS, gemm_dtypes=(torch.bfloat16,) * fast.STEPS)
    sbar = (x.double() * q.double()).sum((-2, -1), keepdim=True) / 64
    assert rel_err(sbar * q.double(), iso_flatten_ref(x)) > method_tol("fast", x.dtype, 1e3)
    out, _ = _fast(x)
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", x.dtype, 1e3)


def test_lift_floor_follows_the_schedule():
    """The certified floor is LIFT_FLOOR × where the precise steps take ELL, and a singular value
    that starts at LIFT_FLOOR·ELL still ends within 0.8 % of 1 in exact arithmetic; fast's schedule is
    the one derived for polar's range in its number of steps."""
    from isoloco_kernels.flatten import coefficients

    sched = coefficients.schedule(polar.ELL, fast.STEPS)
    assert all(got == pytest.approx(want, rel=1e-12) for got, want in zip(fast.COEFFS, sched.coeffs))
    s = torch.tensor(polar.ELL * fast.LIFT_FLOOR, dtype=torch.float64)
    for t, (a, b, c) in enumerate(fast.COEFFS):
        s = a * s + b * s**3 + c * s**5
        if t == fast.PRECISE_STEPS - 1:
            assert float(s) == pytest.approx(fast.lift_floor(), rel=1e-3)
    assert abs(float(s) - 1) <= 8e-3


def test_work_model_counts_every_gemm_dtype():
    k, r = 4096, 1024  # direct on an H200 (the model's device)
    w = fast.fast_work(k, r)
    assert w[polar.TF32X3] + w[polar.TF32X2] == polar.polar_flops(k, r, fast.PRECISE_STEPS)
    assert fast.STEPS == 9 and w["bf16"] == polar.polar_flops(k, r, fast.STEPS - fast.PRECISE_STEPS)
    assert w[polar.TF32X2] == fast.PRECISE_STEPS * (2.0 * k * r * r + 2.0 * r**3)  # X·Xᵀ and A²: two GEMMs
    assert w["fp64"] == 2.0 * k * r**2 + r**3 / 3
    assert fast.fast_work(32 * r, r) == fast_gram.gram_work(32 * r, r)  # a vocabulary matrix: the Gram route


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_contract_holds_on_tensor_cores():
    """The same bands on the GPU, where the precise steps run as 3xTF32 and the rest in bfloat16
    on tensor cores: conditioned spectra, the captured pseudo-gradients, the rank-3 fallback."""
    for kind, kappa in SPECTRA:
        x = with_spectrum(2, 96, 300, spectrum(kind, 96, kappa), gen(("cuda", kind, kappa))).float().cuda()
        out, recomputed = _fast(x)
        assert recomputed == () and out.is_cuda
        assert flatness(out, x) <= FLATNESS["fast"], (kind, kappa)
        assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", x.dtype, kappa), (kind, kappa)
    for name, d in captured_pseudo_gradients():
        out, _ = _fast(d.cuda())
        assert flatness(out.reshape(d.shape), d) <= FLATNESS["fast"], name
        assert rel_err(out.reshape(d.shape), iso_flatten_ref(d)) <= method_tol("fast", d.dtype, 1e5), name
    g = gen("cuda-rank3")
    r3 = (torch.randn(1, 512, 3, generator=g) @ torch.randn(1, 3, 128, generator=g)).cuda()
    out, recomputed = _fast(r3)
    assert recomputed == (0,) and rel_err(out, iso_flatten_ref(r3)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rank_certificate_reads_singular_values_and_writes_nothing(dtype):
    """polar.full_rank (polar_bf16's certificate) against svdvals: σ_min ≥ RANK_FLOOR·‖x‖_F/√r,
    at every scale, the input untouched (its float64 Gram pass must not scale x in place)."""
    g = gen(("full-rank", str(dtype)))
    good = with_spectrum(3, 16, 40, spectrum("geometric", 16, 1e3), g).to(dtype) * 1e30
    bad = good.clone()
    bad[1, 3] = bad[1, 2]  # a repeated row: rank-deficient
    keep = bad.clone()
    assert polar.full_rank(good).all()
    assert polar.full_rank(bad).tolist() == [True, False, True]
    assert torch.equal(bad, keep)


# ----------------------------------------------------------------------------------------------
# The precision each step's GEMMs run in, spied


class _GemmSpy(torch.overrides.TorchFunctionMode):
    """The operand dtypes of each polar step's GEMMs, at two levels:
    - `pieces`: the tensors handed to the step pieces (`polar.TorchSteps`, `tf32.Tf32x3Steps`:
      gram, square, step), which every flatten calls, through the op too;
    - `gemms`: as a context manager (a TorchFunctionMode: torch functions, Tensor methods and `@`
      alike), every matmul / mm / bmm / baddbmm / addmm itself; torch function modes do not reach
      inside a custom op, so only around a direct call of the method.
    Both are keyed by the step: the count advances when a `step` piece returns, so a step's
    A = X·Xᵀ (and step 0's A²) count with it. GEMMs inside the rank certificate (`polar.certify`)
    go to `certificate`, keyed by the steps done before it."""

    GEMMS = {"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "baddbmm_", "addmm", "addmm_", "einsum"}

    def __init__(self, monkeypatch):
        from isoloco_kernels.flatten import tf32

        super().__init__()
        self.step, self.in_certificate = 0, False
        self.pieces: list[tuple[int, tuple]] = []
        self.gemms: list[tuple[int, tuple]] = []
        self.certificate: list[tuple[int, tuple]] = []
        for cls in (polar.TorchSteps, tf32.Tf32x3Steps):
            for name in ("gram", "square", "step"):
                monkeypatch.setattr(cls, name, staticmethod(self._piece(getattr(cls, name), name == "step")))
        monkeypatch.setattr(polar, "certify", self._certifying(polar.certify))

    @staticmethod
    def _dtypes(args) -> tuple:
        return tuple(a.dtype for a in args if isinstance(a, torch.Tensor))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.GEMMS:
            (self.certificate if self.in_certificate else self.gemms).append((self.step, self._dtypes(args)))
        return func(*args, **(kwargs or {}))

    def _piece(self, real, advances: bool):
        def piece(*args, **kwargs):
            self.pieces.append((self.step, self._dtypes(args)))
            out = real(*args, **kwargs)
            self.step += advances
            return out

        return piece

    def _certifying(self, real):
        def certify(*args, **kwargs):
            self.in_certificate = True
            try:
                return real(*args, **kwargs)
            finally:
                self.in_certificate = False

        return certify


def _assert_fast_precisions(spy: _GemmSpy, calls: list) -> None:
    """Steps 0..PRECISE_STEPS-1 on float32 operands (float32-accurate: IEEE float32 on the CPU,
    float32 split into TF32 parts for 3xTF32), the rest on bfloat16, every GEMM of a step in one
    dtype; exactly the schedule's steps (no fallback ran)."""
    assert spy.step == fast.STEPS, f"{spy.step} steps ran; the schedule has {fast.STEPS}"
    per_step: dict[int, set] = {}
    for t, dtypes in calls:
        per_step.setdefault(t, set()).update(dtypes)
    for t in range(fast.STEPS):
        want = torch.float32 if t < fast.PRECISE_STEPS else torch.bfloat16
        assert per_step.get(t) == {want}, f"step {t}: GEMM operands {per_step.get(t)}, want {want} only"


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 5, 8)], ids=["wide", "tall", "batched"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fast_runs_its_first_steps_in_float32_and_the_rest_in_bfloat16(monkeypatch, dtype, shape):
    """iso_flatten(method="fast") on the CPU, through the op: the operands of each step's pieces
    (the direct route, on a CPU with bfloat16 units, as a GPU runs it)."""
    x = torch.randn(shape, generator=gen(("spy", shape))).to(dtype)  # well conditioned: no fallback
    monkeypatch.setattr(fast, "route_for", lambda *a, **k: "direct")
    monkeypatch.setattr(fast, "_cpu_has_bf16", lambda: True)
    spy = _GemmSpy(monkeypatch)
    ik.iso_flatten(x, method="fast")
    _assert_fast_precisions(spy, spy.pieces)


@pytest.mark.parametrize("precise", PRECISE)
def test_fast_gemms_run_in_the_claimed_precision_step_by_step(monkeypatch, precise):
    """The method itself (what the op runs), every GEMM seen: the precise steps on float32 operands
    (native: IEEE float32 on the CPU; TF32X3: tf32.Tf32x3Steps, the GPU's numerics emulated), the
    rest bfloat16, and the rank certificate in float64 between the two."""
    x = torch.randn(2, 6, 9, generator=gen("spy-gemms"))
    with warnings.catch_warnings(), _GemmSpy(monkeypatch) as spy:
        warnings.simplefilter("error", FlattenFallbackWarning)
        fast.flatten_fast_(x, precise=precise, low=torch.bfloat16, route="direct")
    _assert_fast_precisions(spy, spy.gemms)
    _assert_fast_precisions(spy, spy.pieces)
    assert spy.certificate, "the rank certificate ran no GEMM"
    assert {t for t, _ in spy.certificate} == {fast.PRECISE_STEPS}, "the certificate ran elsewhere"
    assert {d for _, ds in spy.certificate for d in ds} == {torch.float64}
