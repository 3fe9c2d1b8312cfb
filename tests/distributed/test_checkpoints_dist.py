"""The outer optimizers' contract over ranks (2 and 3 gloo ranks, tests/spawn.py): ShardedIsoLoCo resumes
bit for bit for every merge, its consolidated state moves between world sizes and into IsoLoCo, a rank's
own state is refused where a whole one is expected, iso=False is SGD under a momentum schedule through
μ = 0, and world size 1 means K = 1 for every merge. The one-process side: tests/optim/ and tests/outer/."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import IsoLoCo, MergeLoCo, ShardedIsoLoCo
from tests.helpers import seeded, step_as_rank
from tests.spawn import Checks, groups, params

pytestmark = pytest.mark.slow  # spawns gloo ranks

SHAPES = [(12, 8), (5,), (8, 12), (40, 6), ()]
MERGES = [("iso_c", {}), ("mean", {}), ("tsv", {}), ("iso_cts", {}), ("ties", {"sparsity": 0.3}), ("dare", {"seed": 2})]
TABLES = {2: Checks(), 3: Checks()}


def _params(dtype=torch.float32):
    return seeded(SHAPES, 7, dtype)


def _grads(world: int, step: int, dtype=torch.float32):
    return seeded(SHAPES, 500 + step, dtype, k=world)


def _steps(opt, ps, rank, world, steps, dtype=torch.float32):
    for s in steps:
        step_as_rank(opt, ps, _grads(world, s, dtype), rank)


def _resume_is_bit_exact(rank, world, merge, opts, dtype):
    """2 steps, save, a fresh optimizer loads, 2 more: bit-equal to 4 uninterrupted steps on every rank."""
    a = _params(dtype)
    oa = ShardedIsoLoCo(a, lr=0.9, momentum=0.8, merge=merge, merge_options=opts)
    _steps(oa, a, rank, world, range(4), dtype)
    b = _params(dtype)
    ob = ShardedIsoLoCo(b, lr=0.9, momentum=0.8, merge=merge, merge_options=opts)
    _steps(ob, b, rank, world, range(2), dtype)
    saved = ob.state_dict()
    c = [p.detach().clone() for p in b]
    oc = ShardedIsoLoCo(c, lr=0.9, momentum=0.8, merge=merge, merge_options=opts)
    oc.load_state_dict(saved)
    _steps(oc, c, rank, world, range(2, 4), dtype)
    for i, (p, q) in enumerate(zip(a, c)):
        assert torch.equal(p, q), f"{merge} {dtype}: param {i} left the uninterrupted run after the resume"
    assert oc.merged_steps == 4


for _world, _table in TABLES.items():
    for _merge, _opts in MERGES:
        for _dtype in (torch.float32, torch.bfloat16, torch.float16):
            _table.add(
                f"resume-{_merge}-{str(_dtype)[6:]}",
                lambda rank, world, m=_merge, o=_opts, d=_dtype: _resume_is_bit_exact(rank, world, m, o, d),
            )


def _consolidated_moves_between_world_sizes(rank, world, tmpdir, merge, opts):
    """Consolidate on `world` ranks, then: one process's MergeLoCo/IsoLoCo continues exactly as the sharded
    run does, and a smaller group (world − 1 ranks, a subgroup) re-shards it and continues the same way."""
    ps = _params()
    opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.8, merge=merge, merge_options=opts)
    _steps(opt, ps, rank, world, range(2))
    whole = opt.consolidated_state_dict()
    assert "sharding" not in whole and sorted(whole["state"]) == list(range(len(SHAPES)))
    start = [p.detach().clone() for p in ps]
    _steps(opt, ps, rank, world, range(2, 4))  # the reference: the sharded run goes on

    # one process: the same K = world deltas, from the consolidated state
    one_ps = [p.clone() for p in start]
    if merge == "iso_c":
        one = IsoLoCo(one_ps, lr=0.9, momentum=0.8)
    else:
        one = MergeLoCo(one_ps, lr=0.9, momentum=0.8, merge=merge, merge_options=opts)
    one.load_state_dict(copy.deepcopy(whole))  # torch's loaders take a state's tensors, not copies
    for s in range(2, 4):
        deltas = _grads(world, s)
        if merge == "iso_c":
            for p, d in zip(one_ps, deltas):
                p.grad = d.mean(0)
            one.step()
        else:
            one.step(deltas=deltas)
    for i, (p, q) in enumerate(zip(ps, one_ps)):
        err = float((p - q).norm() / q.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"{merge}: one process from the consolidated state: param {i} differs by {err:.1e}"

    # a group of world − 1 ranks takes the whole state and re-shards it: its own step continues the run
    sub = dist.new_group(list(range(world - 1)))
    if rank < world - 1:
        sub_ps = [p.clone() for p in start]
        sub_opt = ShardedIsoLoCo(sub_ps, lr=0.9, momentum=0.8, merge=merge, merge_options=opts, process_group=sub)
        sub_opt.load_state_dict(copy.deepcopy(whole))
        assert set(sub_opt.state_dict()["state"]) == set(sub_opt.mine)
        mean_opt = IsoLoCo([p.clone() for p in start], lr=0.9, momentum=0.8, iso=merge == "iso_c")
        if merge in ("iso_c", "mean"):  # the mean of the subgroup's deltas: IsoLoCo from the same whole state
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "mean" loads a group saved with iso=True (ShardedIsoLoCo's default)
                mean_opt.load_state_dict(copy.deepcopy(whole))
            mean_opt.param_groups[0]["iso"] = merge == "iso_c"
            for s in range(2, 4):
                gs = _grads(world, s)
                for p, d in zip(sub_ps, gs):
                    p.grad = d[rank].clone()
                sub_opt.step()
                for p, d in zip(mean_opt.param_groups[0]["params"], gs):
                    p.grad = d[: world - 1].mean(0)
                mean_opt.step()
            for i, (p, q) in enumerate(zip(sub_ps, mean_opt.param_groups[0]["params"])):
                err = float((p - q).norm() / q.norm().clamp_min(1e-30))
                assert err <= 1e-5, f"{merge}: re-sharded to {world - 1} ranks: param {i} differs by {err:.1e}"
    dist.barrier()


for _world, _table in TABLES.items():
    for _merge, _opts in MERGES:
        _table.add(
            f"consolidated-{_merge}",
            lambda rank, world, tmpdir, m=_merge, o=_opts: _consolidated_moves_between_world_sizes(
                rank, world, tmpdir, m, o
            ),
        )


def _check_a_ranks_own_state_is_refused_where_a_whole_one_is_expected(rank, world):
    ps = _params()
    opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.8)
    _steps(opt, ps, rank, world, range(1))
    with pytest.raises(ValueError, match="one rank's ShardedIsoLoCo state"):
        IsoLoCo(_params()).load_state_dict(opt.state_dict())
    other = (rank + 1) % world
    sd = opt.state_dict()
    sd["sharding"] = dict(sd["sharding"], rank=other)
    with pytest.raises(ValueError, match=f"saved by rank {other}"):
        ShardedIsoLoCo(_params(), lr=0.9, momentum=0.8).load_state_dict(sd)


def _check_iso_false_is_sgd_under_a_momentum_schedule(rank, world):
    """Through μ = 0 (set between steps, as a warm-up does): the mean of the ranks' grads through SGD."""
    ps = _params(torch.float64)
    ref = [torch.nn.Parameter(p.clone()) for p in ps]
    opt = ShardedIsoLoCo(ps, lr=0.7, momentum=0.9, iso=False)
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True, fused=True)
    for s, (lr, mu) in enumerate([(0.7, 0.9), (0.5, 0.0), (0.3, 0.0), (0.7, 0.5), (1.0, 0.9)]):
        for o in (opt, sgd):
            o.param_groups[0].update(lr=lr, momentum=mu)
        gs = _grads(world, s, torch.float64)
        for p, q, d in zip(ps, ref, gs):
            p.grad = d[rank].clone()
            q.grad = d.mean(0)
        opt.step()
        sgd.step()
        for i, (p, q) in enumerate(zip(ps, ref)):
            err = float((p - q).norm() / q.norm().clamp_min(1e-300))
            assert err <= 1e-14, f"step {s} (μ {mu}): param {i} differs from SGD by {err:.1e}"


def _check_a_param_shape_that_differs_is_named_with_both_shapes(rank, world):
    from isoloco_kernels import DistributedStepError

    shapes = [(6, 4), (5,)] if rank else [(6, 4), (7,)]
    with pytest.raises(
        DistributedStepError, match=r"param 1 \(shape, dtype\): '\(7,\) torch.float32' on rank 0, '\(5,\)"
    ):
        ShardedIsoLoCo([torch.zeros(s) for s in shapes])


def _check_a_copy_steps_as_the_original_once_given_its_group(rank, world):
    """deepcopy and a pickle round trip keep the plan, the merge, its step count and the momentum; a process group
    cannot be copied, so the copy refuses to step until it is given one, then steps exactly as the original."""
    import pickle

    for merge, how in (("iso_c", "deepcopy"), ("dare", "pickle")):
        ps = _params()
        opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.8, merge=merge)
        _steps(opt, ps, rank, world, range(1))
        if how == "deepcopy":
            ps2, opt2 = copy.deepcopy((ps, opt))
        else:
            ps2, opt2 = pickle.loads(pickle.dumps((ps, opt)))
        assert (opt2.merge, opt2.merged_steps, opt2.plan.fingerprint) == (merge, 1, opt.plan.fingerprint)
        with pytest.raises(RuntimeError, match="a process group cannot be copied"):
            opt2.step()
        opt2.process_group = opt.process_group
        _steps(opt, ps, rank, world, range(1, 3))
        _steps(opt2, ps2, rank, world, range(1, 3))
        assert all(torch.equal(p, q) for p, q in zip(ps, ps2)), f"{merge} {how}: the copy left the original"


for _table in TABLES.values():
    _table(_check_a_copy_steps_as_the_original_once_given_its_group)
    _table(_check_a_param_shape_that_differs_is_named_with_both_shapes)
    _table(_check_a_ranks_own_state_is_refused_where_a_whole_one_is_expected)
    _table(_check_iso_false_is_sgd_under_a_momentum_schedule)


def _body(rank, world, tmpdir):
    TABLES[world].run(tmpdir, rank, rank, world, tmpdir=tmpdir)


ranks = groups(_body, 2, 3, deadline_s=int(os.environ.get("ISOLOCO_SPAWN_DEADLINE_S", "600")))


@pytest.mark.parametrize("world,name", params(TABLES))
def test_contract_over_ranks(ranks, world, name):
    ranks[world].assert_ok(name)


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

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", _WORLD_ONE.format(root=root)], capture_output=True, text=True, timeout=300
    )
    assert "K1 OK" in out.stdout, out.stderr[-3000:]
