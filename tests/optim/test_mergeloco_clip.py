"""MergeLoCo(clip=...): each worker's Δ of each param clipped (merges.clip_stacks) before the merge and before
any compression; the norms it saw in last_worker_norms / last_clip_caps; a cap nothing reaches is no clip bit for
bit; a bad clip refused by name."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from isoloco_kernels import MergeLoCo
from isoloco_kernels.merges import clip_stacks
from isoloco_kernels.merges.reference import clip_ref, merge_ref
from isoloco_kernels.reference import nesterov_ref
from tests.helpers import rel_err, three_params, worker_deltas


def _params():
    return three_params(key="mc")


def _deltas(params, K, key):
    out = worker_deltas(params, key, K)
    for d in out:
        d[1] *= 10.0  # worker 1 far larger than the others
    return out


@pytest.mark.parametrize("method", ["mean", "iso_c", "norm_mean", "tsv", "ties"])
@pytest.mark.parametrize("clip", ["median", 2.5])
def test_steps_are_the_clipped_merge_then_nesterov(method, clip):
    params = _params()
    p64 = [p.detach().double() for p in params]
    b64 = [torch.zeros_like(p) for p in p64]
    opt = MergeLoCo(params, lr=0.8, momentum=0.6, merge=method, clip=clip)
    for step in range(2):
        d = _deltas(params, 4, ("clip-steps", step))
        opt.step(deltas=d)
        for i, s in enumerate(d):
            _, norms, cap = clip_ref(s, clip)
            assert rel_err(opt.last_worker_norms[i], norms) <= 1e-6 and abs(opt.last_clip_caps[i] / cap - 1) <= 1e-6
            p64[i], b64[i] = nesterov_ref(p64[i], b64[i], merge_ref(s, method, stack=i, clip=clip), 0.8, 0.6)
    for p, want in zip(params, p64):
        assert rel_err(p, want) <= 1e-5, method


def test_a_cap_nothing_reaches_steps_bit_for_bit_as_no_clip():
    a, b = _params(), _params()
    opt_a = MergeLoCo(a, lr=0.8, momentum=0.6, merge="tsv")
    opt_b = MergeLoCo(b, lr=0.8, momentum=0.6, merge="tsv", clip=math.inf)
    for step in range(2):
        d = _deltas(a, 3, ("clip-inf", step))
        opt_a.step(deltas=d)
        opt_b.step(deltas=d)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a, b))
    assert opt_a.last_worker_norms == {} and set(opt_b.last_worker_norms) == {0, 1, 2}


def test_the_clip_comes_before_the_compression():
    """MergeLoCo(compress, clip) fed the raw deltas writes what MergeLoCo(compress) fed the clipped deltas
    writes: the workers compress their clipped Δ (and keep their residuals of it)."""
    a, b = _params(), _params()
    opt_a = MergeLoCo(a, lr=0.8, momentum=0.6, merge="norm_mean", compress="int8:64:0.9", clip="median")
    opt_b = MergeLoCo(b, lr=0.8, momentum=0.6, merge="norm_mean", compress="int8:64:0.9")
    for step in range(2):
        d = _deltas(a, 3, ("clip-compress", step))
        opt_a.step(deltas=d)
        opt_b.step(deltas=clip_stacks(d, "median").stacks)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert all(torch.equal(opt_a._residuals[i], opt_b._residuals[i]) for i in opt_b._residuals)


def test_the_median_is_over_the_workers_with_weight():
    a, b = _params(), _params()
    opt_a = MergeLoCo(a, lr=1.0, momentum=0.0, merge="mean", clip="median")
    opt_b = MergeLoCo(b, lr=1.0, momentum=0.0, merge="mean", clip="median")
    d = _deltas(a, 4, "clip-w")
    opt_a.step(deltas=d, weights=[1.0, 1.0, 0.0, 1.0])
    opt_b.step(deltas=[s[[0, 1, 3]] for s in d])
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert opt_a.last_worker_norms[0].shape == (4,)  # every worker's norm is reported, the dropped one's too


def test_a_failed_step_keeps_the_last_norms_and_changes_nothing():
    params = _params()
    opt = MergeLoCo(params, lr=1.0, momentum=0.5, merge="tsv", clip="median")
    opt.step(deltas=_deltas(params, 3, "clip-ok"))
    norms = {i: n.clone() for i, n in opt.last_worker_norms.items()}
    before = [p.detach().clone() for p in params]
    opt.param_groups[0]["lr"] = 3e38  # the update overflows
    with pytest.raises(Exception, match="MergeLoCo"):
        opt.step(deltas=_deltas(params, 3, "clip-fail"))
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert all(torch.equal(opt.last_worker_norms[i], norms[i]) for i in norms) and opt.merged_steps == 1


@pytest.mark.parametrize("clip, error", [("mean", TypeError), (0.0, ValueError), (-2, ValueError), (True, TypeError)])
def test_a_bad_clip_is_refused_by_name(clip, error):
    with pytest.raises(error, match=r"^MergeLoCo: clip must be 'median' or a positive number"):
        MergeLoCo(_params(), clip=clip)


def test_a_copy_keeps_its_clip():
    params = _params()
    opt = MergeLoCo(params, lr=1.0, momentum=0.5, merge="mean", clip=3.0)
    opt.step(deltas=_deltas(params, 3, "clip-copy"))
    params2, opt2 = copy.deepcopy((params, opt))
    assert opt2.clip == 3.0 and set(opt2.last_clip_caps) == {0, 1, 2}
    d = _deltas(params, 3, "clip-copy-2")
    opt.step(deltas=d)
    opt2.step(deltas=d)
    assert all(torch.equal(p, q) for p, q in zip(params, params2))
