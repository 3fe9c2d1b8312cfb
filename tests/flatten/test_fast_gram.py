"""The Gram route of method "fast" (isoloco_kernels/flatten/fast_gram.py) and how "fast" picks its route: the
training-grade contract on the route's own (wide) inputs against reference.py, its certificate on the
planted cases (rank-deficient, κ 1e5–1e7, zero rows, a NaN inside the iteration), all-or-nothing,
bounded scratch, the GEMM precisions it claims, the CPU's bfloat16 choice and the route rule."""

from __future__ import annotations

import warnings

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.flatten import coefficients, fast, fast_gram, gram, polar
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


SMALL = fast_gram.SMALL_SIDES  # the r×r part as CUDA runs it (the schedule) and as the CPU does (eigh)


def _gram(x: torch.Tensor, small: str, **kw) -> tuple[torch.Tensor, tuple]:
    """(result, indices sent to the fallback) of fast's Gram route on a copy of x."""
    y = x.clone()
    fast.reset_stats()
    _gram_in_place(y if y.ndim == 3 else y.unsqueeze(0), small, **kw)
    return y, fast.last_stats().last_recomputed


def _gram_in_place(x3, small, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlattenFallbackWarning)
        fast_gram.flatten_fast_gram_(x3, fast._fallback, fast.RECORDER, small=small, **kw)


def _scratch(x: torch.Tensor, run) -> int:
    """Peak bytes run() allocates beside x (torch's MemTracker counts a tensor's whole storage once it
    sees a view of it, so x is made seen first and subtracted)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    with mt:
        x[..., :1].sum()
        run()
    peak = sum(v for per in mt.get_tracker_snapshot("peak").values() for k, v in per.items() if k == "Total")
    return peak - x.numel() * x.element_size()


def test_the_schedule_is_the_one_derived_for_its_range():
    s = coefficients.schedule(fast_gram.ELL, fast_gram.STEPS)
    assert len(fast_gram.COEFFS) == fast_gram.STEPS
    for got, want in zip(fast_gram.COEFFS, s.coeffs):
        assert got == pytest.approx(want, rel=1e-12)
    assert s.bounds[-1] <= fast_gram.BOUND
    assert coefficients.schedule(fast_gram.ELL, fast_gram.STEPS - 1).bounds[-1] > 1e-3  # one fewer is not enough


SPECTRA = [("geometric", 1e2), ("geometric", 1e3), ("lowrank_noise", 1e3), ("geometric", 1e4), ("lowrank_noise", 1e4)]


@pytest.mark.parametrize("kind,kappa", SPECTRA)
@pytest.mark.parametrize("shape", [(2, 24, 200), (1, 200, 24), (3, 1, 77)], ids=["wide", "tall", "1xn"])
@pytest.mark.parametrize("small", SMALL)
def test_flat_spectrum_and_error_band_on_conditioned_spectra(kind, kappa, shape, small):
    b, m, n = shape
    x = with_spectrum(b, m, n, spectrum(kind, min(m, n), kappa), gen(("gram-route", kind, kappa, shape))).float()
    out, recomputed = _gram(x, small)
    assert recomputed == ()  # κ ≤ 1e4 is inside the certified range
    assert flatness(out, x) <= 1e-3  # the schedule's 5.6e-5 plus the float32 application's u·κ
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", x.dtype, kappa)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("small", SMALL)
def test_every_dtype_keeps_the_contract(dtype, small):
    x = with_spectrum(3, 20, 120, spectrum("geometric", 20, 1e2), gen(("gram-dtype", str(dtype)))).to(dtype)
    out, recomputed = _gram(x, small)
    assert out.dtype == dtype and recomputed == ()
    assert flatness(out, x) <= FLATNESS["fast"] + (2e-2 if dtype in (torch.float16, torch.bfloat16) else 0)
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", dtype, cond(x))


@pytest.mark.parametrize("small", SMALL)
def test_float64_input_is_float64_accurate(small):
    x = with_spectrum(2, 16, 90, spectrum("geometric", 16, 1e3), gen("gram-f64"))
    out, _ = _gram(x, small)
    assert rel_err(out, iso_flatten_ref(x)) <= 1e-3  # the schedule's flatness bound, not float32's


@pytest.mark.parametrize("small", SMALL)
def test_non_contiguous_views_are_written_in_place(small):
    base = torch.randn(2, 150, 60, generator=gen("gram-view"))
    view = base[:, ::2, :20].mT  # [2, 20, 75], strided both ways
    want = iso_flatten_ref(view)
    keep = base.clone()
    _gram_in_place(view, small)
    assert rel_err(view, want) <= method_tol("fast", torch.float32, 1e2)
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[:, ::2, :20] = False
    assert torch.equal(base[untouched], keep[untouched])  # nothing outside the view moved


@pytest.mark.parametrize("small", SMALL)
def test_captured_pseudo_gradients(small):
    """Every committed real pseudo-gradient (condition numbers to ~1e5): flat and within 0.3."""
    for name, d in captured_pseudo_gradients():
        out, _ = _gram(d, small)
        out = out.reshape(d.shape)
        assert flatness(out, d) <= FLATNESS["fast"], name
        assert rel_err(out, iso_flatten_ref(d)) <= method_tol("fast", d.dtype, 1e5), name


@pytest.mark.parametrize("small", SMALL)
def test_zero_rows_are_certified_and_stay_zero(small):
    """A zero row is not a null direction of the flatten (Y·X keeps it zero): no fallback."""
    x = with_spectrum(1, 12, 80, spectrum("geometric", 12, 1e2), gen("gram-zero-rows")).float()
    x[0, 3] = 0
    x[0, 7] = 0
    out, recomputed = _gram(x, small)
    assert recomputed == ()
    assert torch.equal(out[0, 3], torch.zeros(80)) and torch.equal(out[0, 7], torch.zeros(80))
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", torch.float32, 1e2)


@pytest.mark.parametrize("small", SMALL)
def test_a_rank_deficient_matrix_falls_back_and_its_null_space_stays_empty(small):
    g = gen("gram-rank3")
    x = (torch.randn(1, 24, 3, generator=g) @ torch.randn(1, 3, 300, generator=g)).contiguous()
    with pytest.warns(FlattenFallbackWarning, match=r"1 of 1 matrices of shape \(24, 300\)"):
        fast_gram.flatten_fast_gram_(out := x.clone(), fast._fallback, fast.RECORDER, small=small)
    assert rel_err(out, iso_flatten_ref(x)) <= 1e-5
    s = torch.linalg.svdvals(out[0].double())
    assert s[3:].max() <= 1e-5 * s[0]


@pytest.mark.parametrize(
    "small,kappa", [("iterate", 1e5), ("iterate", 1e6), ("iterate", 1e7), ("eigh", 1e6), ("eigh", 1e7)]
)
def test_beyond_the_certified_range_falls_back_and_stays_flat(small, kappa):
    """The schedule certifies to ~4e4 (ELL against the σ_max bound), eigh resolves to 1e5 (exact.py)."""
    x = with_spectrum(2, 16, 120, spectrum("geometric", 16, kappa), gen(("gram-beyond", kappa))).float()
    out, recomputed = _gram(x, small)
    assert recomputed == (0, 1)
    assert flatness(out, x) <= 1e-3  # gram.py's float64 schedule and application (the SVD beyond it)
    assert rel_err(out, iso_flatten_ref(x)) <= 1e-2  # u·κ-limited by the float32 input itself


@pytest.mark.parametrize("small", SMALL)
def test_only_the_uncertified_matrices_fall_back(small):
    x = with_spectrum(3, 16, 90, spectrum("geometric", 16, 1e2), gen("gram-mixed")).float()
    x[2] = with_spectrum(1, 16, 90, spectrum("geometric", 16, 1e7), gen("gram-mixed-bad"))[0].float()
    out, recomputed = _gram(x, small)
    assert recomputed == (2,)
    assert flatness(out, x) <= FLATNESS["fast"]


def test_the_certificate_reads_singular_values():
    """Certified when every singular value is ≥ ELL of the σ_max bound (which lies in [σ_max,
    r^(1/16)·σ_max]): σ_min at 3·ELL·σ_max is certified, at ELL/2·σ_max it is not."""
    for factor, want in ((3.0, ()), (0.5, (0,))):
        sig = torch.ones(8, dtype=torch.float64)
        sig[-1] = fast_gram.ELL * factor
        x = with_spectrum(1, 8, 64, sig, gen(("gram-cert", factor)))
        out, recomputed = _gram(x, "iterate")
        assert recomputed == want, factor
        assert rel_err(out, iso_flatten_ref(x)) <= 1e-3


def test_a_nan_inside_the_iteration_is_caught(monkeypatch):
    """A NaN after the r×r iteration (an overflow there, a fault): the residual check flags the
    matrix and gram.py's float64 schedule recomputes it from the same A₀; nothing non-finite is written."""
    real = gram._iterate
    calls = []

    def poisoned(a0, *args, **kwargs):  # one sub-batch a call; the second one's first matrix
        y, tq, resid, s = real(a0, *args, **kwargs)
        if len(calls) == 1:
            y[0, 0, 0] = float("nan")
            resid = resid.clone()
            resid[0] = float("nan")
        calls.append(y.shape[0])
        return y, tq, resid, s

    monkeypatch.setattr(gram, "_iterate", poisoned)
    x = with_spectrum(3, 12, 70, spectrum("geometric", 12, 1e2), gen("gram-nan")).float()
    out, recomputed = _gram(x, "iterate", budget=12 * 12 * 8 * 6)  # one matrix a sub-batch
    assert calls == [1, 1, 1, 1] and recomputed == (1,)  # three sub-batches, then gram.py's schedule on the one
    assert bool(torch.isfinite(out).all())
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", torch.float32, 1e2)


@pytest.mark.parametrize("small", SMALL)
def test_bad_input_and_a_refused_fallback_write_nothing(small):
    x = with_spectrum(2, 10, 60, spectrum("geometric", 10, 1e2), gen("gram-bad")).float()
    x[1, 2, 5] = float("nan")
    keep = x.clone()
    with pytest.raises(ValueError, match="matrix 1"):
        fast_gram.flatten_fast_gram_(x, fast._fallback, fast.RECORDER, small=small)
    assert torch.equal(x.nan_to_num(), keep.nan_to_num())
    y = with_spectrum(2, 10, 60, spectrum("geometric", 10, 1e7), gen("gram-refused")).float()
    keep = y.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlattenFallbackWarning)  # the warning comes before any write
        with pytest.raises(FlattenFallbackWarning):
            fast_gram.flatten_fast_gram_(y, fast._fallback, fast.RECORDER, small=small)
    assert torch.equal(y, keep)


@pytest.mark.parametrize("small", SMALL)
def test_a_result_that_does_not_fit_the_dtype_is_refused(small):
    x = torch.zeros(1, 4, 40, dtype=torch.float16)
    x[0, 0, :] = 6e4  # s̄·Q has entries 6e4·√40/4 … beyond float16's 65504 along the rank-one row
    x[0, 1, 0] = 1.0
    keep = x.clone()
    want = iso_flatten_ref(x.float())
    if bool((want.abs() < 65504).all()):
        pytest.skip("the planted result fits float16")  # the construction is checked, not assumed
    with pytest.raises(ik.ResultOverflowError):
        fast_gram.flatten_fast_gram_(x, fast._fallback, fast.RECORDER, small=small)
    assert torch.equal(x, keep)


@pytest.mark.parametrize("small", SMALL)
def test_a_small_budget_chunks_the_passes_and_gives_the_same_result(small):
    x = with_spectrum(4, 16, 700, spectrum("geometric", 16, 1e3), gen("gram-budget")).float()
    whole, _ = _gram(x, small)
    sub_b, cols = gram._plan(4, 16, 700, 4, 16 * 16 * 8 * 6)  # one matrix, MIN_CHUNK_COLS columns at a time
    assert (sub_b, cols) == (1, gram.MIN_CHUNK_COLS)
    chunked, _ = _gram(x, small, budget=16 * 16 * 8 * 6)
    assert rel_err(chunked, whole) <= 1e-6


@pytest.mark.parametrize("small", SMALL)
def test_the_gemms_run_in_the_claimed_precisions(monkeypatch, small):
    """A₀ and the r×r part in float64, the application (the only other pass over X) in float32."""
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("bmm", "baddbmm", "baddbmm_", "matmul", "__matmul__"):
                ts = [a for a in args if isinstance(a, torch.Tensor)]
                wide = any(d != 8 for a in ts for d in a.shape[-2:])  # reads column chunks of X (r = 8)
                seen.append((tuple(a.dtype for a in ts), wide))
            return func(*args, **(kwargs or {}))

    x = with_spectrum(2, 8, 300, spectrum("geometric", 8, 1e2), gen("gram-spy")).float()
    with Spy():
        _gram(x, small)
    long_side = [d for d, wide in seen if wide]
    assert long_side, "no GEMM read the long side"
    assert {torch.float64} in [set(d) for d in long_side]  # A₀
    assert {torch.float32} in [set(d) for d in long_side]  # the application
    assert all(set(d) <= {torch.float64} for d, wide in seen if not wide)  # the r×r iteration


def test_fast_picks_the_route_by_shape_and_device(monkeypatch):
    picked = []
    monkeypatch.setattr(fast_gram, "flatten_fast_gram_", lambda x3, *a, **k: picked.append(tuple(x3.shape)))
    monkeypatch.setattr(fast, "_cpu_has_bf16", lambda: True)
    fast.flatten_fast_(torch.randn(1, 8, 400))  # 50× wider: the Gram route everywhere
    fast.flatten_fast_(torch.randn(1, 400, 8))  # tall is the same matrix transposed
    assert picked == [(1, 8, 400), (1, 400, 8)]
    picked.clear()
    fast.flatten_fast_(torch.randn(1, 16, 16))  # square: direct on a CPU with bf16 units
    assert picked == []
    # the crossovers fast_gram.prefers_gram states: 5.5 on an H200, 1.15 on a CPU with bf16 units, 1 without
    for kind, below, above in (("cuda", 5.4, 5.6), ("cpu", 1.1, 1.2), ("cpu-no-bf16", None, 1.0)):
        if below is not None:
            assert fast.route_for(2048, int(2048 * below), kind) == "direct", kind
        assert fast.route_for(2048, int(2048 * above), kind) == "gram", kind
    with pytest.raises(ValueError, match="route must be one of"):
        fast.flatten_fast_(torch.randn(1, 4, 8), route="gemm")


@pytest.mark.parametrize("has_bf16,want", [(True, torch.bfloat16), (False, torch.float32)])
def test_the_cpu_runs_the_low_steps_where_they_are_fastest(monkeypatch, has_bf16, want):
    """bfloat16 GEMMs on CPUs with bfloat16 units, float32 on the others (several times faster there)."""
    monkeypatch.setattr(fast, "_cpu_has_bf16", lambda: has_bf16)
    x = torch.randn(1, 6, 9)
    assert fast.low_dtype(x) == want
    seen = []
    real = polar.polar_factor

    def spy(x3, *a, gemm_dtypes=None, **k):
        seen.extend(gemm_dtypes)
        return real(x3, *a, gemm_dtypes=gemm_dtypes, **k)

    monkeypatch.setattr(polar, "polar_factor", spy)
    fast.flatten_fast_(x.clone(), route="direct")
    assert seen[fast.PRECISE_STEPS :] == [want] * (fast.STEPS - fast.PRECISE_STEPS)
    assert fast.low_dtype(x.double()) == (torch.bfloat16 if has_bf16 else torch.float64)


def test_a_nan_from_eigh_is_caught(monkeypatch):
    """The CPU's r×r part: a non-finite P (a LAPACK fault) flags the matrix for the fallback."""
    from isoloco_kernels.flatten import exact

    real = exact.eigh_polar

    calls = []

    def poisoned(g, *args, **kwargs):  # one matrix a call (the default plan); the third one
        p, nuc, ok = real(g, *args, **kwargs)
        calls.append(p.shape[0])
        if len(calls) == 3:
            p[-1, 0, 0] = float("nan")
        return p, nuc, ok

    monkeypatch.setattr(exact, "eigh_polar", poisoned)
    x = with_spectrum(3, 12, 70, spectrum("geometric", 12, 1e2), gen("gram-nan-eigh")).float()
    out, recomputed = _gram(x, "eigh")
    assert calls == [1, 1, 1] and recomputed == (2,)
    assert bool(torch.isfinite(out).all())
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", torch.float32, 1e2)


def test_the_small_side_follows_the_device():
    assert fast_gram.small_side_for(torch.zeros(1)) == "eigh"
    with pytest.raises(ValueError, match="small must be one of"):
        fast_gram.flatten_fast_gram_(torch.randn(1, 4, 9), fast._fallback, fast.RECORDER, small="svd")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_gram_route_keeps_the_contract():
    """On the GPU the r×r part is the schedule and the application 3xTF32 (tensor cores)."""
    x = with_spectrum(2, 64, 700, spectrum("geometric", 64, 1e3), gen("cuda-gram")).float().cuda()
    assert fast_gram.small_side_for(x) == "iterate"
    out, recomputed = _gram(x, None)
    assert recomputed == () and out.is_cuda
    assert flatness(out, x) <= 1e-3
    assert rel_err(out, iso_flatten_ref(x)) <= method_tol("fast", torch.float32, 1e3)
    for name, d in captured_pseudo_gradients():
        out, _ = _gram(d.cuda(), None)
        assert flatness(out.reshape(d.shape), d) <= FLATNESS["fast"], name


@pytest.mark.parametrize("route,small", [("direct", None), ("gram", "iterate"), ("gram", "eigh")])
def test_the_work_models_are_what_the_flop_counter_counts(route, small):
    """torch.utils.flop_counter sees every out-of-place GEMM; the in-place baddbmm_ of the Gram
    matrices (A₀, the certificate's) and the linalg ops (Cholesky, eigh) it does not see, so those
    are added from their formulas: the sum is the work model, exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    b, r, k = 2, 24, 200
    x = with_spectrum(b, r, k, spectrum("geometric", r, 1e2), gen("flops")).float()
    with FlopCounterMode(display=False) as fc, warnings.catch_warnings():
        warnings.simplefilter("error", FlattenFallbackWarning)  # a fallback would add work
        if route == "direct":
            fast.flatten_fast_(x.clone(), route="direct", low=torch.float32)
        else:
            fast_gram.flatten_fast_gram_(x.clone(), fast._fallback, fast.RECORDER, small=small)
    counted = fc.get_total_flops()
    gram64 = 2.0 * k * r * r  # A₀ or the certificate's Gram matrix: an in-place baddbmm_
    if route == "direct":
        model = fast_gram.direct_work(k, r, fast.PRECISE_STEPS, fast.STEPS)
        unseen = gram64 + r**3 / 3  # + its Cholesky
    else:
        model = fast_gram.gram_work(k, r, small)
        unseen = gram64 + (r**3 / 3 if small == "iterate" else model["eigh"])
    assert counted + b * unseen == pytest.approx(b * sum(model.values()), rel=1e-12)


@pytest.mark.parametrize("small", SMALL)
@pytest.mark.parametrize("shape", [(1, 96, 6000), (3, 64, 700), (2, 300, 40)])
def test_the_scratch_is_within_its_model(small, shape):
    """MemTracker's peak of the route beside the bucket (every tensor it allocates) ≤ fast_gram.workspace:
    r×r matrices and column blocks, never a copy of the bucket beyond half of it (and at most
    COLUMN_BLOCK_BYTES of float64 blocks for large matrices)."""
    b, m, n = shape
    x = with_spectrum(b, m, n, spectrum("geometric", min(m, n), 1e2), gen(("mem", shape))).float()
    scratch = _scratch(x, lambda: _gram_in_place(x, small))
    assert 0 < scratch <= b * fast_gram.workspace(m, n), (scratch, b * fast_gram.workspace(m, n))


@pytest.mark.parametrize("method", ["gram", "fast-gram"])
def test_a_large_matrix_is_read_in_capped_blocks(monkeypatch, method):
    """With gram.COLUMN_BLOCK_BYTES scaled down to 64 KiB, a 1 MB matrix is read in blocks: the
    scratch stays near the cap and the r×r matrices, far below the half-the-matrix default of before
    (the cap is what bounds llama-8b's 128256 × 4096 matrices), and buckets.method_workspace bounds it."""
    from isoloco_kernels.flatten import registry as buckets

    cap = 64 << 10
    monkeypatch.setattr(gram, "COLUMN_BLOCK_BYTES", cap)
    x = with_spectrum(1, 16, 16000, spectrum("geometric", 16, 1e2), gen("capped")).float()
    want = iso_flatten_ref(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlattenFallbackWarning)
        scratch = _scratch(
            x, (lambda: gram.flatten_gram_(x)) if method == "gram" else (lambda: _gram_in_place(x, "iterate"))
        )
    bound = (
        buckets.method_workspace("gram", 16, 16000, torch.float32)
        if method == "gram"
        else fast_gram.workspace(16, 16000)
    )
    assert scratch <= bound <= 2 * cap + 100 * 16 * 16 * 8, (scratch, bound)
    assert rel_err(x, want) <= 1e-4


@pytest.mark.parametrize("small", SMALL)
def test_a_certified_result_that_does_not_fit_is_refused(small):
    """Well conditioned (κ ≈ 6: certified, no fallback) but its Iso-C result reaches ~2.1e5, beyond
    float16: the route's own fit check refuses it, naming the matrix, and writes nothing."""
    big = 0.9 * torch.finfo(torch.float16).max
    x = torch.zeros(2, 2, 40, dtype=torch.float16)
    x[1, 0, :] = big
    x[1, 1, 0] = big
    x[0] = torch.randn(2, 40, generator=gen("fits")).to(torch.float16)
    assert float(iso_flatten_ref(x[1:].float()).abs().max()) > 65504  # the construction, checked
    keep = x.clone()
    with pytest.raises(ik.ResultOverflowError, match=r"matrix 1: the Iso-C result does not fit"):
        fast_gram.flatten_fast_gram_(x, fast._fallback, fast.RECORDER, small=small)
    assert torch.equal(x, keep)
