"""The norm clip before a merge (`merge(..., clip=)`, `clip_stacks`, isoloco_kernels/merges/norm.py): each
worker's Δ of a tensor scaled to at most the workers' median norm ("median") or a given cap, never up; against
its float64 definition (merges/reference.py, `clip_ref`); a cap nothing reaches is no clip bit for bit; bad
clip values refused by name with nothing written."""

from __future__ import annotations

import math

import pytest
import torch

from isoloco_kernels.merges import MERGES, clip_stacks, merge, merge_, worker_norms
from isoloco_kernels.merges.reference import clip_ref, merge_ref
from tests.helpers import TOL, gen, merge_tol, rel_err
from tests.merges.test_merges import gap_cond

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(12, 16), (16, 12), (1, 9), (9, 1), (7,), (), (2, 3, 4)]
OPTS = {"ties": {"sparsity": 0.5}, "dare": {"sparsity": 0.5, "seed": 3}}


def _stack(K, shape, dtype, key, spread=True):
    """K workers' deltas, worker k scaled by 1 + k (spread): norms far apart, so the median cuts some."""
    x = torch.randn(K, *shape, generator=gen(key), dtype=torch.float64)
    if spread:
        x = x * torch.arange(1, K + 1, dtype=torch.float64).reshape(-1, *[1] * len(shape))
    return x.to(dtype)


def _with_norms(norms, shape=(6, 5), key="norms"):
    """Workers of exactly the given float64 norms (a random direction each)."""
    x = torch.randn(len(norms), *shape, generator=gen(key), dtype=torch.float64)
    return (
        x
        / torch.linalg.vector_norm(x.reshape(len(norms), -1), dim=1).reshape(-1, 1, 1)
        * torch.tensor(norms, dtype=torch.float64).reshape(-1, 1, 1)
    )


# -- a cap nothing reaches: no clip, bit for bit ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", list(MERGES))
def test_a_cap_nothing_reaches_is_no_clip_bit_for_bit(method, dtype):
    stacks = [_stack(4, s, dtype, ("noclip", method, s)) for s in SHAPES]
    want = merge(stacks, method, **OPTS.get(method, {}))
    for clip in (math.inf, 1e300, float(torch.finfo(dtype).max)):
        got = merge(stacks, method, clip=clip, **OPTS.get(method, {}))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (method, dtype, clip)
    one = [s[:1] for s in stacks]  # K = 1: the median is the worker's own norm
    got = merge(one, method, clip="median", **OPTS.get(method, {}))
    assert all(torch.equal(a, b) for a, b in zip(got, merge(one, method, **OPTS.get(method, {}))))


# -- the rule -----------------------------------------------------------------------------------------------


def test_one_worker_scaled_ten_times_is_brought_to_the_median():
    x = _stack(5, (12, 16), torch.float32, "ten", spread=False)
    x[2] *= 10.0
    norms = torch.stack([d.double().norm() for d in x])
    median = float(norms.sort().values[2])
    c = clip_stacks([x], "median")
    (clipped,) = c.stacks
    assert rel_err(c.norms[0], norms) <= 1e-6 and abs(c.caps[0] / median - 1) <= 1e-6
    assert abs(float(clipped[2].double().norm()) / median - 1) <= 1e-6  # the outlier: at the median
    for k in range(5):
        if float(norms[k]) <= c.caps[0]:
            assert torch.equal(clipped[k], x[k]), k  # at or below the median: untouched, bit for bit
        else:
            assert float(clipped[k].double().norm()) <= median * (1 + 1e-6), k  # above: shrunk to it
    # the merge reads the clipped workers: the outlier no longer dominates the mean
    got = merge([x], "mean", clip="median")[0]
    assert rel_err(got, clipped.double().mean(0)) <= TOL[("merge_sparse", torch.float32)]
    assert rel_err(got, merge_ref(x, "mean", clip="median")) <= TOL[("merge_sparse", torch.float32)]


def test_the_median_of_an_even_count_is_the_mean_of_the_middle_two_and_only_shrinks():
    x = _with_norms([1.0, 2.0, 3.0, 10.0])
    c = clip_stacks([x], "median")
    assert c.caps == [2.5]
    got = torch.stack([d.norm() for d in c.stacks[0]])
    assert torch.allclose(got, torch.tensor([1.0, 2.0, 2.5, 2.5], dtype=torch.float64), rtol=1e-14, atol=0)
    assert torch.equal(c.stacks[0][:2], x[:2])
    # the absolute cap: min(norm, cap) per worker
    c = clip_stacks([x], 2.0)
    got = torch.stack([d.norm() for d in c.stacks[0]])
    assert torch.allclose(got, torch.tensor([1.0, 2.0, 2.0, 2.0], dtype=torch.float64), rtol=1e-14, atol=0)
    assert c.caps == [2.0] and torch.equal(c.stacks[0][:2], x[:2])


def test_the_median_is_over_the_workers_with_weight():
    """Norms 1, 2, 3, 10 with worker 2 at weight 0: the median of 1, 2, 10 is 2."""
    x = _with_norms([1.0, 2.0, 3.0, 10.0], key="w-median")
    ref, _, cap = clip_ref(x, "median", weights=[1, 1, 0, 1])
    assert cap == 2.0
    got = merge([x], "tsv", clip="median", weights=[1, 1, 0, 1])[0]
    assert torch.equal(got, merge([x[[0, 1, 3]]], "tsv", clip="median")[0])
    assert rel_err(got, merge_ref(x, "tsv", clip="median", weights=[1, 1, 0, 1])) <= 1e-10
    assert abs(float(ref[3].norm()) - 2.0) <= 1e-14


def test_vectors_scalars_and_nd_tensors_are_clipped_by_their_whole_norm():
    for shape in [(7,), (), (2, 3, 4)]:
        x = _stack(3, shape, torch.float64, ("whole", shape))
        c = clip_stacks([x], "median")
        n = torch.stack([d.norm() for d in x])
        assert torch.allclose(c.norms[0], n, rtol=1e-15, atol=0)
        out = torch.stack([d.norm() for d in c.stacks[0]])
        assert torch.allclose(out, n.clamp_max(float(n.median())), rtol=1e-14, atol=0), shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", list(MERGES))
def test_clipped_merges_match_their_float64_definition(method, dtype):
    for clip in ("median", 3.0):
        for shape in SHAPES:
            x = _stack(4, shape, dtype, ("clip", method, shape))
            out = merge([x], method, clip=clip, **OPTS.get(method, {}))[0]
            ref = merge_ref(x, method, clip=clip, **OPTS.get(method, {}))
            clipped = clip_ref(x, clip)[0]
            tol = merge_tol(method, dtype, gap_cond(clipped, method))
            assert rel_err(out, ref) <= tol, (method, clip, shape, dtype, rel_err(out, ref), tol)


def test_norms_near_the_dtype_max_and_zero_workers():
    top = torch.finfo(torch.float32).max
    x = torch.full((3, 4, 4), top / 2)  # every norm 2·top: past float32, not float64
    x[1] /= 4
    n = worker_norms(x)
    assert torch.allclose(n, torch.tensor([2.0, 0.5, 2.0], dtype=torch.float64) * top, rtol=1e-7, atol=0)
    (clipped,) = clip_stacks([x], "median").stacks  # the median is 2·top: nothing over it
    assert torch.equal(clipped, x)
    (clipped,) = clip_stacks([x], top).stacks
    assert torch.isfinite(clipped).all() and abs(float(clipped[0].double().norm()) / top - 1) <= 1e-6
    z = torch.zeros(3, 4, 4)
    z[2] = 1.0  # two zero workers: the median norm is 0, the third is cut to zero (never NaN)
    c = clip_stacks([z], "median")
    assert c.caps == [0.0] and torch.equal(c.stacks[0], torch.zeros(3, 4, 4))


# -- refused by name, nothing written ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "clip, error",
    [
        ("mean", TypeError),
        ("Median", TypeError),
        (0, ValueError),
        (0.0, ValueError),
        (-1.0, ValueError),
        (-math.inf, ValueError),
        (math.nan, ValueError),
        (True, TypeError),
        ([1.0], TypeError),
        (torch.tensor([1.0, 2.0]), TypeError),
    ],
)
def test_bad_clip_values_are_refused_by_name_and_nothing_is_written(clip, error):
    x = _stack(3, (6, 5), torch.float32, "clip-bad")
    before = x.clone()
    shown = "nan" if isinstance(clip, float) and math.isnan(clip) else repr(clip)[:12]
    with pytest.raises(error, match=r"^merge: clip must be 'median' or a positive number") as e:
        merge_([x], "mean", clip=clip)
    assert shown in str(e.value)
    assert torch.equal(x, before)


def test_clip_accepts_numbers_of_any_kind_and_the_in_place_merge_writes_the_clipped_merge():
    x = _stack(3, (6, 5), torch.float32, "clip-kinds")
    want = merge([x], "iso_c", clip=2.0)[0]
    for clip in (2, torch.tensor(2.0)):
        assert torch.equal(merge([x], "iso_c", clip=clip)[0], want)
    before = x.clone()
    (slot,) = merge_([x], "iso_c", clip=2.0)
    assert torch.equal(slot, want) and torch.equal(x[1:], before[1:])  # the clip itself writes nothing


def test_the_norms_of_many_stacks_are_each_stacks_own():
    """worker_norms_each copies to the host once per device: the same float64 bits as one stack at a time."""
    from isoloco_kernels.merges.norm import worker_norms, worker_norms_each

    g = torch.Generator().manual_seed(11)
    stacks = [
        torch.randn(3, 5, 4, generator=g),
        torch.zeros(3, 0),
        (torch.randn(3, 7, generator=g) * 1e4).to(torch.bfloat16),
        torch.randn(3, 6, generator=g, dtype=torch.float64) * 1e-300,
    ]
    got = worker_norms_each(stacks)
    for s, n in zip(stacks, got):
        assert n.dtype == torch.float64 and n.device.type == "cpu" and n.shape == (3,)
        assert torch.equal(n, worker_norms(s))
        m = float(s.double().abs().max()) if s.numel() else 1.0  # the float64 reference scaled too (1e-300² = 0)
        want = torch.linalg.vector_norm(s.double().reshape(3, -1) / m, dim=1) * m
        torch.testing.assert_close(n, want, rtol=2e-3 if s.dtype == torch.bfloat16 else 1e-6, atol=0)
