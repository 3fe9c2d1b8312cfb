"""MergeLoCo (isoloco_kernels/optim/mergeloco.py) and the reference loop's --merge: each merge, then
Nesterov exactly as IsoLoCo; iso_c is IsoLoCo step for step."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels import IsoLoCo, MergeLoCo
from isoloco_kernels.merges import merge
from isoloco_kernels.merges.reference import merge_ref
from isoloco_kernels.reference import nesterov_ref
from tests.helpers import gen, rel_err, three_params, worker_deltas


def _params():
    g = gen("merge-optim")
    return [
        torch.nn.Parameter(torch.randn(12, 8, generator=g)),
        torch.nn.Parameter(torch.randn(5, generator=g)),
        torch.nn.Parameter(torch.randn((), generator=g)),  # a scalar param: its stack is [K]
    ]


@pytest.mark.parametrize("merge_name", ["mean", "tsv", "iso_cts", "ties", "dare"])
def test_two_steps_are_the_merge_then_nesterov(merge_name):
    params = _params()
    p64 = [p.detach().double() for p in params]
    b64 = [torch.zeros_like(p) for p in p64]
    opt = MergeLoCo(params, lr=0.9, momentum=0.7, merge=merge_name)
    for step in range(2):
        deltas = worker_deltas(params, (merge_name, step), 4)
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
        deltas = worker_deltas(a, ("iso", step), 4)
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
    d = worker_deltas(params, "dare-steps", 4)
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
    bad = worker_deltas(params, "nan", 4)
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


MERGES = ["iso_c", "mean", "tsv", "iso_cts", "ties", "dare"]


K = 3


def _snap(params, opt):
    return (
        [p.detach().clone() for p in params],
        [None if p.grad is None else p.grad.clone() for p in params],
        {i: st["momentum_buffer"].clone() for i, st in opt.state_dict()["state"].items()},
        getattr(opt, "merged_steps", None),
    )


def _eq(x, y) -> bool:
    """Bit for bit, NaN included (a NaN the test put in a param must still be there, nothing else changed)."""
    if x is None or y is None:
        return x is None and y is None
    return (
        x.shape == y.shape and torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))
    )


def _same(a, b) -> bool:
    pa, ga, ba, sa = a
    pb, gb, bb, sb = b
    return (
        all(_eq(x, y) for x, y in zip(pa, pb))
        and all(_eq(x, y) for x, y in zip(ga, gb))
        and ba.keys() == bb.keys()
        and all(_eq(ba[k], bb[k]) for k in ba)
        and sa == sb
    )


# -- 1. a failed MergeLoCo step changes nothing: params, momentum, .grad, the step count ---------------


def _nan_after_merge(params, deltas):
    params[0].data[0, 0] = float("nan")  # a NaN in a param: refused by the update's checks, after the merge


@pytest.mark.parametrize("merge_name", MERGES)
@pytest.mark.parametrize("failure", ["nan-param", "overflow", "closure"])
def test_a_failed_merge_step_changes_nothing(merge_name, failure):
    params = three_params()
    opt = ik.MergeLoCo(params, lr=1.0, momentum=0.8, merge=merge_name)
    opt.step(deltas=worker_deltas(params, ("first", merge_name)))  # momentum exists
    for p in params:
        p.grad = torch.full_like(p, 7.0)  # a stale grad the failed step must leave as it was
    deltas = worker_deltas(params, ("second", merge_name))
    closure = None
    if failure == "nan-param":
        params[1].data[0] = float("nan")
    elif failure == "overflow":
        opt.param_groups[0]["lr"] = 3e38
    else:

        def closure():
            raise RuntimeError("the closure failed")

    before = _snap(params, opt)
    with pytest.raises((ValueError, RuntimeError, ik.ResultOverflowError)) as e:
        opt.step(closure, deltas=deltas)
    if failure != "closure":
        assert "MergeLoCo" in str(e.value) and "IsoLoCo:" not in str(e.value), str(e.value)
    assert _same(before, _snap(params, opt)), "a failed step changed something"


def test_a_param_without_a_delta_is_not_moved_by_a_stale_grad():
    params = three_params()
    opt = ik.MergeLoCo(params, lr=1.0, momentum=0.0, merge="tsv")
    opt.step(deltas=worker_deltas(params, "a"))  # leaves each .grad holding its merge
    before = params[1].detach().clone()
    grad_before = params[1].grad.clone()
    d = worker_deltas(params, "b")
    opt.step(deltas=[d[0], None, d[2]])
    assert torch.equal(params[1], before) and torch.equal(params[1].grad, grad_before)


@pytest.mark.parametrize("merge_name", MERGES)
def test_step_without_deltas_is_refused_for_every_merge(merge_name):
    params = three_params()
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ik.MergeLoCo(params, merge=merge_name)
    before = _snap(params, opt)
    with pytest.raises(ValueError, match="no worker deltas"):
        opt.step()
    assert _same(before, _snap(params, opt))


@pytest.mark.parametrize("merge_name", ["tsv", "ties"])
def test_a_closure_that_calls_backward_does_not_replace_the_merge(merge_name):
    params = three_params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = ik.MergeLoCo(params, lr=1.0, momentum=0.0, merge=merge_name)
    b = ik.MergeLoCo(twin, lr=1.0, momentum=0.0, merge=merge_name)
    deltas = worker_deltas(params, merge_name)

    def closure():
        loss = sum((p.float() ** 2).sum() for p in params)
        loss.backward()
        return loss

    loss = a.step(closure, deltas=deltas)
    b.step(deltas=deltas)
    assert loss is not None and all(torch.equal(p, q) for p, q in zip(params, twin))


def test_set_deltas_keeps_the_stacks_for_the_next_step_and_writes_nothing():
    params = three_params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = ik.MergeLoCo(params, lr=1.0, momentum=0.5, merge="dare")
    b = ik.MergeLoCo(twin, lr=1.0, momentum=0.5, merge="dare")
    deltas = worker_deltas(params, "set")
    a.set_deltas(deltas)
    assert all(p.grad is None for p in params)
    a.step()
    b.step(deltas=deltas)
    assert all(torch.equal(p, q) for p, q in zip(params, twin))
    with pytest.raises(ValueError, match="no worker deltas"):
        a.step()  # the kept stacks served one step


# -- 3. copies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("merge_name", ["tsv", "dare"])
def test_a_copy_of_mergeloco_steps_as_the_original(how, merge_name):
    params = three_params()
    opt = ik.MergeLoCo(
        params, lr=0.7, momentum=0.8, merge=merge_name, merge_options={"seed": 3} if merge_name == "dare" else {}
    )
    opt.step(deltas=worker_deltas(params, "c0"))
    if how == "deepcopy":
        params2, opt2 = copy.deepcopy((params, opt))
    else:
        params2, opt2 = pickle.loads(pickle.dumps((params, opt)))
    assert (opt2.merge, opt2.merge_options, opt2.merged_steps) == (opt.merge, opt.merge_options, 1)
    d = worker_deltas(params, "c1")
    opt.step(deltas=d)
    opt2.step(deltas=d)
    assert all(torch.equal(p, q) for p, q in zip(params, params2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"merge": "task_arithmetic"}, "merge must be one of"),
        ({"merge": "tsv", "merge_options": {"sparsity": 0.1}}, "unknown option"),
        ({"method": "qr"}, "method"),
        ({"compress": "int9"}, "compression spec 'int9'"),
    ],
)
def test_every_setting_error_names_the_optimizer(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=rf"^MergeLoCo: .*{match}"):
        ik.MergeLoCo(three_params(), **kwargs)
    if set(kwargs) == {"method"}:
        with pytest.raises(ValueError, match=rf"^IsoLoCo: .*{match}"):
            ik.IsoLoCo(three_params(), **kwargs)


def test_a_nan_stack_is_named_by_its_param():
    params = three_params()
    opt = ik.MergeLoCo(params, merge="tsv")
    d = worker_deltas(params, "nan-named")
    d[2][1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"MergeLoCo.step: stack 2: worker 1's Δ of param 2 contains NaN"):
        opt.step(deltas=d)
