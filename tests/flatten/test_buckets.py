"""BucketPlan: grouping by shape (transposed twins together), pack / views / unpack, reuse."""

from __future__ import annotations

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.outer.core import BucketPlan
from isoloco_kernels.reference import iso_flatten_ref
from tests.helpers import TOL, rel_err


def _rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _mixed():
    return [
        _rand((4, 6), seed=1),
        _rand((6, 4), seed=2),  # transposed twin of the first
        _rand((3, 3), torch.float64, seed=3),
        _rand((4, 6), torch.bfloat16, seed=4),  # same compute dtype (float32) as the first
        _rand((1, 5), seed=5),
        _rand((5, 1), torch.float16, seed=6),
        _rand((10, 8), seed=7)[::2, 1::2],  # strided [5, 4]
        _rand((3, 3), seed=8),  # float32: not in the float64 bucket
    ]


def test_grouping_and_orientation():
    ts = _mixed()
    plan = BucketPlan(ts)
    got = [(b.shape, b.dtype, b.members, b.transposed) for b in plan.buckets]
    assert got == [
        ((4, 6), torch.float32, [0, 1, 3], [False, True, False]),
        ((3, 3), torch.float64, [2], [False]),
        ((1, 5), torch.float32, [4, 5], [False, True]),
        ((4, 5), torch.float32, [6], [True]),
        ((3, 3), torch.float32, [7], [False]),
    ]
    assert [tuple(b.shape) for b in plan.buffers] == [(3, 4, 6), (1, 3, 3), (2, 1, 5), (1, 4, 5), (1, 3, 3)]
    assert plan.nbytes == sum(t.numel() for t in ts) * 4 + 9 * 4  # the float64 matrix takes 8 bytes
    assert len(plan) == len(ts) and "5 buckets" in repr(plan)


def test_pack_views_unpack_round_trip_exactly():
    ts = _mixed()
    plan = BucketPlan(ts)
    for b in plan.buffers:
        b.fill_(float("nan"))  # poison: every slot must be written
    plan.pack(ts)
    assert all(torch.isfinite(b).all() for b in plan.buffers)
    views = plan.views()
    for t, v, (bi, _) in zip(ts, views, plan.where):
        assert v.shape == t.shape and v.dtype == plan.buckets[bi].dtype
        assert torch.equal(v, t.to(v.dtype))  # widening casts are exact
        assert v.untyped_storage().data_ptr() == plan.buffers[bi].untyped_storage().data_ptr()
    outs = [torch.full_like(t, float("nan")) for t in ts]
    plan.unpack(outs)
    assert all(torch.equal(o, t) for o, t in zip(outs, ts))


def test_explicit_buffer_dtype():
    ts = [_rand((2, 3), seed=1), _rand((3, 2), torch.bfloat16, seed=2)]
    plan = BucketPlan(ts, dtype=torch.float64)
    assert [b.dtype for b in plan.buffers] == [torch.float64] and len(plan.buckets) == 1
    plan.pack(ts)
    assert torch.equal(plan.views()[1], ts[1].double())


@pytest.mark.parametrize("method", ["svd", "eigh"])
def test_bucketed_flatten_matches_per_matrix_reference(method):
    """iso(Δᵀ) = iso(Δ)ᵀ: flattening the canonical-orientation buckets gives each tensor's Iso-C."""
    ts = _mixed()
    plan = BucketPlan(ts)
    ik.iso_merge_(plan.pack(ts), method=method)
    for i, (t, v) in enumerate(zip(ts, plan.views())):
        assert rel_err(v, iso_flatten_ref(t)) <= TOL[("exact", v.dtype)], i


def test_matches_and_mismatch_errors_leave_buffers_alone():
    ts = _mixed()
    plan = BucketPlan(ts)
    plan.pack(ts)
    before = [b.clone() for b in plan.buffers]
    assert plan.matches([t.clone() for t in ts])
    swapped = ts[:1] + [ts[1].t()] + ts[2:]  # same bucket, but tensor 1 changed shape
    assert not plan.matches(swapped)
    assert not plan.matches(ts[:-1])
    assert not plan.matches(ts[:2] + [ts[2].float()] + ts[3:])
    with pytest.raises(ValueError, match="do not match the plan"):
        plan.pack(swapped)
    with pytest.raises(ValueError, match="do not match the plan"):
        plan.unpack(ts[:-1])
    assert all(torch.equal(a, b) for a, b in zip(plan.buffers, before))


def test_reuse_across_steps_keeps_buffers():
    ts = _mixed()
    plan = BucketPlan(ts)
    ptrs = [b.data_ptr() for b in plan.buffers]
    fresh = [_rand(t.shape, t.dtype, seed=100 + i) for i, t in enumerate(ts)]
    plan.pack(ts)
    plan.pack(fresh)
    assert [b.data_ptr() for b in plan.buffers] == ptrs
    assert all(torch.equal(v, f.to(v.dtype)) for v, f in zip(plan.views(), fresh))


def test_rejects_non_matrices_and_bad_dtypes():
    with pytest.raises(ValueError, match=r"tensor 1 has shape \(5,\)"):
        BucketPlan([_rand((2, 2)), _rand((5,))])
    with pytest.raises(ValueError, match="tensor 0"):
        BucketPlan([_rand((2, 2, 2))])
    with pytest.raises(TypeError, match="tensor 0 has unsupported dtype"):
        BucketPlan([torch.zeros(2, 2, dtype=torch.int32)])
    assert len(BucketPlan([]).buckets) == 0


def test_unpack_checks_every_tensor_before_writing_any():
    ts = [torch.randn(3, 5), torch.randn(5, 3)]
    plan = BucketPlan(ts)
    plan.pack(ts)
    plan.buffers[0].mul_(2)
    first = torch.zeros(3, 5)
    with pytest.raises(RuntimeError, match="tensor 1 has internal overlap"):
        plan.unpack([first, torch.zeros(1, 3).expand(5, 3)])
    assert not first.any()
