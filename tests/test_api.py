"""The Python API over the ops (api.py): `iso_merge_` and `iso_flatten` under hostile input — huge, tiny and
half-precision buckets get the right finite result or a clear error naming the bucket and matrix; every bucket
is checked before any is written (expanded, aliased, inference, meta, requires-grad), a failure after the checks
changes nothing, fake tensors check metadata only; autograd is refused, not silently dropped."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.flatten import registry as flatten
from isoloco_kernels.reference import iso_flatten_ref
from tests.helpers import TOL, gram_tol, rel_err

EXACT = ("svd", "eigh")


ALL = ("svd", "eigh", "polar")


# A 4×4 whose Iso-C result is ~1.5× its largest entry (found by a small search): scaled near a
# half dtype's max it has a result that does not fit the dtype.
GROWS = torch.tensor([[-1, 1, 1, 1], [-1, 1, 0.4, 0.4], [-0.8, 1, 1, -1], [-0.5, 1, -1, 1]], dtype=torch.float64)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# Overflow: Iso-C is positively homogeneous, so every finite input with a representable result
# gets it


def _homogeneous(x, method, shift):
    """iso(x) computed at a harmless scale 2^-shift, scaled back (exact: powers of two)."""
    return ik.iso_flatten(x * 2.0**-shift, method=method) * 2.0**shift


@pytest.mark.parametrize("method", ALL)
def test_huge_square_input_gives_the_right_finite_result(method):
    # The svd path `auto` picks for a square CPU matrix returned all NaN here.
    x = torch.ones(128, 128) * 1e37 + torch.eye(128) * 1e36
    want = _homogeneous(x, method, 120)
    ik.iso_merge_([x], method=method)
    assert torch.isfinite(x).all()
    assert torch.equal(x, want)  # Iso-C is homogeneous: the same digits as at scale 1
    # vs float64: the exact methods compute in float64, so the float32 rounding of the result bounds
    # them (svd's row; measured 4.9e-9: the result is a multiple of I). A float32 SVD of this matrix
    # (σ: 1.29e38 once, 1e36 127 times) is off by ~2e-4 at any scale; eigh's Gram matrix adds
    # only eps64·κ² ≈ 4e-10 at κ 1.3e3.
    tol = TOL[("polar" if method == "polar" else "svd", torch.float32)]
    ref = iso_flatten_ref(torch.ones(128, 128, dtype=torch.float64) * 10 + torch.eye(128, dtype=torch.float64))
    assert rel_err(x, ref * 1e36) < tol


@pytest.mark.parametrize("method", ALL)
def test_huge_wide_input_gives_the_right_finite_result(method):
    # eigh returned Inf here (the Gram matrix overflows), polar raised.
    x = torch.randn(3, 24, 96, generator=_gen(1)) * 3e37
    want = _homogeneous(x, method, 120)
    ref = iso_flatten_ref(x.double() / 1e37) * 1e37
    ik.iso_merge_([x], method=method)
    assert torch.isfinite(x).all() and torch.equal(x, want)
    # the exact methods: the float32 rounding of the result (svd's row; measured 2.6e-8, κ ~3)
    assert rel_err(x, ref) < TOL[("polar" if method == "polar" else "svd", torch.float32)]


@pytest.mark.parametrize("method", EXACT)
def test_tiny_input_keeps_its_directions(method):
    x = torch.randn(16, 40, generator=_gen(2), dtype=torch.float64) * 1e-300
    ref = iso_flatten_ref(x * 1e300) * 1e-300
    ik.iso_merge_([x], method=method)
    assert rel_err(x, ref) < TOL[("exact", torch.float64)]


@pytest.mark.parametrize("dtype,scale", [(torch.float16, 6e4), (torch.bfloat16, 2.5e38)])
@pytest.mark.parametrize("method", ALL)
def test_half_result_that_does_not_fit_raises_naming_bucket_and_matrix(dtype, scale, method):
    ok = torch.randn(2, 4, 4, generator=_gen(3)).to(dtype)
    bad = torch.stack([torch.rand(4, 4, generator=_gen(4)) - 0.5, GROWS.float()]).mul(scale).to(dtype)
    assert torch.isfinite(bad).all()
    before = [ok.clone(), bad.clone()]
    with pytest.raises(ValueError, match=r"bucket 1.*matrix 1.*(fit|overflow)"):
        ik.iso_merge_([ok, bad], method=method)
    assert torch.equal(ok, before[0]) and torch.equal(bad, before[1])


def test_half_input_near_max_with_a_result_that_fits():
    x = (torch.randn(8, 8, generator=_gen(5)).abs() * 6e4).clamp_max(6e4).to(torch.float16)
    ref = iso_flatten_ref(x.double())
    assert ref.abs().max() < 65504
    ik.iso_merge_([x], method="svd")
    assert torch.isfinite(x).all() and rel_err(x, ref) < TOL[("exact", torch.float16)]


# ----------------------------------------------------------------------------------------------
# Partial writes: every tensor that will be written is checked before anything is written


def _merge_refused(bad, match, exc=(ValueError, RuntimeError, TypeError)):
    a = torch.randn(4, 6, generator=_gen(20))
    before = a.clone()
    with pytest.raises(exc, match=match):
        ik.iso_merge_([a, bad])
    assert torch.equal(a, before)


def test_iso_merge_refuses_an_expanded_bucket_before_writing():
    _merge_refused(torch.randn(1, 6, generator=_gen(21)).expand(4, 6), r"bucket 1.*overlap")


def test_iso_merge_refuses_a_leaf_that_requires_grad():
    _merge_refused(torch.randn(4, 6, generator=_gen(22)).requires_grad_(), r"bucket 1.*requires grad")


def test_iso_merge_refuses_an_inference_tensor():
    with torch.inference_mode():
        t = torch.randn(4, 6, generator=_gen(23))
    _merge_refused(t, r"bucket 1.*inference")


def test_iso_merge_refuses_a_meta_tensor():
    _merge_refused(torch.empty(4, 6, device="meta"), r"bucket 1.*meta")


def test_iso_merge_refuses_buckets_that_share_memory():
    base = torch.randn(8, 6, generator=_gen(24))
    before = base.clone()
    with pytest.raises(RuntimeError, match=r"bucket 0.*bucket 1.*overlap|bucket 1.*bucket 0.*overlap"):
        ik.iso_merge_([base[:5], base[3:]])
    assert torch.equal(base, before)


def test_iso_merge_accepts_disjoint_views_of_one_storage():
    base = torch.randn(8, 6, generator=_gen(25), dtype=torch.float64)
    ref = [iso_flatten_ref(base[:4]), iso_flatten_ref(base[4:])]
    ik.iso_merge_([base[:4], base[4:]])
    assert rel_err(base[:4], ref[0]) < TOL[("exact", torch.float64)]
    assert rel_err(base[4:], ref[1]) < TOL[("exact", torch.float64)]


def _cond(x: torch.Tensor) -> float:
    s = torch.linalg.svdvals(x.double())
    return float(s[..., 0].max() / s[..., -1].min())


# ----------------------------------------------------------------------------------------------
# iso_merge_: all or nothing across buckets


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_iso_merge_gram_with_a_subnormal_bucket_flattens_both():
    good = torch.randn(4, 6, generator=_gen(50), dtype=torch.float64)
    tiny = torch.randn(5, 7, generator=_gen(51), dtype=torch.float64) * 1e-310
    refs = iso_flatten_ref(good), iso_flatten_ref(tiny * 2.0**1000) * 2.0**-1000
    ik.iso_merge_([good, tiny], method="gram")
    assert rel_err(good, refs[0]) <= gram_tol(torch.float64, _cond(good))
    assert rel_err(tiny, refs[1]) <= 1e-11


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
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


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_iso_merge_under_fake_tensor_mode_checks_metadata_only():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        buckets = [torch.randn(3, 4, 6), torch.randn(5, 7)]
        out = ik.iso_merge_(buckets, method="auto")
        assert [tuple(b.shape) for b in out] == [(3, 4, 6), (5, 7)]
        with pytest.raises(TypeError, match=r"bucket 1: dtype torch.int64"):
            ik.iso_merge_([torch.randn(4, 6), torch.ones(3, 3, dtype=torch.int64)])


# -- autograd: refused, not silently dropped --------------------------------------------------


@pytest.mark.usefixtures("one_thread")
def test_iso_flatten_refuses_a_tensor_that_requires_grad_with_grad_on():
    x = torch.randn(6, 4, requires_grad=True)
    before = x.detach().clone()
    with pytest.raises(RuntimeError, match=r"iso_flatten: x requires grad, but Iso-C has no backward.*x\.detach\(\)"):
        ik.iso_flatten(x)
    nonleaf = x * 2
    with pytest.raises(RuntimeError, match="requires grad"):
        ik.iso_flatten(nonleaf)
    assert torch.equal(x.detach(), before) and x.grad is None
    ref = iso_flatten_ref(before).float()
    for y in (ik.iso_flatten(x.detach()), _under_no_grad(x)):
        assert not y.requires_grad and torch.allclose(y, ref, atol=1e-5)


def _under_no_grad(x):
    with torch.no_grad():
        return ik.iso_flatten(x)


# -- the checks' one read: the same largest entries on every path ----------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_amaxes_cpu_pass_equals_the_fused_norm(dtype):
    """The CPU's aminmax pass gives what the fused inf-norm gives (CUDA's pass), special values included:
    NaN and ±Inf kept, −0 and empty tensors 0, non-contiguous views read as they are."""
    from isoloco_kernels._validate import _amax_pass, amaxes

    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(7, 9, generator=g).to(dtype) * 10**k for k in range(-3, 4)]
    ts.append(torch.randn(6, 8, generator=g).to(dtype).mT)
    ts.append(torch.tensor([-0.0, 0.0], dtype=dtype))
    for v in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(5, generator=g).to(dtype)
        t[2] = v
        ts.append(t)
    want = torch.stack(torch._foreach_norm(ts, float("inf"))).to(torch.float64)
    got = _amax_pass(ts).to(torch.float64)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert amaxes([torch.empty(0, dtype=dtype), ts[0]])[0] == 0.0
