"""The CUDA kernels (csrc/kernels) against reference.py in float64, through the public ops
(torch.ops.isoloco.iso_scale_ / nesterov_outer_) with one backend forced at a time: the compiled
extension (csrc, _C loaded) or the same kernels through CuPy/NVRTC (_cupy.py). The private entry
points (csrc_* ops, _cupy.*) check nothing: the public ops check once, before any backend runs.

Skipped without a GPU; each backend is skipped with its reason when it is absent.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from isoloco_kernels.dispatch import table as dispatch
from isoloco_kernels.reference import iso_flatten_ref, nesterov_ref, polar_ref
from tests.helpers import DTYPES, TOL, rel_err, reset_tf32, spectrum, with_spectrum

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"
BACKENDS = ["ext", "cupy"]
_NAMES = {"ext": "csrc (compiled extension)", "cupy": "csrc through CuPy/NVRTC"}


@pytest.fixture(autouse=True)
def _only_backend(request, monkeypatch):
    """For a test parametrized with `backend`: the public ops' CUDA tables hold that candidate
    only (skipped with its reason where it cannot run), so the op's checks run before it."""
    backend = getattr(request.node, "callspec", None) and request.node.callspec.params.get("backend")
    if backend is None:
        return
    for op in ("iso_scale_", "nesterov_outer_"):
        (cand,) = [c for c in dispatch.TABLES[(op, "cuda")] if c.name == _NAMES[backend]]
        ok, why = cand.available()
        if not ok:
            pytest.skip(f"{cand.name} unavailable: {why}")
        monkeypatch.setitem(dispatch.TABLES, (op, "cuda"), [cand])


def _iso_scale(x, q):
    return torch.ops.isoloco.iso_scale_(x, q)


def _nesterov(params, bufs, updates, lr, momentum, amax=None):
    torch.ops.isoloco.nesterov_outer_(params, bufs, updates, lr, momentum, amax)


ISO_SCALE = {b: _iso_scale for b in BACKENDS}
NESTEROV = {b: _nesterov for b in BACKENDS}


def _need(backend: str) -> None:
    """The backend was forced (or the test skipped) by `_only_backend`."""
    assert [c.name for c in dispatch.TABLES[("iso_scale_", "cuda")]] == [_NAMES[backend]]


def _iso_scale_ref(x, q):
    """(x ← s̄·q, s̄) in float64 from the inputs as given."""
    m, n = x.shape[-2:]
    x64, q64 = x.detach().cpu().double(), q.detach().cpu().double()
    s = (x64 * q64).sum((-2, -1)) / min(m, n)
    return s[..., None, None] * q64, s


def _pair(shape, gen, xd, qd=None):
    """x and q shaped like a matrix and its polar factor: ⟨x, q⟩ > 0 without cancellation in the
    sum, ‖q‖_F ≈ √min(m, n), so s̄·q has x's magnitude (and fits in float16)."""
    m, n = shape[-2:]
    x64 = torch.randn(shape, generator=gen, dtype=torch.float64)
    q64 = (0.5 * x64 + torch.randn(shape, generator=gen, dtype=torch.float64)) * (min(m, n) / (m * n)) ** 0.5
    return x64.to(DEV, xd), q64.to(DEV, qd or xd)


# ---------------------------------------------------------------------------------------------
# iso_scale_

SHAPES = [
    (1, 37),  # 1×n
    (41, 1),  # n×1
    (300, 17),  # tall
    (17, 300),  # wide
    (7, 9),  # L = 63: no full vector at the end
    (5, 33, 65),  # batched, odd
    (3, 128, 64),  # batched, vector-aligned
    (1, 70001),  # several chunks in one matrix
    (2, 300, 301),  # several chunks, batched, odd
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_iso_scale_matches_reference(backend, shape, dtype):
    _need(backend)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}{dtype}".encode()))
    x, q = _pair(shape, gen, dtype)
    want_x, want_s = _iso_scale_ref(x, q)
    s = ISO_SCALE[backend](x, q)
    torch.cuda.synchronize()
    assert s.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert s.shape == x.shape[:-2]
    assert torch.isfinite(x).all() and torch.isfinite(s).all()
    assert rel_err(s, want_s) <= TOL[("iso_scale", dtype)]
    assert rel_err(x, want_x) <= TOL[("iso_scale", dtype)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("xd,qd", [(a, b) for a in DTYPES for b in DTYPES if a != b], ids=str)
def test_iso_scale_mixed_dtypes(backend, xd, qd):
    _need(backend)
    gen = torch.Generator().manual_seed(7)
    x, q = _pair((3, 50, 31), gen, xd, qd)
    want_x, want_s = _iso_scale_ref(x, q)
    s = ISO_SCALE[backend](x, q)
    tol = max(TOL[("iso_scale", xd)], TOL[("iso_scale", qd)])
    assert rel_err(s, want_s) <= tol and rel_err(x, want_x) <= TOL[("iso_scale", xd)]
    assert q.dtype == qd  # q untouched in dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_iso_scale_of_polar_factor_is_iso_c(backend, dtype):
    _need(backend)
    gen = torch.Generator().manual_seed(3)
    x64 = torch.randn(4, 40, 24, generator=gen, dtype=torch.float64)
    q64, _ = polar_ref(x64)
    x, q = x64.to(DEV, dtype), q64.to(DEV, dtype)
    ISO_SCALE[backend](x, q)
    # Rounding x and q to dtype costs up to one TOL each.
    assert rel_err(x, iso_flatten_ref(x64)) <= 3 * TOL[("iso_scale", dtype)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_iso_scale_non_contiguous_writes_only_the_view(backend, dtype):
    _need(backend)
    gen = torch.Generator().manual_seed(11)
    # x: every other column of a NaN-poisoned buffer, transposed; q: a transposed view.
    base = torch.full((3, 40, 2 * 23), float("nan"), dtype=dtype, device=DEV)
    x = base[:, :, ::2].transpose(-1, -2)
    x0, q = _pair((3, 40, 23), gen, dtype)
    x.copy_(x0.transpose(-1, -2))
    q = q.transpose(-1, -2)
    assert not x.is_contiguous() and not q.is_contiguous()
    want_x, want_s = _iso_scale_ref(x, q)
    s = ISO_SCALE[backend](x, q)
    assert rel_err(s, want_s) <= TOL[("iso_scale", dtype)]
    assert rel_err(x, want_x) <= TOL[("iso_scale", dtype)]
    assert torch.isnan(base[:, :, 1::2]).all()  # the gaps were not written


@pytest.mark.parametrize("backend", BACKENDS)
def test_iso_scale_misaligned_storage_uses_the_scalar_path(backend):
    _need(backend)
    gen = torch.Generator().manual_seed(5)
    x0, q = _pair((2, 64, 48), gen, torch.float32)
    buf = torch.empty(1 + x0.numel(), device=DEV)
    x = buf[1:].view(2, 64, 48)  # 4-byte offset: not 16-byte aligned
    x.copy_(x0)
    want_x, want_s = _iso_scale_ref(x, q)
    s = ISO_SCALE[backend](x, q)
    assert rel_err(s, want_s) <= TOL[("iso_scale", torch.float32)]
    assert rel_err(x, want_x) <= TOL[("iso_scale", torch.float32)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_iso_scale_is_deterministic_and_refuses_aliasing(backend):
    _need(backend)
    gen = torch.Generator().manual_seed(2)
    x0, q = _pair((2, 513, 257), gen, torch.float32)
    s1 = ISO_SCALE[backend](x0.clone(), q)
    s2 = ISO_SCALE[backend](x0.clone(), q)
    assert torch.equal(s1, s2)  # fixed reduction order: bit-identical
    # q overlapping x (x itself, or a view of x's storage shifted by one element): refused before
    # any kernel runs, nothing written
    store = torch.empty(1 + x0.numel(), device=DEV)
    x = store[1:].view(x0.shape)
    x.copy_(x0)
    for q_alias in (x, store[:-1].view(x0.shape)):
        with pytest.raises(RuntimeError, match="q shares memory with x"):
            ISO_SCALE[backend](x, q_alias)
        assert torch.equal(x, x0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_iso_scale_empty(backend):
    _need(backend)
    for shape in [(0, 5, 5), (3, 0, 4), (4, 0)]:
        x = torch.empty(shape, device=DEV)
        s = ISO_SCALE[backend](x, torch.empty(shape, device=DEV))
        assert s.shape == shape[:-2] and (s == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_iso_scale_bad_input_changes_nothing(backend):
    _need(backend)
    x = torch.randn(4, 6, device=DEV)
    before = x.clone()
    with pytest.raises((ValueError, RuntimeError), match="shape"):
        ISO_SCALE[backend](x, torch.randn(6, 4, device=DEV))
    with pytest.raises((TypeError, RuntimeError), match="dtype"):
        ISO_SCALE[backend](x, torch.ones(4, 6, device=DEV, dtype=torch.int32))
    with pytest.raises((ValueError, RuntimeError), match=r"\[m, n\]"):
        ISO_SCALE[backend](x.view(24), torch.randn(24, device=DEV))
    assert torch.equal(x, before)


# ---------------------------------------------------------------------------------------------
# nesterov_outer_

SIZES = [(1,), (7,), (8192,), (8193,), (3 * 8192 + 5,), (33, 17), (0,), (4, 1, 9)]


def _nesterov_case(pd, bd, ud, gen, sizes=SIZES):
    ps = [torch.randn(s, generator=gen, dtype=torch.float64).to(DEV, pd) for s in sizes]
    bs = [torch.randn(s, generator=gen, dtype=torch.float64).to(DEV, bd) for s in sizes]
    us = [torch.randn(s, generator=gen, dtype=torch.float64).to(DEV, ud) for s in sizes]
    return ps, bs, us


def _check_nesterov(ps, bs, us, p0, b0, lr, mu):
    for i, (p, b, u) in enumerate(zip(ps, bs, us)):
        want_p, want_b = nesterov_ref(p0[i], b0[i], u, lr, mu)
        assert torch.isfinite(p).all() and torch.isfinite(b).all()
        assert rel_err(b, want_b) <= TOL[("update", b.dtype)], f"buf {i} {tuple(b.shape)}"
        assert rel_err(p, want_p) <= TOL[("update", p.dtype)], f"param {i} {tuple(p.shape)}"


COMBOS = [(d, d, d) for d in DTYPES] + [
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float16, torch.float32, torch.float32),
    (torch.float64, torch.float32, torch.float16),
    (torch.float32, torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(d)[6:] for d in c))
def test_nesterov_matches_reference(backend, combo):
    _need(backend)
    gen = torch.Generator().manual_seed(zlib.crc32(str(combo).encode()))
    ps, bs, us = _nesterov_case(*combo, gen)
    p0, b0 = [p.clone() for p in ps], [b.clone() for b in bs]
    NESTEROV[backend](ps, bs, us, 0.7, 0.9, None)
    _check_nesterov(ps, bs, us, p0, b0, 0.7, 0.9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nesterov_mixed_dtype_groups_in_one_call(backend):
    _need(backend)
    gen = torch.Generator().manual_seed(4)
    ps, bs, us = [], [], []
    for k, (pd, bd, ud) in enumerate(COMBOS):
        a, b, c = _nesterov_case(pd, bd, ud, gen, sizes=[(k * 977 + 3,)])
        ps += a
        bs += b
        us += c
    p0, b0 = [p.clone() for p in ps], [b.clone() for b in bs]
    NESTEROV[backend](ps, bs, us, 1.8, 0.8, None)
    _check_nesterov(ps, bs, us, p0, b0, 1.8, 0.8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nesterov_non_contiguous_and_misaligned(backend, dtype):
    _need(backend)
    gen = torch.Generator().manual_seed(9)
    base = torch.full((64, 2 * 40), float("nan"), dtype=dtype, device=DEV)
    p = base[:, ::2].t()  # strided, poisoned gaps
    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    flat = torch.randn(1 + 40 * 64, generator=gen, dtype=torch.float64).to(DEV, dtype)
    b = flat[1:].view(40, 64)  # misaligned by one element
    u = torch.randn(64, 40, generator=gen, dtype=torch.float64).to(DEV, dtype).t()
    p0, b0 = p.clone(), b.clone()
    NESTEROV[backend]([p], [b], [u], 0.5, 0.9, None)
    _check_nesterov([p], [b], [u], [p0], [b0], 0.5, 0.9)
    assert torch.isnan(base[:, 1::2]).all()  # gaps untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_nesterov_bad_input_changes_nothing(backend):
    _need(backend)
    gen = torch.Generator().manual_seed(1)
    ps, bs, us = _nesterov_case(torch.float32, torch.float32, torch.float32, gen, sizes=[(5,), (6,)])
    snapshot = [t.clone() for t in ps + bs]

    def unchanged():
        return all(torch.equal(a, b) for a, b in zip(ps + bs, snapshot))

    with pytest.raises((ValueError, RuntimeError), match="same shape"):
        NESTEROV[backend](ps, bs, [us[0], us[0]], 0.1, 0.9, None)
    with pytest.raises((ValueError, RuntimeError), match="one entry"):
        NESTEROV[backend](ps, bs[:1], us, 0.1, 0.9, None)
    with pytest.raises((ValueError, RuntimeError), match="amax"):
        NESTEROV[backend](ps, bs, us, 0.1, 0.9, [1.0, 1.0, 1.0])
    with pytest.raises((ValueError, RuntimeError), match="lr"):
        NESTEROV[backend](ps, bs, us, float("nan"), 0.9, None)
    with pytest.raises((TypeError, RuntimeError), match="buf 1"):
        NESTEROV[backend](ps, [bs[0], bs[1].half()], us, 0.1, 0.9, None)
    assert unchanged()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nesterov_refuses_bad_written_tensors_before_writing(backend):
    """Every backend checks all written tensors first: an expanded param, one buffer shared by two
    params, an infinite lr — an error naming it, nothing written."""
    _need(backend)
    gen = torch.Generator().manual_seed(2)
    ps, bs, us = _nesterov_case(torch.float32, torch.float32, torch.float32, gen, sizes=[(6,), (6,)])
    snapshot = [t.clone() for t in ps + bs]
    expanded = torch.randn(1, device=DEV).expand(6)
    with pytest.raises(RuntimeError, match="param 1 .*overlap"):
        NESTEROV[backend]([ps[0], expanded], bs, us, 0.1, 0.9, None)
    with pytest.raises(RuntimeError, match="buf 0 and .*buf 1 overlap"):
        NESTEROV[backend](ps, [bs[0], bs[0]], us, 0.1, 0.9, None)
    with pytest.raises((ValueError, RuntimeError), match="lr"):
        NESTEROV[backend](ps, bs, us, float("inf"), 0.9, None)
    assert all(torch.equal(a, b) for a, b in zip(ps + bs, snapshot))


# ---------------------------------------------------------------------------------------------
# The flatten methods on CUDA (polar, gram, auto), with the user's TF32 switched on, on 1×n /
# n×1 shapes and in float64: the accuracy contract and an unchanged TF32 setting.


def _tf32_on(how: str) -> None:
    if how == "legacy":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif how == "new":
        torch.backends.cuda.matmul.fp32_precision = "tf32"


@pytest.fixture
def tf32_restored():
    yield
    reset_tf32()


def _spectral(shape, cond, seed, dtype):
    b, m, n = shape
    x64 = with_spectrum(b, m, n, spectrum("geometric", min(m, n), cond=cond), torch.Generator().manual_seed(seed))
    return x64, x64.to(DEV, dtype)


FLATTEN_SHAPES = [(2, 64, 96), (3, 96, 40), (2, 1, 300), (2, 300, 1), (1, 1, 1)]
# polar with IEEE float32 GEMMs at κ 1e3 on these shapes: measured ≤ 6.7e-6 (CPU, 4 seeds; the
# H200 run: 6.4e-6 … 1.5e-5 on real buckets). TF32 GEMM operands: 4.1e-4 (1×1) … 7.5e-3, so 1e-4
# tells a TF32 leak apart where polar's contract (1e-3) would not.
POLAR_IEEE_TOL = 1e-4


@pytest.mark.parametrize("tf32", ["off", "legacy", "new"])
@pytest.mark.parametrize("method", ["polar", "gram", "auto"])
@pytest.mark.parametrize("shape", FLATTEN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_flatten_float32_with_tf32_on(tf32_restored, tf32, method, shape):
    import isoloco_kernels as ik
    from isoloco_kernels.flatten.registry import resolve_method
    from tests.helpers import gram_tol

    _tf32_on(tf32)
    before = (
        torch.backends.cuda.matmul.fp32_precision if hasattr(torch.backends.cuda.matmul, "fp32_precision") else None
    )
    _, x = _spectral(shape, 1e3, zlib.crc32(f"{shape}{method}".encode()), torch.float32)
    want = iso_flatten_ref(x.cpu().double())  # of the float32 input as given
    served = resolve_method(method, x)
    ik.iso_merge_([x], method=method)
    tol = gram_tol(torch.float32, 1e3) if served == "gram" else POLAR_IEEE_TOL
    assert rel_err(x, want) <= tol
    if before is not None:
        assert torch.backends.cuda.matmul.fp32_precision == before


@pytest.mark.parametrize("method", ["polar", "gram", "auto", "svd", "eigh"])
@pytest.mark.parametrize("shape", FLATTEN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_flatten_float64(method, shape):
    """float64 on CUDA: every method within its float64 contract (auto: exact, as on the CPU)."""
    import isoloco_kernels as ik
    from isoloco_kernels.flatten.exact import EIGH_MIN_RATIO
    from tests.helpers import gram_tol, method_tol

    cond = 1e4
    x64, x = _spectral(shape, cond, zlib.crc32(f"{shape}{method}64".encode()), torch.float64)
    ik.iso_merge_([x], method=method)
    # eigh serves float64 only to κ 1/EIGH_MIN_RATIO (1e3), svd the rest: its row at most there
    eigh_cond = min(cond, 1 / EIGH_MIN_RATIO[torch.float64])
    tol = {
        "polar": TOL[("polar", torch.float64)],
        "gram": gram_tol(torch.float64, cond),
        "eigh": method_tol("eigh", torch.float64, eigh_cond),
    }.get(method, TOL[("svd", torch.float64)])
    assert rel_err(x, iso_flatten_ref(x64)) <= tol


# ---------------------------------------------------------------------------------------------
# The tensor-core grades on CUDA (polar_bf16, fast): each method's contract (its error row and
# flatness, tests/helpers.py), rank-deficient input recomputed, and for polar_bf16 the float32
# accuracy of its last steps, with TF32 switched on or off by the user.

TC_METHODS = ("polar_bf16", "fast")
TC_SHAPES = [(2, 64, 96), (3, 96, 40), (2, 128, 128), (2, 1, 300), (2, 300, 1), (1, 1, 1)]
# polar_bf16 ends with float32 steps, which bring every singular value of Q to 1 to float32
# round-off: max |σ_i / mean σ − 1| of its float32 output measured ≤ 4.1e-7 on the CPU (κ 1e2,
# these shapes, 4 seeds). TF32 in those steps (~2^-11 per operand) or bfloat16 to the end leave
# ≥ 1e-3.
BF16_FINAL_SPREAD = 4e-6


def _spread(out: torch.Tensor) -> float:
    """max |σ_i / mean σ − 1| of the output's own singular values, worst matrix."""
    s = torch.linalg.svdvals(out.detach().to("cpu", torch.float64))
    return float((s / s.mean(-1, keepdim=True) - 1).abs().max())


def tc_contract(method: str, dtype: torch.dtype, shape, device) -> torch.Tensor:
    """`method` on a κ-1e2 input of `shape` and `dtype` on `device`: its error row and flatness (no
    fallback: well-conditioned input); returns the output."""
    import isoloco_kernels as ik
    from isoloco_kernels.flatten.registry import METHODS
    from tests.helpers import FLATNESS, flatness, method_tol

    b, m, n = shape
    g = torch.Generator().manual_seed(zlib.crc32(f"{method}{shape}{dtype}".encode()))
    x = with_spectrum(b, m, n, spectrum("geometric", min(m, n), cond=1e2), g).to(device, dtype)
    out = ik.iso_flatten(x, method=method)
    assert out.dtype == dtype and out.device == x.device and torch.isfinite(out).all()
    assert METHODS[method].stats.last().last_recomputed == ()
    assert rel_err(out, iso_flatten_ref(x.cpu())) <= method_tol(method, dtype, 1e2)
    assert flatness(out, x) <= FLATNESS[method]
    return out


def tc_rank_deficient(method: str, device) -> None:
    """Rank 3 of 128 (512 × 128, float32): a bfloat16 step would fill the null space; the method
    certifies the rank and recomputes both matrices exactly, with its warning."""
    import isoloco_kernels as ik
    from isoloco_kernels.flatten.registry import METHODS

    g = torch.Generator().manual_seed(zlib.crc32(f"rank3{method}".encode()))
    x = (torch.randn(2, 512, 3, generator=g) @ torch.randn(2, 3, 128, generator=g)).to(device)
    with pytest.warns(METHODS[method].stats.warning, match="2 of 2"):
        out = ik.iso_flatten(x, method=method)
    assert rel_err(out, iso_flatten_ref(x.cpu())) <= TOL[("svd", torch.float32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", TC_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("method", TC_METHODS)
def test_cuda_tensor_core_grades_keep_their_contract(method, shape, dtype):
    tc_contract(method, dtype, shape, DEV)


@pytest.mark.parametrize("method", TC_METHODS)
def test_cuda_tensor_core_grades_recompute_rank_deficient_input(method):
    tc_rank_deficient(method, DEV)


@pytest.mark.parametrize("tf32", ["off", "legacy", "new"])
@pytest.mark.parametrize("shape", TC_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_polar_bf16_last_steps_are_float32_accurate(tf32_restored, tf32, shape):
    _tf32_on(tf32)
    before = (
        torch.backends.cuda.matmul.fp32_precision if hasattr(torch.backends.cuda.matmul, "fp32_precision") else None
    )
    out = tc_contract("polar_bf16", torch.float32, shape, DEV)
    assert _spread(out) <= BF16_FINAL_SPREAD
    if before is not None:
        assert torch.backends.cuda.matmul.fp32_precision == before


# ---------------------------------------------------------------------------------------------
# CUDA graphs: torch.compile's CUDA graphs refuse the host-bound ops (tagged cudagraph_unsafe)
# and still compute the right result.


@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"), reason="no cudagraph_unsafe tag in this torch")
def test_reduce_overhead_compile_skips_cuda_graphs_for_the_nesterov_op():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    p, b, u = (torch.randn(1000, device=DEV) for _ in range(3))

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(p, b, u):
        torch.ops.isoloco.nesterov_outer_([p], [b], [u * 2], 0.5, 0.9, None)

    for _ in range(3):  # the first calls record, the later ones replay what was recorded
        want_p, want_b = nesterov_ref(p, b, u * 2, 0.5, 0.9)
        step(p, b, u)
        torch.cuda.synchronize()
        tol = TOL[("update", torch.float32)]
        assert rel_err(p, want_p) <= tol and rel_err(b, want_b) <= tol
    # Kept out of every CUDA graph: inductor either skips CUDA graphs for the whole graph, or (graph
    # partition, the default since torch 2.9) cuts it into a captured partition (u * 2) and one run
    # eagerly (the op). Without the tag the graph is one captured partition and neither count moves.
    skipped, parts = counters["inductor"]["cudagraph_skips"], counters["inductor"]["cudagraph_partitions"]
    assert skipped >= 1 or parts >= 2, (skipped, parts)
