"""MergeLoCo (isoloco_kernels/optim/mergeloco.py) and the reference loop's --merge: each merge, then
Nesterov exactly as IsoLoCo; iso_c is IsoLoCo step for step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from isoloco_kernels import IsoLoCo, MergeLoCo
from isoloco_kernels.merges import merge
from isoloco_kernels.merges.reference import merge_ref
from isoloco_kernels.reference import nesterov_ref
from tests.helpers import gen, rel_err


def _params():
    g = gen("merge-optim")
    return [
        torch.nn.Parameter(torch.randn(12, 8, generator=g)),
        torch.nn.Parameter(torch.randn(5, generator=g)),
        torch.nn.Parameter(torch.randn((), generator=g)),  # a scalar param: its stack is [K]
    ]


def _deltas(params, K, key):
    g = gen(key)
    return [torch.randn(K, *p.shape, generator=g) for p in params]


@pytest.mark.parametrize("merge_name", ["mean", "tsv", "iso_cts", "ties", "dare"])
def test_two_steps_are_the_merge_then_nesterov(merge_name):
    params = _params()
    p64 = [p.detach().double() for p in params]
    b64 = [torch.zeros_like(p) for p in p64]
    opt = MergeLoCo(params, lr=0.9, momentum=0.7, merge=merge_name)
    for step in range(2):
        deltas = _deltas(params, 4, (merge_name, step))
        opt.step(deltas=deltas)
        for i, d in enumerate(deltas):
            opts = {"seed": step} if merge_name == "dare" else {}
            m = merge_ref(d, merge_name, stack=i, **opts)
            p64[i], b64[i] = nesterov_ref(p64[i], b64[i], m, 0.9, 0.7)
    for p, want in zip(params, p64):
        assert rel_err(p, want) <= 1e-5


def test_iso_c_is_isoloco_bit_for_bit():
    a, b = _params(), _params()
    opt_a = MergeLoCo(a, lr=1.8, momentum=0.8)
    opt_b = IsoLoCo(b, lr=1.8, momentum=0.8)
    for step in range(3):
        deltas = _deltas(a, 4, ("iso", step))
        opt_a.step(deltas=deltas)
        for p, d in zip(b, deltas):
            p.grad = d.mean(0)
        opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    assert opt_a.state_dict()["param_groups"] == opt_b.state_dict()["param_groups"]


def test_dare_draws_new_drops_each_step():
    params = _params()
    opt = MergeLoCo(params, lr=1.0, momentum=0.0, merge="dare", merge_options={"sparsity": 0.5})
    d = _deltas(params, 4, "dare-steps")
    opt.step(deltas=d)
    g0 = params[0].grad.clone()  # the merge the step took
    opt.step(deltas=d)
    assert not torch.equal(g0, params[0].grad)
    assert torch.equal(g0, merge([d[0]], "dare", sparsity=0.5, seed=0, stack_ids=[0])[0])


def test_bad_input_is_refused_and_nothing_changes():
    params = _params()
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="merge must be one of"):
        MergeLoCo(params, merge="task_arithmetic")
    with pytest.raises(TypeError, match="unknown option"):
        MergeLoCo(params, merge="tsv", merge_options={"sparsity": 0.1})
    opt = MergeLoCo(params, merge="ties")
    with pytest.raises(ValueError, match="stack 0 has shape"):
        opt.step(deltas=[torch.randn(4, 8, 12), torch.randn(4, 5), torch.randn(4)])
    with pytest.raises(ValueError, match="K = 0"):
        opt.step(deltas=[torch.randn(0, 12, 8), torch.randn(0, 5), torch.randn(0)])
    bad = _deltas(params, 4, "nan")
    bad[1][3, 2] = float("nan")
    with pytest.raises(ValueError, match="stack 1: worker 3's Δ of param 1 contains NaN"):
        opt.step(deltas=bad)
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and all(p.grad is None for p in params)


@pytest.mark.parametrize("merge_name", ["tsv", "ties"])
def test_reference_loop_runs_each_merge(merge_name):
    from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode

    cfg = TrainConfig(model="tiny", seq_len=16, workers=2, inner_steps=3, rounds=2, batch=2, warmup=1, eval_windows=8)
    cfg = dataclasses.replace(cfg, merge=merge_name)
    cfg.validate()
    r = run_mode("isoloco-sgd", Setup(cfg, load_corpus(max_bytes=60_000)))
    assert r["final_loss"] is not None and r["final_loss"] < 6.0
