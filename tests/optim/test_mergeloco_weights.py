"""MergeLoCo.step(deltas=..., weights=...) and set_deltas(..., weights=...): the weighted merge (merges.merge's
weights), then Nesterov; equal weights are the unweighted step bit for bit; a zero weight is that worker
dropped; bad weights are refused by name with nothing changed."""

from __future__ import annotations

import pytest
import torch

from isoloco_kernels import MergeLoCo
from isoloco_kernels.merges import MERGES
from isoloco_kernels.merges.reference import merge_ref
from isoloco_kernels.reference import nesterov_ref
from tests.helpers import gen, rel_err, three_params, worker_deltas

OPTS = {"dare": {"sparsity": 0.5, "seed": 2}, "ties": {"sparsity": 0.3}}


def _params():
    return three_params(key="mw")


def _opt(params, method, **kw):
    return MergeLoCo(params, lr=0.8, momentum=0.6, merge=method, merge_options=OPTS.get(method, {}), **kw)


def _snap(params, opt):
    return (
        [p.detach().clone() for p in params],
        [None if p.grad is None else p.grad.clone() for p in params],
        {i: st["momentum_buffer"].clone() for i, st in opt.state_dict()["state"].items()},
        opt.merged_steps,
    )


def _same(a, b) -> bool:
    eq = lambda x, y: (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))  # noqa: E731
    return (
        all(eq(x, y) for x, y in zip(a[0], b[0]))
        and all(eq(x, y) for x, y in zip(a[1], b[1]))
        and a[2].keys() == b[2].keys()
        and all(eq(a[2][k], b[2][k]) for k in a[2])
        and a[3] == b[3]
    )


def _step_alike(method, key, step_a, step_b) -> bool:
    """Two optimizers over equal params, stepped twice on the same 4 workers' deltas d, one by step_a(opt, d),
    the other by step_b(opt, d): whether their params, grads, momentum and step count are bit for bit equal."""
    a, b = _params(), _params()
    opt_a, opt_b = _opt(a, method), _opt(b, method)
    for step in range(2):
        d = worker_deltas(a, (key, method, step), 4)
        step_a(opt_a, d)
        step_b(opt_b, d)
    return _same(_snap(a, opt_a), _snap(b, opt_b))


@pytest.mark.parametrize("method", list(MERGES))
def test_equal_weights_step_bit_for_bit_as_no_weights(method):
    assert _step_alike(
        method, "eq", lambda opt, d: opt.step(deltas=d), lambda opt, d: opt.step(deltas=d, weights=[3.0] * 4)
    )


@pytest.mark.parametrize("method", list(MERGES))
def test_a_zero_weight_steps_as_the_stacks_without_that_worker(method):
    assert _step_alike(
        method,
        "drop",
        lambda opt, d: opt.step(deltas=d, weights=torch.tensor([1.0, 1.0, 1.0, 0.0])),
        # the last worker dropped: DARE's others keep their stream index
        lambda opt, d: opt.step(deltas=[s[:3] for s in d]),
    )


@pytest.mark.parametrize("method", list(MERGES))
def test_weighted_steps_are_the_weighted_merge_then_nesterov(method):
    params = _params()
    p64 = [p.detach().double() for p in params]
    b64 = [torch.zeros_like(p) for p in p64]
    opt = _opt(params, method)
    w = [0.5, 2.0, 0.0, 1.5]
    for step in range(2):
        d = worker_deltas(params, ("wstep", method, step), 4)
        opt.step(deltas=d, weights=w)
        for i, s in enumerate(d):
            opts = dict(OPTS.get(method, {}))
            if method == "dare":
                opts["seed"] += step
            m = merge_ref(s, method, stack=i, weights=w, **opts)
            p64[i], b64[i] = nesterov_ref(p64[i], b64[i], m, 0.8, 0.6)
    for p, want in zip(params, p64):
        assert rel_err(p, want) <= 1e-5, method


def test_a_group_without_iso_takes_the_weighted_mean():
    g = gen("w-groups")
    w1 = torch.nn.Parameter(torch.randn(6, 4, generator=g))
    w2 = torch.nn.Parameter(torch.randn(6, 4, generator=g))
    before = w2.detach().clone()
    opt = MergeLoCo([{"params": [w1]}, {"params": [w2], "iso": False}], lr=1.0, momentum=0.0, merge="tsv")
    d = [torch.randn(3, 6, 4, generator=g), torch.randn(3, 6, 4, generator=g)]
    opt.step(deltas=d, weights=[1.0, 0.0, 3.0])
    assert rel_err(before - w2.detach(), merge_ref(d[1], "mean", weights=[1.0, 0.0, 3.0])) <= 1e-6


def test_set_deltas_keeps_the_weights_for_the_next_step():
    a, b = _params(), _params()
    opt_a, opt_b = _opt(a, "norm_mean"), _opt(b, "norm_mean")
    d = worker_deltas(a, "w-set", 3)
    opt_a.set_deltas(d, weights=[1.0, 2.0, 0.0])
    opt_a.step()
    opt_b.step(deltas=d, weights=[1.0, 2.0, 0.0])
    assert _same(_snap(a, opt_a), _snap(b, opt_b))
    opt_a.set_deltas(d)
    with pytest.raises(ValueError, match="weights go with their deltas: pass them to set_deltas"):
        opt_a.step(weights=[1.0, 1.0, 1.0])


@pytest.mark.parametrize(
    "weights, match",
    [
        ([1.0, -1.0, 1.0], r"weights\[1\] = -1\.0 \(worker 1's weight\) is negative"),
        ([1.0, float("nan"), 1.0], r"weights\[1\] = nan"),
        ([1.0, 1.0], r"2 weights for K = 3 workers"),
        ([0.0, 0.0, 0.0], r"every weight is 0"),
        ("111", r"weights must be a 1-D tensor or a sequence"),
    ],
)
def test_bad_weights_are_refused_by_name_and_nothing_changes(weights, match):
    params = _params()
    opt = _opt(params, "tsv")
    opt.step(deltas=worker_deltas(params, "w-first", 3))  # momentum exists
    before = _snap(params, opt)
    with pytest.raises((ValueError, TypeError), match=rf"^MergeLoCo.step: {match}"):
        opt.step(deltas=worker_deltas(params, "w-second", 3), weights=weights)
    with pytest.raises((ValueError, TypeError), match=rf"^MergeLoCo.set_deltas: {match}"):
        opt.set_deltas(worker_deltas(params, "w-second", 3), weights=weights)
    assert _same(before, _snap(params, opt))
    with pytest.raises(ValueError, match="no worker deltas"):  # the refused set_deltas kept nothing
        opt.step()


def test_compress_takes_equal_weights_and_refuses_others_before_anything_changes():
    a, b = _params(), _params()
    opt_a, opt_b = _opt(a, "tsv", compress="int8:64"), _opt(b, "tsv", compress="int8:64")
    d = worker_deltas(a, "w-compress", 3)
    opt_a.step(deltas=d)
    opt_b.step(deltas=d, weights=[2, 2, 2])
    assert _same(_snap(a, opt_a), _snap(b, opt_b))
    before = _snap(a, opt_a)
    for w in ([1.0, 2.0, 1.0], [1.0, 0.0, 1.0]):
        with pytest.raises(ValueError, match=r"^MergeLoCo.step: weights with compress= must be equal"):
            opt_a.step(deltas=d, weights=w)
    assert _same(before, _snap(a, opt_a))
