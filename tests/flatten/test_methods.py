"""The contract every flatten method keeps, run over isoloco_kernels.flatten.METHODS.

Each check is a function of the method's name, so a new method gets all of them from its registry
line and its tolerance row (tests/helpers.py TOL_ROWS); `test_a_new_method_joins_everything`
shows that with a toy method. Against reference.py in float64: shapes 1×n, n×1, 1×1, square, tall,
wide, batched; every dtype; non-contiguous views written in place; zero rows, columns and matrices
staying exactly zero; rank-deficient input; extreme scales; bad input refused with nothing written;
zero-size buckets; the op's opcheck; every entry point taking the method. Method-specific tests
stay in test_flatten_exact.py, test_polar.py and test_gram.py.
"""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.flatten import exact, iteration_stats
from isoloco_kernels.flatten import registry as flatten
from isoloco_kernels.flatten.registry import METHODS, Method, resolve_method
from isoloco_kernels.reference import iso_flatten_ref, isoloco_step_ref, rank_tol
from tests.helpers import (
    COND_BANDS,
    DTYPES,
    PER_COND2,
    TOL,
    TOL_ROWS,
    cond,
    gen,
    gram_tol,
    method_tol,
    randn,
    rel_err,
    spectrum,
    with_spectrum,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # small computations (tests/conftest.py)

NAMES = tuple(METHODS)
SHAPES = [(1, 9), (9, 1), (1, 1), (7, 7), (13, 5), (5, 13), (3, 6, 4), (4, 5, 17), (2, 33, 8), (1, 300)]


def _served_by(method: str, x: torch.Tensor) -> str:
    return resolve_method(method, x if x.ndim == 3 else x.unsqueeze(0))


def _tol(method: str, x: torch.Tensor, scale: float = 1.0, kappa: float | None = None) -> float:
    """The tolerance row of the method that serves x (auto: what it resolves to), at x's condition
    number (or `kappa`, for inputs with exact zero lines)."""
    served = _served_by(method, x)
    c = (cond(x) if kappa is None else kappa) if (served in PER_COND2 or served in COND_BANDS) else 1.0
    return method_tol(served, x.dtype, c) * scale


@contextlib.contextmanager
def _no_fallback(method: str, x: torch.Tensor):
    """Fails the test if the serving method's residual check sent any matrix on (its warning is
    an error inside; its statistics must show no recomputed matrix)."""
    stats = METHODS[_served_by(method, x)].stats
    with warnings.catch_warnings():
        if stats is not None:
            warnings.simplefilter("error", stats.warning)
        yield
    if stats is not None:
        assert stats.last().last_recomputed == ()


def _flatten(x: torch.Tensor, method: str) -> torch.Tensor:
    with _no_fallback(method, x):
        return ik.iso_flatten(x, method=method)


# ----------------------------------------------------------------------------------------------
# The checks (functions of the method's name)


def check_matches_reference(method, dtype, shape):
    x = randn(shape, dtype, ("contract", shape, str(dtype)))
    out = _flatten(x, method)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, iso_flatten_ref(x)) <= _tol(method, x)


def check_in_place_on_non_contiguous_views(method):
    base = randn((3, 12, 20), torch.float32, "views")
    view = base.transpose(-1, -2)  # [3, 20, 12], non-contiguous, tall
    ref = iso_flatten_ref(view)
    ptr = base.data_ptr()
    with _no_fallback(method, view):
        out = ik.iso_merge_([view], method=method)
    assert out[0] is view and base.data_ptr() == ptr
    assert rel_err(base.transpose(-1, -2), ref) <= _tol(method, view)
    strided = randn((10, 16), torch.float64, "strided")[::2, 1::3]
    ref2 = iso_flatten_ref(strided)
    with _no_fallback(method, strided):
        ik.iso_merge_([strided], method=method)
    assert rel_err(strided, ref2) <= _tol(method, strided)


def check_zero_rows_columns_matrices_stay_exactly_zero(method, dtype):
    x = randn((4, 10, 24), dtype, "zeros")
    x[0, 2] = 0
    x[0, 7] = 0  # two zero rows
    x[1, :, 5] = 0  # zero columns
    x[1, :, 20:] = 0
    x[2] = 0  # zero matrix
    out = _flatten(x, method)  # exact zeros lower the rank target: no fallback
    assert torch.isfinite(out).all()
    assert (out[0, 2] == 0).all() and (out[0, 7] == 0).all()
    assert (out[1, :, 5] == 0).all() and (out[1, :, 20:] == 0).all() and (out[2] == 0).all()
    assert rel_err(out, iso_flatten_ref(x)) <= _tol(method, x, kappa=1e2)
    t = randn((24, 10), dtype, "zeros-tall")  # tall, zero rows on the long side
    t[3] = 0
    t[:, 4] = 0  # and a zero column on the short side
    out_t = _flatten(t, method)
    assert (out_t[3] == 0).all() and (out_t[:, 4] == 0).all()
    assert rel_err(out_t, iso_flatten_ref(t)) <= _tol(method, t, kappa=1e2)
    # rank one: iso(a bᵀ) = (σ / r0) · â b̂ᵀ (a residual-checked method may recompute it)
    a, b = randn((10,), dtype, "a"), randn((8,), dtype, "b")
    r1 = torch.outer(a, b)
    expect = (a.norm() * b.norm() / 8) * torch.outer(a / a.norm(), b / b.norm())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", iteration_stats.FlattenFallbackWarning)
        out1 = ik.iso_flatten(r1, method=method)
    assert torch.isfinite(out1).all()
    assert rel_err(out1, expect) <= TOL[("exact", dtype)] * 10  # every checked method certifies rank


def check_rank_deficient_input_is_exact(method):
    """Rank 3 of 20: the exact methods cut it at reference.py's rank; a checked method recomputes
    every matrix (its warning, its count) instead of returning a wrong answer: polar and gram by
    their residual, polar_bf16 and fast by their rank certificates (bfloat16 steps would fill the
    null space)."""
    g = gen("rank3")
    x = torch.randn(2, 20, 3, generator=g, dtype=torch.float64) @ torch.randn(
        2, 3, 30, generator=g, dtype=torch.float64
    )
    stats = METHODS[_served_by(method, x)].stats
    if stats is None:
        out = _flatten(x, method)
    else:
        with pytest.warns(stats.warning, match="2 of 2"):
            out = ik.iso_flatten(x, method=method)
    assert rel_err(out, iso_flatten_ref(x)) <= TOL[("exact", torch.float64)]


def check_a_fallback_warning_raised_as_an_error_changes_nothing(method):
    """With warnings as errors, a method whose check hands a matrix on raises its warning before
    writing: iso_merge_ in slices of one matrix (the last slice in place) leaves the bucket as it
    was; a method that warns about nothing writes its result."""
    import os

    from isoloco_kernels.flatten import registry as bk

    g = gen("warn-as-error")
    x = torch.randn(3, 12, 20, generator=g, dtype=torch.float64).float()
    x[2] = (torch.randn(12, 2, generator=g) @ torch.randn(2, 20, generator=g)).float()  # rank 2
    keep = x.clone()
    stats = METHODS[_served_by(method, x)].stats
    old = os.environ.get(bk.WORKSPACE_ENV)
    os.environ[bk.WORKSPACE_ENV] = "1"  # one matrix per slice
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", iteration_stats.FlattenFallbackWarning)
            if stats is None:
                ik.iso_merge_([x], method=method)
                assert rel_err(x, iso_flatten_ref(keep)) <= _tol(method, keep, kappa=1e2)
                return
            with pytest.raises(iteration_stats.FlattenFallbackWarning):
                ik.iso_merge_([x], method=method)
    finally:
        if old is None:
            os.environ.pop(bk.WORKSPACE_ENV)
        else:
            os.environ[bk.WORKSPACE_ENV] = old
    assert torch.equal(x, keep)


def check_full_rank_equals_published_formula(method):
    x = randn((4, 9, 14), torch.float64, "published")
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    published = u @ torch.diag_embed(s.mean(-1, keepdim=True).expand_as(s)) @ vh
    assert rel_err(iso_flatten_ref(x), published) <= 1e-12  # one LAPACK SVD of a cond ~10 matrix
    assert rel_err(_flatten(x, method), published) <= _tol(method, x)


SCALES = [
    (1e37, torch.float32),
    (1e36, torch.float32),
    (1e-30, torch.float32),
    (1e300, torch.float64),
    (1e-300, torch.float64),
    (6e4 / 4, torch.float16),
]


def check_huge_and_tiny_finite_inputs(method):
    """Iso-C is homogeneous: a matrix scaled near its dtype's limits gets the scaled result (each
    method scales by a power of two first); the other matrix of the batch is unaffected."""
    base = randn((2, 6, 30), torch.float64, "scale")
    want = iso_flatten_ref(base)
    for factor, dtype in SCALES:
        x = base.clone()
        x[1] *= factor
        x = x.to(dtype)
        out = _flatten(x, method)
        assert torch.isfinite(out).all() and out[1].abs().max() > 0, (factor, dtype)
        unit = x.double()
        unit[1] /= factor  # compared at unit scale (the norms of 1e300-sized matrices overflow)
        tol = _tol(method, unit.to(dtype) if dtype != torch.float64 else unit)
        assert rel_err(out[0], iso_flatten_ref(x[0])) <= tol, (factor, dtype)
        assert rel_err(out[1].double() / factor, iso_flatten_ref(unit[1])) <= tol, (factor, dtype)
        assert rel_err(iso_flatten_ref(unit[1]), want[1]) <= 10 * TOL[("exact", dtype)]


def check_non_finite_input_raises_and_changes_nothing(method, bad):
    x = randn((3, 6, 9), torch.float32, "nonfinite")
    x[1, 2, 3] = float(bad)
    keep = x.clone()
    kind = "NaN" if bad == "nan" else "Inf"
    with pytest.raises(ValueError, match=rf"bucket 0: matrix 1 contains {kind}"):
        ik.iso_merge_([x], method=method)
    assert torch.equal(x.view(torch.int32), keep.view(torch.int32))
    with pytest.raises(ValueError, match=rf"matrix 1 contains {kind}"):
        torch.ops.isoloco.iso_flatten_(x, method)
    assert torch.equal(x.view(torch.int32), keep.view(torch.int32))
    if METHODS[method].checks_finite:  # the method called directly (no op check) refuses too
        with pytest.raises(ValueError, match=r"matrix 1 (gave a non-finite scale|contains (NaN|Inf))"):
            METHODS[method].run(x)
        assert torch.equal(x.view(torch.int32), keep.view(torch.int32))


def _set(i, value):
    def edit(buckets):
        buckets[i] = value

    return edit


def _poke(i, index, value):
    def edit(buckets):
        buckets[i][index] = value

    return edit


BAD_BUCKETS = [
    pytest.param(_poke(1, (2, 1, 3), float("nan")), r"bucket 1: matrix 2 contains NaN", id="nan"),
    pytest.param(_poke(2, (0, 0), float("-inf")), r"bucket 2: the matrix contains Inf", id="inf"),
    pytest.param(_set(2, torch.ones(3, 3, dtype=torch.int64)), r"bucket 2: dtype torch.int64", id="int"),
    pytest.param(_set(1, torch.randn(5)), r"bucket 1: expected a \[m, n\] matrix", id="ndim1"),
    pytest.param(_set(1, torch.randn(2, 2, 3, 3)), r"bucket 1: expected", id="ndim4"),
    pytest.param(_set(0, [[1.0, 2.0]]), r"bucket 0: expected a torch.Tensor", id="not-tensor"),
]


def check_bad_input_names_the_bucket_and_changes_nothing(method, edit, match):
    buckets = [randn((5, 6), torch.float32, 7), randn((3, 4, 4), torch.float32, 8), randn((2, 3), torch.float64, 9)]
    edit(buckets)
    before = [b.clone() if isinstance(b, torch.Tensor) else b for b in buckets]
    with pytest.raises((ValueError, TypeError), match=match):
        ik.iso_merge_(buckets, method=method)
    for b, b0 in zip(buckets, before):
        if isinstance(b, torch.Tensor):
            assert torch.equal(b.view(torch.uint8), b0.view(torch.uint8))  # bit-identical, NaN included


def check_empty_and_zero_size(method):
    assert ik.iso_merge_([], method=method) == []
    z, z2 = torch.empty(0, 4, 5), torch.empty(3, 0)
    out = ik.iso_merge_([z, z2], method=method)
    assert out[0] is z and out[1] is z2
    torch.ops.isoloco.iso_flatten_(torch.empty(2, 0, 7), method)


def check_opcheck(method):
    for x in (randn((2, 5, 3), torch.float32, 11), randn((6, 4), torch.float64, 12)):
        torch.library.opcheck(torch.ops.isoloco.iso_flatten_.default, (x, method))


def _isoloco_step_matches_reference(opt_cls, method, key):
    g = gen(key)
    p = [torch.randn(12, 30, generator=g), torch.randn(5, generator=g)]
    grads = [torch.randn(12, 30, generator=g), torch.randn(5, generator=g)]
    want, _ = isoloco_step_ref(p, [torch.zeros_like(t) for t in p], grads, lr=1.8, momentum=0.8)
    params = [torch.nn.Parameter(t.clone()) for t in p]
    opt = opt_cls(params, lr=1.8, momentum=0.8, method=method)
    for q, d in zip(params, grads):
        q.grad = d.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", iteration_stats.FlattenFallbackWarning)  # polar_bf16's cond
        opt.step()
    tol = max(
        TOL[("update", torch.float32)], 2 * method_tol(_served_by(method, grads[0]), torch.float32, cond(grads[0]))
    )
    for q, w in zip(params, want):
        assert rel_err(q, w) <= tol


def check_every_entry_point_takes_it(method):
    """IsoLoCo, the CLI, and (on a one-rank gloo group) sharded_iso_merge_ and ShardedIsoLoCo:
    the sharded plan and its checks run; the math is iso_merge_'s."""
    import os
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from isoloco_kernels.train.cli import build_parser

    _isoloco_step_matches_reference(ik.IsoLoCo, method, ("optim", method))
    assert build_parser().parse_args(["--iso-method", method]).iso_method == method
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        bk = [randn((3, 16, 40), torch.float32, "sharded0"), randn((24, 10), torch.float32, "sharded1")]
        want = [iso_flatten_ref(b) for b in bk]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", iteration_stats.FlattenFallbackWarning)
            got = ik.sharded_iso_merge_([b.clone() for b in bk], method=method)
        for o, w, b in zip(got, want, bk):
            assert rel_err(o, w) <= _tol(method, b)
        _isoloco_step_matches_reference(ik.ShardedIsoLoCo, method, ("sharded", method))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# The contract, for every registered method: each check with each of its cases (id, arguments)

CHECKS = [
    (check_matches_reference, [(f"{dt}-{sh}", (dt, sh)) for sh in SHAPES for dt in DTYPES]),
    (check_in_place_on_non_contiguous_views, [("", ())]),
    (check_zero_rows_columns_matrices_stay_exactly_zero, [(str(dt), (dt,)) for dt in (torch.float32, torch.float64)]),
    (check_rank_deficient_input_is_exact, [("", ())]),
    (check_a_fallback_warning_raised_as_an_error_changes_nothing, [("", ())]),
    (check_full_rank_equals_published_formula, [("", ())]),
    (check_huge_and_tiny_finite_inputs, [("", ())]),
    (check_non_finite_input_raises_and_changes_nothing, [(bad, (bad,)) for bad in ("nan", "inf")]),
    (check_bad_input_names_the_bucket_and_changes_nothing, [(p.id, tuple(p.values)) for p in BAD_BUCKETS]),
    (check_empty_and_zero_size, [("", ())]),
    (check_opcheck, [("", ())]),
    (check_every_entry_point_takes_it, [("", ())]),
]
CASES = [
    pytest.param(check, args, id=f"{check.__name__[len('check_') :]}{'-' * bool(cid)}{cid}")
    for check, cases in CHECKS
    for cid, args in cases
]


@pytest.mark.parametrize("method", NAMES)
@pytest.mark.parametrize("check,args", CASES)
def test_contract(method, check, args):
    check(method, *args)


def test_every_check_is_in_the_contract():
    assert {f.__name__ for f, _ in CHECKS} == {n for n in globals() if n.startswith("check_")}


def test_unknown_method_is_refused_everywhere():
    x = randn((5, 6), torch.float32, "qr")
    keep = x.clone()
    for call in (
        lambda: ik.iso_merge_([x], method="qr"),
        lambda: ik.iso_flatten(x, method="qr"),
        lambda: torch.ops.isoloco.iso_flatten_(x, "qr"),
        lambda: ik.IsoLoCo([torch.nn.Parameter(x)], method="qr"),
    ):
        with pytest.raises(
            ValueError,
            match=r"method must be one of \('auto', 'svd', 'eigh', 'polar', 'polar_bf16', 'polar_tf32x3', 'gram', 'fast'",
        ):
            call()
    assert torch.equal(x, keep)


# ----------------------------------------------------------------------------------------------
# The registry itself


def test_registry_reads_as_the_tuple_of_names_it_was():
    assert tuple(METHODS) == ("auto", "svd", "eigh", "polar", "polar_bf16", "polar_tf32x3", "gram", "fast")
    assert repr(METHODS) == repr(tuple(METHODS)) and "gram" in METHODS and "qr" not in METHODS
    assert tuple(m for m in METHODS if m != "auto") == (
        "svd",
        "eigh",
        "polar",
        "polar_bf16",
        "polar_tf32x3",
        "gram",
        "fast",
    )
    assert ik.backends()["methods"] == "svd, eigh, polar, polar_bf16, polar_tf32x3, gram, fast"


def test_registry_facts_hold_together():
    for name, m in METHODS.items():
        assert isinstance(m, Method) and callable(m.run), name
        assert name in TOL_ROWS or m.resolve is not None, f"{name}: no tolerance row in tests/helpers.py"
        if m.resolve is not None:  # auto: it resolves to a registered method, whose facts apply
            assert m.flops is None and m.stats is None
            continue
        work = m.flops(4096, 512)
        assert work and set(work) <= {"fp64", "bf16", "tf32x3", "tf32x2", flatten.COMPUTE} and min(work.values()) > 0, (
            name
        )
        if m.exact:
            assert m.stats is None and m.fallback is None and not m.checks_finite, name
        if m.stats is not None:
            assert issubclass(m.stats.warning, iteration_stats.FlattenFallbackWarning), name
            assert m.fallback in METHODS and METHODS[m.fallback].resolve is None, name
    # the models auto compares are the registry's: polar's float32 steps, gram's float64 ones
    assert flatten.flops_per_dtype("polar", 4096, 1024, "fp32") == {"fp32": 10 * (4.0 * 4096 * 1024**2 + 2.0 * 1024**3)}
    assert flatten.flops_per_dtype("auto", 10, 5) is None


# ----------------------------------------------------------------------------------------------
# Adding a method: its module, one registry line, one tolerance row


def test_a_new_method_joins_everything(monkeypatch):
    """A toy method (the exact svd under another name, counting its calls), added with one
    registry line and one tolerance row, passes the whole contract; the op and auto's routing pick
    it up (the benchmark harness too: bench/tests/test_harness.py)."""
    calls = []

    def toy_flatten_(x3):
        calls.append(tuple(x3.shape))
        exact.flatten_svd_(x3)

    monkeypatch.setitem(
        METHODS, "toy", Method(run=toy_flatten_, flops=lambda k, r: {"fp64": 8.0 * k * r * r}, exact=True)
    )
    monkeypatch.setitem(TOL_ROWS, "toy", TOL_ROWS["exact"])

    for check, cases in CHECKS:
        for _, args in cases:
            check("toy", *args)
    assert len(calls) > 40
    assert "toy" in ik.backends()["methods"]

    # auto runs whatever the registry holds under the name it resolves to
    x = randn((2, 8, 30), torch.float32, "auto-toy")
    served = resolve_method("auto", x)
    monkeypatch.setitem(METHODS, served, METHODS["toy"])
    calls.clear()
    assert rel_err(ik.iso_flatten(x, method="auto"), iso_flatten_ref(x)) <= TOL[("exact", torch.float32)]
    assert calls == [(2, 8, 30)]


METHOD_NAMES = ("svd", "eigh", "polar", "gram", "auto")


ops = torch.ops.isoloco


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cond(x: torch.Tensor) -> float:
    s = torch.linalg.svdvals(x.double())
    return float(s[..., 0].max() / s[..., -1].min())


def _tol_vs_reference(method: str, x: torch.Tensor) -> float:
    """Allowed relative error vs reference.py (the per-dtype table; gram's grows with κ²)."""
    if method == "gram":
        return gram_tol(x.dtype, _cond(x))
    if method == "polar":  # polar hands what it cannot certify to gram
        return max(TOL[("polar", x.dtype)], gram_tol(x.dtype, _cond(x)))
    return TOL[("exact", x.dtype)]  # svd, eigh; auto on the CPU is one of them


# ----------------------------------------------------------------------------------------------
# The matrix: every method × every hostile input


def _overflow(method):
    # float32 entries up to 3e38, result up to 2.8e38: s̄·scale overflowed before Q was applied
    # (svd/auto refused it as "does not fit")
    x = torch.randn(128, 160, generator=_gen(1))
    x = x / x.abs().max() * 3e38
    ref = iso_flatten_ref(x)
    ik.iso_merge_([x], method=method)
    assert torch.isfinite(x).all() and rel_err(x, ref) <= _tol_vs_reference(method, x)


def _subnormal(method):
    # float64 subnormals: gram's 1/amax overflowed (LinAlgError)
    x = torch.randn(12, 20, generator=_gen(2), dtype=torch.float64) * 1e-310
    ref = iso_flatten_ref(x * 2.0**1000) * 2.0**-1000
    ik.iso_merge_([x], method=method)
    # subnormals carry ~13 digits here, so the float64 row of the table still applies
    assert rel_err(x, ref) <= max(_tol_vs_reference(method, x), 1e-11)


def _rank_deficient(method):
    # a rank-2 product formed in float32: its rounding noise (~0.1·eps32·σ_1) is below the cut
    g = _gen(3)
    x = torch.randn(16, 2, generator=g) @ torch.randn(2, 24, generator=g)
    ref = iso_flatten_ref(x)
    assert int((torch.linalg.svdvals(ref) > 1e-6 * torch.linalg.svdvals(ref)[0]).sum()) == 2
    out = ik.iso_flatten(x, method=method)
    assert rel_err(out, ref) <= _tol_vs_reference(method, x)


def _cond_1e6(method):
    # κ 1e6 in float32: svd/eigh cut 10–98 % of the spectrum that reference.py keeps
    x = with_spectrum(1, 64, 256, spectrum("geometric", 64, 1e6), _gen(4))[0].float()
    ref = iso_flatten_ref(x)
    assert rel_err(ik.iso_flatten(x, method=method), ref) <= _tol_vs_reference(method, x)


def _inference(method):
    with torch.inference_mode():
        x = torch.randn(6, 10, generator=_gen(5))
    before = x.clone()
    with pytest.raises(RuntimeError, match=r"iso_flatten_: x is an inference tensor.*nothing was written"):
        ops.iso_flatten_(x, method)
    assert torch.equal(x, before)


def _expanded(method):
    # the raw op on an expanded view: gram wrote a wrong result into the base
    base = torch.randn(8, 16, generator=_gen(6))
    before = base.clone()
    with pytest.raises(RuntimeError, match=r"iso_flatten_: x has internal overlap"):
        ops.iso_flatten_(base[None].expand(3, 8, 16), method)
    assert torch.equal(base, before)


def _aliasing(method):
    base = torch.randn(10, 6, generator=_gen(7))
    before = base.clone()
    with pytest.raises(RuntimeError, match=r"bucket \d and bucket \d overlap"):
        ik.iso_merge_([base[:6], base[4:]], method=method)
    assert torch.equal(base, before)


HOSTILE_INPUTS = {
    "overflow": _overflow,
    "subnormal": _subnormal,
    "rank-deficient": _rank_deficient,
    "cond-1e6": _cond_1e6,
    "inference": _inference,
    "expanded": _expanded,
    "aliasing": _aliasing,
}


@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
@pytest.mark.parametrize("case", HOSTILE_INPUTS, ids=str)
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_method_on_every_hostile_input(method, case):
    HOSTILE_INPUTS[case](method)


# ----------------------------------------------------------------------------------------------
# One rank cut


@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_rank_cut_is_one_definition_relative_to_sigma_max_and_dtype():
    assert rank_tol(8, 16, torch.float32) == rank_tol(8, 16, torch.bfloat16) == rank_tol(16, 8, torch.float16)
    assert 3 * torch.finfo(torch.float32).eps < rank_tol(64, 256, torch.float32) < 1e-6  # κ 1e6 keeps all
    assert rank_tol(64, 256, torch.float64) < 1e-13
    x = torch.outer(torch.randn(10, generator=_gen(8)), torch.randn(8, generator=_gen(9)))  # float32 rank 1
    for method in METHOD_NAMES:
        out = ik.iso_flatten(x, method=method)
        s = torch.linalg.svdvals(out.double())
        assert float(s[1] / s[0]) < 1e-6, method  # rank one stays rank one


@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
@pytest.mark.parametrize("is_cuda", [True, False], ids=["cuda", "cpu"])
def test_auto_picks_svd_for_float64_on_every_device(is_cuda):
    x3 = types.SimpleNamespace(is_cuda=is_cuda, dtype=torch.float64, shape=(4, 64, 1024), device=None)
    assert flatten.resolve_method("auto", x3) == "svd"
