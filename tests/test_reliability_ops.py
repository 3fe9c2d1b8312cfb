"""The ops' promises on one process: the finiteness rule (finite inputs; results that fit their dtype,
never an overflowed intermediate), all-or-nothing writes, one rank cut for every method, and clear
errors for meta and fake tensors. Each case is compared with reference.py (float64).
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels._validate import ResultOverflowError
from isoloco_kernels.flatten import exact
from isoloco_kernels.flatten import registry as flatten
from isoloco_kernels.reference import iso_flatten_ref, isoloco_step_ref, nesterov_ref, rank_tol
from tests.helpers import TOL, gram_tol, rel_err, spectrum, with_spectrum

METHODS = ("svd", "eigh", "polar", "gram", "auto")
ops = torch.ops.isoloco

# matrices handed on to an exact method warn; expected here
pytestmark = pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cond(x: torch.Tensor) -> float:
    s = torch.linalg.svdvals(x.double())
    return float(s[..., 0].max() / s[..., -1].min())


def _tol(method: str, x: torch.Tensor) -> float:
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
    assert torch.isfinite(x).all() and rel_err(x, ref) <= _tol(method, x)


def _subnormal(method):
    # float64 subnormals: gram's 1/amax overflowed (LinAlgError)
    x = torch.randn(12, 20, generator=_gen(2), dtype=torch.float64) * 1e-310
    ref = iso_flatten_ref(x * 2.0**1000) * 2.0**-1000
    ik.iso_merge_([x], method=method)
    # subnormals carry ~13 digits here, so the float64 row of the table still applies
    assert rel_err(x, ref) <= max(_tol(method, x), 1e-11)


def _rank_deficient(method):
    # a rank-2 product formed in float32: its rounding noise (~0.1·eps32·σ_1) is below the cut
    g = _gen(3)
    x = torch.randn(16, 2, generator=g) @ torch.randn(2, 24, generator=g)
    ref = iso_flatten_ref(x)
    assert int((torch.linalg.svdvals(ref) > 1e-6 * torch.linalg.svdvals(ref)[0]).sum()) == 2
    out = ik.iso_flatten(x, method=method)
    assert rel_err(out, ref) <= _tol(method, x)


def _cond_1e6(method):
    # κ 1e6 in float32: svd/eigh cut 10–98 % of the spectrum that reference.py keeps
    x = with_spectrum(1, 64, 256, spectrum("geometric", 64, 1e6), _gen(4))[0].float()
    ref = iso_flatten_ref(x)
    assert rel_err(ik.iso_flatten(x, method=method), ref) <= _tol(method, x)


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


CASES = {
    "overflow": _overflow,
    "subnormal": _subnormal,
    "rank-deficient": _rank_deficient,
    "cond-1e6": _cond_1e6,
    "inference": _inference,
    "expanded": _expanded,
    "aliasing": _aliasing,
}


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_on_every_hostile_input(method, case):
    CASES[case](method)


# ----------------------------------------------------------------------------------------------
# One rank cut


def test_rank_cut_is_one_definition_relative_to_sigma_max_and_dtype():
    assert rank_tol(8, 16, torch.float32) == rank_tol(8, 16, torch.bfloat16) == rank_tol(16, 8, torch.float16)
    assert 3 * torch.finfo(torch.float32).eps < rank_tol(64, 256, torch.float32) < 1e-6  # κ 1e6 keeps all
    assert rank_tol(64, 256, torch.float64) < 1e-13
    x = torch.outer(torch.randn(10, generator=_gen(8)), torch.randn(8, generator=_gen(9)))  # float32 rank 1
    for method in METHODS:
        out = ik.iso_flatten(x, method=method)
        s = torch.linalg.svdvals(out.double())
        assert float(s[1] / s[0]) < 1e-6, method  # rank one stays rank one


def test_eigh_hands_what_its_gram_matrix_cannot_resolve_to_svd():
    x = with_spectrum(2, 16, 48, spectrum("lowrank_noise", 16, 1e6), _gen(10)).float()
    out = x.clone()
    exact.flatten_eigh_(out)
    assert rel_err(out, iso_flatten_ref(x)) <= TOL[("exact", torch.float32)]


def test_svd_is_float64_so_float32_input_is_exact_at_cond_1e4():
    # a float32 SVD misses this by 10× (~2e-4); float64 GEMMs are immune to TF32 settings too
    x = with_spectrum(1, 32, 64, spectrum("lowrank_noise", 32, 1e4), _gen(11))[0].float()
    assert rel_err(ik.iso_flatten(x, method="svd"), iso_flatten_ref(x)) <= TOL[("exact", torch.float32)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_svd_on_cuda_ignores_the_users_tf32_setting():
    x = with_spectrum(1, 64, 96, spectrum("geometric", 64, 1e3), _gen(12))[0].float()
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        out = ik.iso_flatten(x.cuda(), method="svd")
        assert torch.backends.cuda.matmul.allow_tf32  # the user's state is left alone
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert rel_err(out, iso_flatten_ref(x)) <= TOL[("exact", torch.float32)]


@pytest.mark.parametrize("is_cuda", [True, False], ids=["cuda", "cpu"])
def test_auto_picks_svd_for_float64_on_every_device(is_cuda):
    x3 = types.SimpleNamespace(is_cuda=is_cuda, dtype=torch.float64, shape=(4, 64, 1024), device=None)
    assert flatten.resolve_method("auto", x3) == "svd"


# ----------------------------------------------------------------------------------------------
# iso_scale_: the finiteness rule


def _pair(seed=20, dtype=torch.float32):
    g = _gen(seed)
    return torch.randn(2, 4, 6, generator=g).to(dtype), torch.randn(2, 4, 6, generator=g).to(dtype)


def _poke(t, value):
    t = t.clone()
    t[1, 2, 3] = value
    return t


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


def test_iso_scale_result_that_fits_is_right_though_the_float32_sum_overflows():
    x, q = torch.full((4, 4), 3e38), torch.full((4, 4), 0.25)  # Σ x·q = 1.2e39 > float32 max
    sbar = ops.iso_scale_(x, q)
    assert float(sbar) == pytest.approx(3e38, rel=1e-6)
    assert torch.isfinite(x).all() and float(x.max()) == pytest.approx(7.5e37, rel=1e-6)


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


@pytest.mark.parametrize(
    "edit,match",
    [
        pytest.param(lambda P, B, U, S: (P, B, [U[0], _nan(U[1])], S), r"tensor 1: update.*NaN", id="nan-update"),
        pytest.param(
            lambda P, B, U, S: (P, B, [U[0], U[1] * float("inf")], S), r"tensor 1: update.*Inf", id="inf-update"
        ),
        pytest.param(lambda P, B, U, S: ([P[0], _nan(P[1])], B, U, S), r"tensor 1: param.*NaN", id="nan-param"),
        pytest.param(lambda P, B, U, S: (P, [B[0], _nan(B[1])], U, S), r"tensor 1: momentum buffer.*NaN", id="nan-buf"),
        pytest.param(
            lambda P, B, U, S: (P, B, U, torch.tensor([1.0, float("nan")])), r"scales\[1\] is nan", id="scales-nan"
        ),
        pytest.param(
            lambda P, B, U, S: (P, B, U, torch.tensor([float("inf"), 1.0])), r"scales\[0\] is inf", id="scales-inf"
        ),
    ],
)
def test_nesterov_refuses_non_finite_input_with_nothing_written(edit, match):
    P, B, U = _triple()
    P, B, U, S = edit(P, B, U, None)
    # the first param and buffer are fine and must stay as they were
    before = P[0].clone(), B[0].clone()
    with pytest.raises(ValueError, match=match):
        ops.nesterov_outer_(P, B, U, 0.5, 0.9, S)
    assert torch.equal(P[0], before[0]) and torch.equal(B[0], before[1])


def test_nesterov_fp16_overflow_is_refused_with_nothing_written():
    P, B, U = _triple(31)
    ph = torch.zeros(5, dtype=torch.float16)
    before = [p.clone() for p in P], [b.clone() for b in B]
    with pytest.raises(
        ResultOverflowError, match=r"tensor 2: the outer update.*overflows the param's dtype torch.float16"
    ):
        ops.nesterov_outer_([*P, ph], [*B, torch.zeros(5)], [*U, torch.full((5,), 6e4)], 1.0, 0.9, None)
    assert all(torch.equal(a, b) for a, b in zip(P + B, before[0] + before[1])) and not ph.any()


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_nesterov_huge_lr_gives_the_exact_result_when_it_fits(scaled):
    # lr = 1e39 does not fit float32: the kernels turned it into Inf; the exact result is ~2e9
    P, B, U = _triple(32)
    B, U = [b * 1e-30 for b in B], [u * 1e-30 for u in U]
    S = torch.tensor([2.0, 0.5]) if scaled else None
    want = [
        nesterov_ref(p, b, u, 1e39, 0.9, 1.0 if S is None else float(s))
        for p, b, u, s in zip(P, B, U, S if S is not None else [None] * 2)
    ]
    ops.nesterov_outer_(P, B, U, 1e39, 0.9, S)
    for p, b, (wp, wb) in zip(P, B, want):
        assert torch.isfinite(p).all() and rel_err(p, wp) <= TOL[("update", torch.float32)]
        assert rel_err(b, wb) <= TOL[("update", torch.float32)]


# ----------------------------------------------------------------------------------------------
# IsoLoCo: the same rule through the optimizer, all-or-nothing


@pytest.mark.parametrize("shape", [(16, 4), (4, 16), (7,)], ids=["tall", "wide", "vector"])
def test_isoloco_huge_lr_with_tiny_grads_gives_the_reference_step(shape):
    p = torch.randn(shape, generator=_gen(40))
    g = torch.randn(shape, generator=_gen(41)) * 1e-30
    want, _ = isoloco_step_ref([p], [torch.zeros_like(p)], [g], 1e39, 0.8)
    opt = ik.IsoLoCo([p], lr=1e39, momentum=0.8)
    p.grad = g
    opt.step()
    assert torch.isfinite(p).all() and rel_err(p, want[0]) <= 1e-5


def test_isoloco_huge_lr_that_overflows_is_refused_with_nothing_changed():
    # a tall param: the momentum buffers were updated, then a RuntimeError from torch
    ps = [torch.randn(16, 4, generator=_gen(42)), torch.randn(3, generator=_gen(43))]
    opt = ik.IsoLoCo(ps, lr=1e39, momentum=0.8)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=_gen(44))
    before = [p.clone() for p in ps]
    with pytest.raises(ResultOverflowError, match=r"IsoLoCo: param_groups\[0\]\['params'\]\[\d\].*overflows"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before)) and len(opt.state) == 0


def test_isoloco_nan_param_is_refused_naming_it():
    ps = [torch.randn(4, 6, generator=_gen(45)), torch.randn(3, generator=_gen(46))]
    ps[1][0] = float("nan")
    opt = ik.IsoLoCo(ps, lr=0.5, momentum=0.9)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=_gen(47))
    before = ps[0].clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*param.*NaN"):
        opt.step()
    assert torch.equal(ps[0], before) and len(opt.state) == 0


# ----------------------------------------------------------------------------------------------
# iso_merge_: all or nothing across buckets


def test_iso_merge_gram_with_a_subnormal_bucket_flattens_both():
    good = torch.randn(4, 6, generator=_gen(50), dtype=torch.float64)
    tiny = torch.randn(5, 7, generator=_gen(51), dtype=torch.float64) * 1e-310
    refs = iso_flatten_ref(good), iso_flatten_ref(tiny * 2.0**1000) * 2.0**-1000
    ik.iso_merge_([good, tiny], method="gram")
    assert rel_err(good, refs[0]) <= gram_tol(torch.float64, _cond(good))
    assert rel_err(tiny, refs[1]) <= 1e-11


def test_iso_merge_a_bucket_failing_after_the_checks_leaves_every_bucket_unchanged(monkeypatch):
    # stands in for a LAPACK failure in the second of three buckets
    real = flatten.METHODS["svd"].run

    def svd_failing_on_5x7(x3):
        if tuple(x3.shape[-2:]) == (5, 7):
            raise torch.linalg.LinAlgError("stand-in failure")
        real(x3)

    monkeypatch.setitem(flatten.METHODS, "svd", dataclasses.replace(flatten.METHODS["svd"], run=svd_failing_on_5x7))
    buckets = [
        torch.randn(3, 4, 6, generator=_gen(52)),
        torch.randn(5, 7, generator=_gen(53)),
        torch.randn(2, 8, 9, generator=_gen(54)),
    ]
    before = [b.clone() for b in buckets]
    with pytest.raises(torch.linalg.LinAlgError):
        ik.iso_merge_(buckets, method="svd")
    assert all(torch.equal(b, c) for b, c in zip(buckets, before))


# ----------------------------------------------------------------------------------------------
# Meta and fake tensors


def test_isoloco_on_meta_params_says_so():
    p = torch.empty(4, 4, device="meta")
    opt = ik.IsoLoCo([p])
    p.grad = torch.empty(4, 4, device="meta")
    with pytest.raises(RuntimeError, match=r"\['params'\]\[0\].*the param is a meta tensor"):
        opt.step()


def test_isoloco_with_a_meta_momentum_buffer_says_so_with_nothing_changed():
    p = torch.randn(4, 4, generator=_gen(60))
    opt = ik.IsoLoCo([p])
    p.grad = torch.randn(4, 4, generator=_gen(61))
    opt.state[p]["momentum_buffer"] = torch.empty(4, 4, device="meta")
    before = p.clone()
    with pytest.raises(ValueError, match=r"momentum_buffer is a meta tensor"):
        opt.step()
    assert torch.equal(p, before)


def test_isoloco_load_state_dict_with_a_meta_momentum_buffer_says_so_with_nothing_changed():
    p = torch.randn(4, 4, generator=_gen(62))
    opt = ik.IsoLoCo([p])
    p.grad = torch.randn(4, 4, generator=_gen(63))
    opt.step()
    sd = opt.state_dict()
    sd = {"state": {0: {"momentum_buffer": torch.empty(4, 4, device="meta")}}, "param_groups": sd["param_groups"]}
    before = opt.state[p]["momentum_buffer"].clone()
    with pytest.raises(ValueError, match=r"param 0 .*momentum_buffer is a meta tensor"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state[p]["momentum_buffer"], before)


def test_isoloco_with_a_meta_lr_tensor_says_so():
    with pytest.raises(ValueError, match=r"'lr' is a meta tensor"):
        ik.IsoLoCo([torch.randn(3)], lr=torch.tensor(0.1, device="meta"))


def test_iso_merge_under_fake_tensor_mode_checks_metadata_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        buckets = [torch.randn(3, 4, 6), torch.randn(5, 7)]
        out = ik.iso_merge_(buckets, method="auto")
        assert [tuple(b.shape) for b in out] == [(3, 4, 6), (5, 7)]
        with pytest.raises(TypeError, match=r"bucket 1: dtype torch.int64"):
            ik.iso_merge_([torch.randn(4, 6), torch.ones(3, 3, dtype=torch.int64)])
