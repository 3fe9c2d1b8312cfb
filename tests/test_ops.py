"""The ops' own checks (ops.py): `iso_flatten_`'s schema default, `iso_scale_` and `nesterov_outer_` under the
finiteness rule (finite inputs, results that fit their dtype, never an overflowed intermediate), refusing
aliased, expanded and inference tensors with nothing written; each case against reference.py (float64)."""

from __future__ import annotations

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels._validate import ResultOverflowError
from isoloco_kernels.reference import iso_flatten_ref, nesterov_ref
from tests.helpers import TOL, rel_err


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_nesterov_refuses_an_expanded_param_before_writing():
    g = _gen(26)
    p0, b0, u0 = (torch.randn(6, generator=g) for _ in range(3))
    p1 = torch.randn(1, generator=g).expand(6)
    b1, u1 = torch.randn(6, generator=g), torch.randn(6, generator=g)
    before = p0.clone(), b0.clone()
    with pytest.raises(RuntimeError, match=r"param 1.*overlap"):
        torch.ops.isoloco.nesterov_outer_([p0, p1], [b0, b1], [u0, u1], 0.5, 0.9, None)
    assert torch.equal(p0, before[0]) and torch.equal(b0, before[1])


def test_nesterov_refuses_a_buffer_shared_by_two_params():
    g = _gen(27)
    ps = [torch.randn(6, generator=g) for _ in range(2)]
    buf = torch.randn(6, generator=g)
    us = [torch.randn(6, generator=g) for _ in range(2)]
    before = [p.clone() for p in ps], buf.clone()
    with pytest.raises(RuntimeError, match=r"buf 1.*buf 0.*overlap|buf 0.*buf 1.*overlap"):
        torch.ops.isoloco.nesterov_outer_(ps, [buf, buf], us, 0.5, 0.9, None)
    assert all(torch.equal(p, b) for p, b in zip(ps, before[0])) and torch.equal(buf, before[1])


def test_nesterov_refuses_infinite_lr_and_momentum():
    p, b, u = torch.zeros(3), torch.zeros(3), torch.ones(3)
    for lr, mu in ((float("inf"), 0.9), (0.5, float("inf")), (float("-inf"), 0.9)):
        with pytest.raises(ValueError, match="lr|momentum"):
            torch.ops.isoloco.nesterov_outer_([p], [b], [u], lr, mu, None)
    assert not p.any() and not b.any()


def test_nesterov_refuses_an_inference_tensor():
    with torch.inference_mode():
        p = torch.zeros(3)
    b0, p0 = torch.zeros(3), torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"param 1.*inference"):
        torch.ops.isoloco.nesterov_outer_([p0, p], [b0, torch.zeros(3)], [torch.ones(3)] * 2, 0.5, 0.9, None)
    assert not p0.any() and not b0.any()


ops = torch.ops.isoloco


# ----------------------------------------------------------------------------------------------
# nesterov_outer_: an update sharing memory with a tensor the op writes


def _three(seed):
    g = _gen(seed)
    return [[torch.randn(6, generator=g) for _ in range(2)] for _ in range(3)]


def _shifted(P, B, U):
    base = torch.cat([P[1], torch.ones(1)])
    P[1] = base[:6]
    return [U[0], base[1:]]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "alias, momentum, match",
    [
        # update 1 is param 0: the op wrote param 0 before reading update 1 (error ~1.1)
        pytest.param(
            lambda P, B, U: [U[0], P[0]],
            0.9,
            r"update 1 shares memory with param 0",
            id="update-is-another-param",
        ),
        # update 0 is its own buffer: with μ = 0 the buffer was zeroed before it was read
        pytest.param(
            lambda P, B, U: [B[0], U[1]], 0.0, r"update 0 shares memory with buf 0", id="update-is-its-buffer-mu0"
        ),
        # update 1 is its own param shifted by one element: read after its neighbour was written
        pytest.param(_shifted, 0.9, r"update 1 shares memory with param 1", id="update-overlaps-its-param"),
    ],
)
def test_nesterov_refuses_an_update_that_aliases_a_written_tensor(alias, momentum, match):
    P, B, U = _three(1)
    U = alias(P, B, U)
    before = [t.clone() for t in (*P, *B)]
    with pytest.raises(RuntimeError, match=match + r".*nothing was written"):
        ops.nesterov_outer_(P, B, U, 0.5, momentum)
    assert all(torch.equal(a, b) for a, b in zip(before, (*P, *B)))


@pytest.mark.usefixtures("one_thread")
def test_nesterov_amax_bounds_replace_the_reads_and_must_be_three_per_tensor():
    P, B, U = _three(2)
    want_p, want_b = [p.clone() for p in P], [b.clone() for b in B]
    ops.nesterov_outer_(want_p, want_b, U, 0.5, 0.9)
    # the exact largest entries as bounds, one NaN (unknown: read here): the same result
    bounds = [float(t.abs().max()) for t in (*P, *B, *U)]
    bounds[1] = float("nan")
    ops.nesterov_outer_(P, B, U, 0.5, 0.9, bounds)
    assert all(torch.equal(a, b) for a, b in zip((*P, *B), (*want_p, *want_b)))
    with pytest.raises(ValueError, match=r"amax must have 3 entries per tensor \(6"):
        ops.nesterov_outer_(P, B, U, 0.5, 0.9, bounds[:5])
    for bad in (-1.0, -float("inf")):  # no largest |entry| is below 0: refused before anything is read or written
        with pytest.raises(ValueError, match=r"amax\[4\] is -(1.0|inf); a bound on a largest \|entry\| is ≥ 0"):
            ops.nesterov_outer_(P, B, U, 0.5, 0.9, bounds[:4] + [bad] + bounds[5:])
    assert all(torch.equal(a, b) for a, b in zip((*P, *B), (*want_p, *want_b)))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "make",
    [
        # q = x shifted by a row; the CPU's torch backend reads q aside, the CUDA kernels read q
        # in one block while another writes x: refused on every backend alike
        pytest.param(lambda base: (base[:4], base[1:5]), id="q-is-x-shifted"),
        pytest.param(lambda base: (base[:5, :5], base[:5, :5].mT), id="q-is-x-transposed"),
        pytest.param(lambda base: (base[:4], base[:4]), id="q-is-x"),
    ],
)
def test_iso_scale_refuses_a_q_sharing_memory_with_x_with_nothing_written(make):
    base = torch.randn(6, 6, generator=_gen(7))
    x, q = make(base)
    before = base.clone()
    with pytest.raises(RuntimeError, match=r"iso_scale_: q shares memory with x.*nothing was written"):
        ops.iso_scale_(x, q)
    assert torch.equal(base, before)


@pytest.mark.usefixtures("one_thread")
def test_nesterov_with_no_tensors_is_a_checked_no_op():
    # was NotImplementedError "There were no tensor arguments to this function"
    ops.nesterov_outer_([], [], [], 0.5, 0.9, None)
    with pytest.raises(ValueError, match=r"lr and momentum must be finite"):
        ops.nesterov_outer_([], [], [], float("nan"), 0.9, None)


# ----------------------------------------------------------------------------------------------
# iso_scale_: the finiteness rule


def _pair(seed=20, dtype=torch.float32):
    g = _gen(seed)
    return torch.randn(2, 4, 6, generator=g).to(dtype), torch.randn(2, 4, 6, generator=g).to(dtype)


def _poke(t, value):
    t = t.clone()
    t[1, 2, 3] = value
    return t


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
@pytest.mark.parametrize(
    "make,exc,match",
    [
        pytest.param(
            lambda x, q: (x, _poke(q, float("nan"))), ValueError, r"iso_scale_: q: matrix 1 contains NaN", id="nan-in-q"
        ),
        pytest.param(
            lambda x, q: (_poke(x, float("inf")), q), ValueError, r"iso_scale_: x: matrix 1 contains Inf", id="inf-in-x"
        ),
        pytest.param(
            lambda x, q: (x.half() * 200, q.half() * 200),
            ResultOverflowError,
            r"iso_scale_: matrix \d: the result s̄·q does not fit torch.float16",
            id="fp16-overflow",
        ),
    ],
)
def test_iso_scale_refuses_with_nothing_written(make, exc, match):
    x, q = make(*_pair())
    before = x.clone()
    with pytest.raises(exc, match=match):
        ops.iso_scale_(x, q)
    assert torch.equal(x.nan_to_num(), before.nan_to_num())


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_iso_scale_result_that_fits_is_right_though_the_float32_sum_overflows():
    x, q = torch.full((4, 4), 3e38), torch.full((4, 4), 0.25)  # Σ x·q = 1.2e39 > float32 max
    sbar = ops.iso_scale_(x, q)
    assert float(sbar) == pytest.approx(3e38, rel=1e-6)
    assert torch.isfinite(x).all() and float(x.max()) == pytest.approx(7.5e37, rel=1e-6)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_iso_scale_refuses_an_inference_tensor():
    with torch.inference_mode():
        x = torch.randn(4, 6)
    before = x.clone()
    with pytest.raises(RuntimeError, match=r"iso_scale_: x is an inference tensor"):
        ops.iso_scale_(x, torch.randn(4, 6))
    assert torch.equal(x, before)


# ----------------------------------------------------------------------------------------------
# nesterov_outer_: the finiteness rule


def _triple(seed=30, n=2, dtype=torch.float32):
    g = _gen(seed)
    return (
        [torch.randn(5, generator=g).to(dtype) for _ in range(n)],
        [torch.randn(5, generator=g) for _ in range(n)],
        [torch.randn(5, generator=g) for _ in range(n)],
    )


def _nan(t):
    t = t.clone()
    t[2] = float("nan")
    return t


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
@pytest.mark.parametrize(
    "edit,match",
    [
        pytest.param(lambda P, B, U: (P, B, [U[0], _nan(U[1])]), r"tensor 1: update.*NaN", id="nan-update"),
        pytest.param(lambda P, B, U: (P, B, [U[0], U[1] * float("inf")]), r"tensor 1: update.*Inf", id="inf-update"),
        pytest.param(lambda P, B, U: ([P[0], _nan(P[1])], B, U), r"tensor 1: param.*NaN", id="nan-param"),
        pytest.param(lambda P, B, U: (P, [B[0], _nan(B[1])], U), r"tensor 1: momentum buffer.*NaN", id="nan-buf"),
    ],
)
def test_nesterov_refuses_non_finite_input_with_nothing_written(edit, match):
    P, B, U = _triple()
    P, B, U = edit(P, B, U)
    # the first param and buffer are fine and must stay as they were
    before = P[0].clone(), B[0].clone()
    with pytest.raises(ValueError, match=match):
        ops.nesterov_outer_(P, B, U, 0.5, 0.9)
    assert torch.equal(P[0], before[0]) and torch.equal(B[0], before[1])


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_nesterov_fp16_overflow_is_refused_with_nothing_written():
    P, B, U = _triple(31)
    ph = torch.zeros(5, dtype=torch.float16)
    before = [p.clone() for p in P], [b.clone() for b in B]
    with pytest.raises(
        ResultOverflowError, match=r"tensor 2: the outer update.*overflows the param's dtype torch.float16"
    ):
        ops.nesterov_outer_([*P, ph], [*B, torch.zeros(5)], [*U, torch.full((5,), 6e4)], 1.0, 0.9)
    assert all(torch.equal(a, b) for a, b in zip(P + B, before[0] + before[1])) and not ph.any()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_nesterov_huge_lr_gives_the_exact_result_when_it_fits():
    # lr = 1e39 does not fit float32: the kernels turned it into Inf; the exact result is ~2e9
    P, B, U = _triple(32)
    B, U = [b * 1e-30 for b in B], [u * 1e-30 for u in U]
    want = [nesterov_ref(p, b, u, 1e39, 0.9) for p, b, u in zip(P, B, U)]
    ops.nesterov_outer_(P, B, U, 1e39, 0.9)
    for p, b, (wp, wb) in zip(P, B, want):
        assert torch.isfinite(p).all() and rel_err(p, wp) <= TOL[("update", torch.float32)]
        assert rel_err(b, wb) <= TOL[("update", torch.float32)]


# -- the op's schema takes the Python API's default method ------------------------------------


@pytest.mark.usefixtures("one_thread")
def test_op_method_defaults_to_auto_like_the_python_api():
    schema = str(torch.ops.isoloco.iso_flatten_.default._schema)
    assert 'str method="auto"' in schema, schema
    x = torch.randn(3, 12, 7, dtype=torch.float64)
    y = x.clone()
    torch.ops.isoloco.iso_flatten_(x)  # no method: "auto"
    ik.iso_merge_([y], method="auto")
    assert torch.equal(x, y)
    err = (x - iso_flatten_ref(y.clone())).norm() / x.norm()  # and it is the Iso-C flatten
    assert err < 1e-10
