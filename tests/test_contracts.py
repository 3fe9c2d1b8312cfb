"""One contract for every outer optimizer (docs/guarantees.md), in one process: a failed step changes
nothing, a checkpoint resumes bit for bit and says what wrote it, a copy steps as the original, every
input has one meaning, and iso=False is torch.optim.SGD for any lr and μ set between steps.
The same over ranks: tests/test_checkpoints_dist.py."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.merges import merge
from isoloco_kernels.reference import sgd_nesterov_ref
from tests.helpers import gen, rel_err

MERGES = ["iso_c", "mean", "tsv", "iso_cts", "ties", "dare"]
K = 3


def _params(dtype=torch.float32, key="contracts"):
    g = gen(key)
    shapes = [(7, 5), (4,), (3, 6)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _deltas(params, key, k=K):
    g = gen(key)
    return [torch.randn(k, *p.shape, generator=g).to(p.dtype) for p in params]


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
    params = _params()
    opt = ik.MergeLoCo(params, lr=1.0, momentum=0.8, merge=merge_name)
    opt.step(deltas=_deltas(params, ("first", merge_name)))  # momentum exists
    for p in params:
        p.grad = torch.full_like(p, 7.0)  # a stale grad the failed step must leave as it was
    deltas = _deltas(params, ("second", merge_name))
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
    params = _params()
    opt = ik.MergeLoCo(params, lr=1.0, momentum=0.0, merge="tsv")
    opt.step(deltas=_deltas(params, "a"))  # leaves each .grad holding its merge
    before = params[1].detach().clone()
    grad_before = params[1].grad.clone()
    d = _deltas(params, "b")
    opt.step(deltas=[d[0], None, d[2]])
    assert torch.equal(params[1], before) and torch.equal(params[1].grad, grad_before)


@pytest.mark.parametrize("merge_name", MERGES)
def test_step_without_deltas_is_refused_for_every_merge(merge_name):
    params = _params()
    for p in params:
        p.grad = torch.randn_like(p)
    opt = ik.MergeLoCo(params, merge=merge_name)
    before = _snap(params, opt)
    with pytest.raises(ValueError, match="no worker deltas"):
        opt.step()
    assert _same(before, _snap(params, opt))


@pytest.mark.parametrize("merge_name", ["tsv", "ties"])
def test_a_closure_that_calls_backward_does_not_replace_the_merge(merge_name):
    params = _params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = ik.MergeLoCo(params, lr=1.0, momentum=0.0, merge=merge_name)
    b = ik.MergeLoCo(twin, lr=1.0, momentum=0.0, merge=merge_name)
    deltas = _deltas(params, merge_name)

    def closure():
        loss = sum((p.float() ** 2).sum() for p in params)
        loss.backward()
        return loss

    loss = a.step(closure, deltas=deltas)
    b.step(deltas=deltas)
    assert loss is not None and all(torch.equal(p, q) for p, q in zip(params, twin))


def test_set_deltas_keeps_the_stacks_for_the_next_step_and_writes_nothing():
    params = _params()
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a = ik.MergeLoCo(params, lr=1.0, momentum=0.5, merge="dare")
    b = ik.MergeLoCo(twin, lr=1.0, momentum=0.5, merge="dare")
    deltas = _deltas(params, "set")
    a.set_deltas(deltas)
    assert all(p.grad is None for p in params)
    a.step()
    b.step(deltas=deltas)
    assert all(torch.equal(p, q) for p, q in zip(params, twin))
    with pytest.raises(ValueError, match="no worker deltas"):
        a.step()  # the kept stacks served one step


# -- 2. exact resume, and the checkpoint says which merge wrote it -----------------------------------


@pytest.mark.parametrize("merge_name", MERGES)
def test_resume_is_bit_exact(merge_name):
    def run(steps, opt, params, start=0):
        for s in range(start, steps):
            opt.step(deltas=_deltas(params, ("resume", s)))

    opts = {"sparsity": 0.5} if merge_name == "dare" else {}
    a = _params()
    oa = ik.MergeLoCo(a, lr=0.9, momentum=0.8, merge=merge_name, merge_options=opts)
    run(4, oa, a)
    b = _params()
    ob = ik.MergeLoCo(b, lr=0.9, momentum=0.8, merge=merge_name, merge_options=opts)
    run(2, ob, b)
    saved = pickle.loads(pickle.dumps(ob.state_dict()))  # through bytes, as torch.save would
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    oc = ik.MergeLoCo(c, lr=0.9, momentum=0.8, merge=merge_name, merge_options=opts)
    oc.load_state_dict(saved)
    run(4, oc, c, start=2)
    assert all(torch.equal(p, q) for p, q in zip(a, c)), "the resumed run left the uninterrupted one"
    assert oc.merged_steps == oa.merged_steps == 4


def test_a_checkpoint_of_another_merge_warns_naming_both():
    params = _params()
    tsv = ik.MergeLoCo(params, merge="tsv")
    tsv.step(deltas=_deltas(params, "tsv"))
    ties = ik.MergeLoCo(params, merge="ties")
    with pytest.warns(UserWarning, match="written by merge='tsv'.*continues as merge='ties'"):
        ties.load_state_dict(tsv.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ik.MergeLoCo(params, merge="tsv").load_state_dict(tsv.state_dict())  # the same merge: silent


def test_a_malformed_merge_entry_is_refused_and_nothing_loads():
    params = _params()
    opt = ik.MergeLoCo(params, merge="dare")
    opt.step(deltas=_deltas(params, "m"))
    sd = opt.state_dict()
    sd["merge"] = {"merge": "dare", "options": {}, "steps": 1.5}
    fresh = ik.MergeLoCo(params, merge="dare")
    with pytest.raises(ValueError, match="'merge' entry"):
        fresh.load_state_dict(sd)
    assert fresh.merged_steps == 0 and not fresh.state


# -- 3. copies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("merge_name", ["tsv", "dare"])
def test_a_copy_of_mergeloco_steps_as_the_original(how, merge_name):
    params = _params()
    opt = ik.MergeLoCo(
        params, lr=0.7, momentum=0.8, merge=merge_name, merge_options={"seed": 3} if merge_name == "dare" else {}
    )
    opt.step(deltas=_deltas(params, "c0"))
    if how == "deepcopy":
        params2, opt2 = copy.deepcopy((params, opt))
    else:
        params2, opt2 = pickle.loads(pickle.dumps((params, opt)))
    assert (opt2.merge, opt2.merge_options, opt2.merged_steps) == (opt.merge, opt.merge_options, 1)
    d = _deltas(params, "c1")
    opt.step(deltas=d)
    opt2.step(deltas=d)
    assert all(torch.equal(p, q) for p, q in zip(params, params2))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_isoloco_steps_as_the_original(how):
    params = _params()
    opt = ik.IsoLoCo(params, lr=0.7, momentum=0.8, method="polar")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    params2, opt2 = copy.deepcopy((params, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((params, opt)))
    assert opt2.method == "polar"
    for p, q in zip(params, params2):
        q.grad = p.grad.clone()
    opt.step()
    opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(params, params2))


# -- 6. iso=False is torch.optim.SGD(nesterov=True) for any lr and μ set between steps ---------------

SCHEDULE = [(0.7, 0.9), (0.5, 0.0), (0.3, 0.0), (0.7, 0.5), (1.0, 0.9), (0.2, 0.0), (0.4, 0.8)]


def _sgd_twins(cls, dtype, kw=None):
    a = _params(dtype, "sgd-twins")
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    mine = cls(a, lr=0.7, momentum=0.9, iso=False, **(kw or {}))
    sgd = torch.optim.SGD(b, lr=0.7, momentum=0.9, nesterov=True, fused=True)
    return a, b, mine, sgd


@pytest.mark.parametrize("cls", [ik.IsoLoCo, ik.MergeLoCo], ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("start_at_zero", [False, True], ids=["warm", "from-mu0"])
def test_iso_false_is_sgd_bit_for_bit_under_a_schedule(cls, dtype, start_at_zero):
    """Bit-equal to SGD's fused kernel (the one IsoLoCo's CPU update runs) at every step, through μ = 0,
    where SGD neither makes nor touches its buffer."""
    a, b, mine, sgd = _sgd_twins(cls, dtype, {"merge": "mean"} if cls is ik.MergeLoCo else None)
    schedule = ([(0.5, 0.0)] if start_at_zero else []) + SCHEDULE
    g = gen(("schedule", str(dtype)))
    for step, (lr, mu) in enumerate(schedule):
        for o in (mine, sgd):
            o.param_groups[0].update(lr=lr, momentum=mu)
        grads = [torch.randn(p.shape, generator=g).to(dtype) for p in a]
        for p, gr in zip(b, grads):
            p.grad = gr.clone()
        sgd.step()
        if cls is ik.MergeLoCo:  # K = 2 copies of the grad: their mean is the grad, exactly
            mine.step(deltas=[torch.stack([gr, gr]) for gr in grads])
        else:
            for p, gr in zip(a, grads):
                p.grad = gr.clone()
            mine.step()
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"step {step} (lr {lr}, μ {mu}) left SGD"
        for p, q in zip(a, b):
            has_a, has_b = (
                "momentum_buffer" in mine.state.get(p, {}),
                sgd.state.get(q, {}).get("momentum_buffer") is not None,
            )
            assert has_a == has_b, f"step {step}: a buffer exists on one side only"
            if has_a:
                assert torch.equal(mine.state[p]["momentum_buffer"], sgd.state[q]["momentum_buffer"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_params_follow_sgds_rule_with_float32_momentum(dtype):
    """Half params keep float32 momentum (documented), so bits differ from SGD's half buffer; the rule is
    SGD's: checked against the float64 reference with the float32 buffer, through μ = 0."""
    params = _params(dtype, "half-schedule")
    opt = ik.IsoLoCo(params, iso=False)
    b64 = [None] * len(params)
    g = gen(("half", str(dtype)))
    for lr, mu in SCHEDULE:
        opt.param_groups[0].update(lr=lr, momentum=mu)
        want = []
        for i, p in enumerate(params):  # each step from the rounded param and the float32 buffer, as the optimizer
            gr = torch.randn(p.shape, generator=g).to(dtype)
            p.grad = gr
            w, b64[i] = sgd_nesterov_ref(p.detach().double(), b64[i], gr.double(), lr, mu)
            want.append(w)
        opt.step()
        for p, w in zip(params, want):
            assert rel_err(p, w) <= 2 * torch.finfo(dtype).eps
        for i, p in enumerate(params):
            got = opt.state[p].get("momentum_buffer") if p in opt.state else None
            assert (got is None) == (b64[i] is None)
            if got is not None:
                assert got.dtype == torch.float32 and rel_err(got, b64[i]) <= 1e-6
                b64[i] = got.double()  # the next reference step starts from the optimizer's float32 buffer


# -- 9. the smaller ones ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [ik.IsoLoCo, ik.MergeLoCo], ids=lambda c: c.__name__)
def test_another_optimizers_state_dict_is_named_as_such(cls):
    params = _params()
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params)
    adamw.step()
    opt = cls(params)
    with pytest.raises(ValueError, match="not an SGD-shaped state dict.*exp_avg"):
        opt.load_state_dict(adamw.state_dict())
    assert not opt.state


def test_isoloco_refuses_one_ranks_sharded_state():
    params = _params()
    opt = ik.IsoLoCo(params)
    sd = opt.state_dict()
    sd["sharding"] = {"fingerprint": 1, "rank": 1, "world_size": 2}
    with pytest.raises(ValueError, match="one rank's ShardedIsoLoCo state.*consolidated_state_dict"):
        opt.load_state_dict(sd)


def test_merge_of_one_worker_is_its_definition():
    """K = 1: each merge has a value for one worker (the mean: the delta itself)."""
    d = torch.randn(1, 6, 4, generator=gen("k1"))
    assert torch.equal(merge([d], "mean")[0], d[0])


# -- 5. the CLI checks every combination before any training -------------------------------------------

CLI_SMALL = "-H 2 -R 1 --batch 2 --seq-len 16 --eval-windows 8 --max-bytes 60000 --quiet --threads 1".split()


def test_merge_with_no_merging_mode_is_refused_before_training(capsys, tmp_path):
    from isoloco_kernels.train.cli import main

    with pytest.raises(SystemExit) as e:
        main(CLI_SMALL + ["--mode", "ddp,diloco", "--merge", "tsv", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--merge tsv applies to the Iso-C modes" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_each_outer_step_runs_once_before_training(monkeypatch):
    from isoloco_kernels.train.config import TrainConfig
    from isoloco_kernels.train.optimizers import check_outer_step

    cfg = TrainConfig(workers=1, merge="tsv")
    check_outer_step("isoloco", cfg)  # K = 1 is a merge's value for one worker: it runs
    check_outer_step("ddp", cfg)  # no outer step: nothing to check

    def refuse(self, *a, **k):
        raise ValueError("this merge cannot run here")

    monkeypatch.setattr(ik.MergeLoCo, "step", refuse)
    with pytest.raises(ValueError, match="--mode isoloco with K=1, merge 'tsv': its outer step cannot run: this merge"):
        check_outer_step("isoloco", cfg)


@pytest.mark.parametrize("cls", [ik.IsoLoCo, ik.MergeLoCo], ids=lambda c: c.__name__)
def test_torch_lr_schedulers_drive_the_outer_lr_as_sgds(cls):
    """A warm-up then cosine decay (torch's schedulers, as the reference loop's --outer-schedule uses): the lr
    is read every step, bit-equal to SGD under the same schedulers."""
    a, b, mine, sgd = _sgd_twins(cls, torch.float32, {"merge": "mean"} if cls is ik.MergeLoCo else None)
    scheds = []
    for o in (mine, sgd):
        warm = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=0.07)
        scheds.append(torch.optim.lr_scheduler.SequentialLR(o, [warm, cos], milestones=[3]))
    g = gen("scheduled")
    for step in range(9):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        for p, gr in zip(b, grads):
            p.grad = gr.clone()
        if cls is ik.MergeLoCo:
            mine.step(deltas=[torch.stack([gr, gr]) for gr in grads])
        else:
            for p, gr in zip(a, grads):
                p.grad = gr.clone()
            mine.step()
        sgd.step()
        for s in scheds:
            s.step()
        assert mine.param_groups[0]["lr"] == sgd.param_groups[0]["lr"]
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"step {step} left SGD"


_WORLD_ONE = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
import isoloco_kernels as ik
for merge in ("iso_c", "mean", "tsv", "iso_cts", "ties", "dare"):
    g = torch.Generator().manual_seed(3)
    a = [torch.randn(7, 5, generator=g), torch.randn(4, generator=g)]
    b = [torch.nn.Parameter(p.clone()) for p in a]
    sharded = ik.ShardedIsoLoCo(a, lr=0.9, momentum=0.8, merge=merge)
    one = ik.MergeLoCo(b, lr=0.9, momentum=0.8, merge=merge)
    for step in range(2):
        deltas = [torch.randn(p.shape, generator=g) for p in a]
        for p, d in zip(a, deltas):
            p.grad = d.clone()
        sharded.step()
        one.step(deltas=[d[None] for d in deltas])
        assert all(torch.equal(p, q) for p, q in zip(a, b)), (merge, step)
dist.destroy_process_group()
print("K1 OK")
"""


@pytest.mark.slow
def test_sharded_at_world_size_one_is_each_merge_of_one_worker():
    """K = 1 over ranks: ShardedIsoLoCo on one rank steps as MergeLoCo with [1, *shape] stacks, every merge."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", _WORLD_ONE.format(root=root)], capture_output=True, text=True, timeout=300
    )
    assert "K1 OK" in out.stdout, out.stderr[-3000:]


def test_a_non_contiguous_param_leaves_the_others_bit_equal_to_sgd():
    """A channels_last conv kernel takes the foreach update; the contiguous params beside it in the same group still
    take the fused kernel, bit-equal to SGD's, and the conv kernel follows the rule within rounding."""
    g = gen("channels-last")
    conv = torch.randn(8, 3, 3, 3, generator=g).to(memory_format=torch.channels_last)
    a = [
        torch.nn.Parameter(conv),
        torch.nn.Parameter(torch.randn(8, generator=g)),
        torch.nn.Parameter(torch.randn(5, 6, generator=g)),
    ]
    b = [torch.nn.Parameter(p.detach().clone().contiguous()) for p in a]
    mine = ik.IsoLoCo(a, lr=0.7, momentum=0.9, iso=False)
    sgd = torch.optim.SGD(b, lr=0.7, momentum=0.9, nesterov=True, fused=True)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        for p, q, gr in zip(a, b, grads):
            p.grad, q.grad = gr.clone().to(memory_format=torch.channels_last) if p.ndim == 4 else gr.clone(), gr.clone()
        mine.step()
        sgd.step()
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    assert rel_err(a[0], b[0].double()) <= 4 * torch.finfo(torch.float32).eps


def test_a_torchrun_launch_refuses_a_merge_on_the_replicated_outer_step_before_training():
    """Under torchrun the replicated outer step sees only the average: --merge tsv is refused by the launch's
    up-front check (it used to train the modes before it, then fail at IsoLoCo's first outer step)."""
    from isoloco_kernels.train.config import TrainConfig
    from isoloco_kernels.train.dist import Launch

    launch = Launch(rank=0, world_size=2, local_rank=0)
    with pytest.raises(ValueError, match="--merge tsv needs every worker's own delta: add --outer sharded"):
        launch.check([TrainConfig(workers=2, merge="tsv")], None, "cpu", "replicated")
    launch.check([TrainConfig(workers=2, merge="tsv")], None, "cpu", "sharded")  # the sharded step merges
    launch.check([TrainConfig(workers=2)], None, "cpu", "replicated")


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
        ik.MergeLoCo(_params(), **kwargs)
    if set(kwargs) == {"method"}:
        with pytest.raises(ValueError, match=rf"^IsoLoCo: .*{match}"):
            ik.IsoLoCo(_params(), **kwargs)


def test_a_nan_stack_is_named_by_its_param():
    params = _params()
    opt = ik.MergeLoCo(params, merge="tsv")
    d = _deltas(params, "nan-named")
    d[2][1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"MergeLoCo.step: stack 2: worker 1's Δ of param 2 contains NaN"):
        opt.step(deltas=d)


def test_merge_entry_warnings_are_consistent():
    """DARE's default seed written out is the same merge (no warning); another merge's checkpoint loaded into
    IsoLoCo warns as MergeLoCo does; an AdamW dict is refused before any warning about its missing entry."""
    params = _params()
    dare = ik.MergeLoCo(params, merge="dare")
    dare.step(deltas=_deltas(params, "dare-entry"))
    sd = dare.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ik.MergeLoCo(params, merge="dare", merge_options={"seed": 0}).load_state_dict(sd)
    with pytest.warns(UserWarning, match="written by merge='dare'; IsoLoCo continues as Iso-C of the mean"):
        ik.IsoLoCo(params).load_state_dict(sd)
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params)
    adamw.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="not an SGD-shaped state dict"):
            ik.MergeLoCo(params, merge="dare").load_state_dict(adamw.state_dict())
