"""The sharded outer step on torch.distributed (gloo over 127.0.0.1, ranks spawned by tests/spawn.py).

Spawning is slow, so one group runs many checks, each reported as its own test. Every worker does
its own asserting (an AssertionError in any rank fails that check, with that rank's traceback);
the parent enforces a hard deadline, so a hang fails instead of blocking CI.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import IsoLoCo, ops
from isoloco_kernels import distributed as D
from isoloco_kernels.reference import iso_flatten_ref, isoloco_step_ref
from tests.helpers import TOL, rel_err
from tests.spawn import PG_TIMEOUT_S, Checks, finished, groups, record

pytestmark = [
    pytest.mark.slow,  # spawns gloo ranks
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
]


# ----------------------------------------------------------------------------------------------
# What every rank computes: the same global params, its own pseudo-gradients


def _model(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def _pseudo_grads(shapes, dtype, rank, step, scale=0.1):
    g = torch.Generator().manual_seed(1000 * step + rank + 1)
    return [(scale * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype) for s in shapes]


def _noncontig(t):
    """The same values in a transposed (non-contiguous) layout, for 2-D tensors."""
    return t.mT.contiguous().mT if t.ndim == 2 and min(t.shape) > 1 else t


def _single_process_steps(shapes, dtype, world, steps, lr, mu, iso_on=True, start=0, p0=None, b0=None):
    """The replicated outer step, one process, float64 reference: M = iso(mean Δ), Nesterov."""
    ps = [p.double() for p in (p0 if p0 is not None else _model(shapes, dtype))]
    bs = [b.double() for b in b0] if b0 is not None else [torch.zeros_like(p) for p in ps]
    for s in range(start, start + steps):
        gs = [_pseudo_grads(shapes, dtype, r, s) for r in range(world)]
        mean = [torch.stack([g[i].double() for g in gs]).mean(0) for i in range(len(shapes))]
        ps, bs = isoloco_step_ref(ps, bs, mean, lr, mu, iso=iso_on)
    return ps, bs


def _isoloco_steps(shapes, dtype, world, steps, lr, mu, iso_on=True):
    """The single-process IsoLoCo optimizer on the mean pseudo-gradient (what DiLoCo loops run)."""
    params = _model(shapes, dtype)
    opt = IsoLoCo(params, lr=lr, momentum=mu, iso=iso_on)
    for s in range(steps):
        gs = [_pseudo_grads(shapes, dtype, r, s) for r in range(world)]
        for i, p in enumerate(params):
            p.grad = torch.stack([g[i].double() for g in gs]).mean(0).to(dtype)
        opt.step()
    return params


def _assert_matches_isoloco(params, want, dtype, what):
    for i, (p, w) in enumerate(zip(params, want)):
        e = rel_err(p, w)
        assert e <= TOL[("update", dtype)], f"{what}: param {i} {tuple(p.shape)} differs from IsoLoCo by {e:.3g}"


def _run_sharded(params, shapes, dtype, rank, steps, opt, start=0):
    for s in range(start, start + steps):
        for p, g in zip(params, _pseudo_grads(shapes, dtype, rank, s)):
            p.grad = _noncontig(g)
        opt.step()


def _assert_close_to_ref(params, ref, dtype, what):
    for i, (p, r) in enumerate(zip(params, ref)):
        e = rel_err(p, r)
        assert e <= TOL[("exact", dtype)], f"{what}: param {i} {tuple(p.shape)} rel err {e:.3g}"


def _assert_same_everywhere(tensors, what, group=None):
    """Every rank of the group holds bit-identical tensors."""
    src = 0 if group is None else dist.get_global_rank(group, 0)
    for i, t in enumerate(tensors):
        ref = t.detach().clone()
        dist.broadcast(ref, src=src, group=group)
        assert torch.equal(ref, t), f"{what}: tensor {i} differs between ranks {src} and {dist.get_rank()}"


# ----------------------------------------------------------------------------------------------
# 2 ranks (a subgroup: also checks that group= is honoured)

SHAPES_2 = [(12, 5), (7,), (5, 9), (1, 6), (6, 1), (16, 16), (3,), (9, 4)]


# Each check below runs on a 2-rank subgroup (ranks 0, 1 and ranks 2, 3 at once) inside one spawned
# group of 4 processes and is reported as its own test result (test_pair_check[name]).
LR, MU = 1.8, 0.8
PAIR_CHECKS = Checks()
_pair_check = PAIR_CHECKS


@_pair_check
def _check_sharded_matches_isoloco(group, tmpdir):
    rank, world, lr, mu = dist.get_rank(group), 2, LR, MU
    # several steps, fp32 and fp64, multi-chunk communication (tiny buckets), solo tensors on and off
    cases = (
        (torch.float32, 64, 1.0),
        (torch.float64, 1 << 20, None),
        (torch.float32, 1 << 20, 0.2),
        (torch.bfloat16, 1 << 20, 1.0),
    )
    for dtype, bucket, rep in cases:
        params = _model(SHAPES_2, dtype)
        opt = D.ShardedIsoLoCo(params, lr=lr, momentum=mu, process_group=group, chunk_bytes=bucket, solo_above=rep)
        if rep == 0.2:
            assert opt.plan.solo, "solo_above=0.2 must send the largest tensors solo"
        _run_sharded(params, SHAPES_2, dtype, rank, 3, opt)
        ref_p, _ = _single_process_steps(SHAPES_2, dtype, world, 3, lr, mu)
        _assert_close_to_ref(params, ref_p, dtype, f"{dtype} bucket {bucket} solo_above {rep}")
        _assert_matches_isoloco(params, _isoloco_steps(SHAPES_2, dtype, world, 3, lr, mu), dtype, f"{dtype}")
        _assert_same_everywhere(params, f"{dtype} params", group)
        owned = set(opt.plan.owned(rank))
        held = {i for i, p in enumerate(opt._params) if "momentum_buffer" in opt.state[p]}
        assert held == owned, f"rank {rank} holds momentum for {sorted(held)}, owns {sorted(owned)}"


@_pair_check
def _check_iso_off(group, tmpdir):
    rank, world = dist.get_rank(group), 2
    # iso off: plain Nesterov SGD on the averaged pseudo-gradients
    params = _model(SHAPES_2, torch.float64)
    opt = D.ShardedIsoLoCo(params, lr=0.7, momentum=0.9, iso=False, process_group=group)
    _run_sharded(params, SHAPES_2, torch.float64, rank, 2, opt)
    ref_p, _ = _single_process_steps(SHAPES_2, torch.float64, world, 2, 0.7, 0.9, iso_on=False)
    _assert_close_to_ref(params, ref_p, torch.float64, "iso off")
    want = _isoloco_steps(SHAPES_2, torch.float64, world, 2, 0.7, 0.9, iso_on=False)
    _assert_matches_isoloco(params, want, torch.float64, "iso off")


@_pair_check
def _check_sharded_chunk_bytes_set_later(group, tmpdir):
    """chunk_bytes set on every rank after construction: the step that first sees it still runs on the chunks
    the exchange was built with (the same collectives on every rank before the vote compares it), and every
    step after on the new ones; the params are bit for bit those of an optimizer built with it (sums of two
    ranks are exact in any chunking)."""
    rank = dist.get_rank(group)
    a, b = _model(SHAPES_2, torch.float32), _model(SHAPES_2, torch.float32)
    opt_a = D.ShardedIsoLoCo(a, lr=LR, momentum=MU, process_group=group)
    opt_b = D.ShardedIsoLoCo(b, lr=LR, momentum=MU, process_group=group, chunk_bytes=96)
    opt_a.chunk_bytes = 96
    built = opt_a._exchange
    _run_sharded(a, SHAPES_2, torch.float32, rank, 1, opt_a)
    assert opt_a._exchange is not built and opt_a._exchange.chunk_bytes == 96
    _run_sharded(a, SHAPES_2, torch.float32, rank, 2, opt_a, start=1)
    _run_sharded(b, SHAPES_2, torch.float32, rank, 3, opt_b)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@_pair_check
def _check_process_group_splits_the_flatten(group, tmpdir):
    world, lr, mu = 2, LR, MU
    # IsoLoCo(process_group=...): grads already averaged on every rank, flatten work split
    calls = []
    real_sharded = D.sharded_iso_merge_
    D.sharded_iso_merge_ = lambda *a, **k: (calls.append(a[1]), real_sharded(*a, **k))[1]
    for dtype in (torch.float32, torch.float64):
        params = _model(SHAPES_2, dtype)
        opt = IsoLoCo(params, lr=lr, momentum=mu, process_group=group)
        for s in range(2):
            gs = [_pseudo_grads(SHAPES_2, dtype, r, s) for r in range(world)]
            for i, p in enumerate(params):
                p.grad = torch.stack([g[i].double() for g in gs]).mean(0).to(dtype)
            opt.step()
        want = _isoloco_steps(SHAPES_2, dtype, world, 2, lr, mu)
        for i, (p, w) in enumerate(zip(params, want)):
            assert torch.equal(p, w), f"IsoLoCo(process_group) {dtype}: param {i} differs from IsoLoCo"
        _assert_same_everywhere(params, f"IsoLoCo(process_group) {dtype} params", group)
    D.sharded_iso_merge_ = real_sharded
    assert calls == [group] * 4, "IsoLoCo(process_group=...) must split the flatten over the group"


@_pair_check
def _check_process_group_refuses_grads_not_yet_averaged(group, tmpdir):
    """IsoLoCo(process_group=...) expects grads already averaged: each rank's own pseudo-gradient
    (different on each rank) raises DistributedStepError on every rank naming the fix, nothing
    changed; the same grads averaged step; ShardedIsoLoCo takes the not-yet-averaged ones."""
    rank, world = dist.get_rank(group), 2
    params = _model(SHAPES_2, torch.float32)
    before = [p.clone() for p in params]
    opt = IsoLoCo(params, lr=LR, momentum=MU, process_group=group)
    own = _pseudo_grads(SHAPES_2, torch.float32, rank, 0)
    for p, g in zip(params, own):
        p.grad = g.clone()
    with pytest.raises(
        D.DistributedStepError,
        match=r"the ranks' grads differ, nothing was changed.* is the first that differs.*ALREADY AVERAGED.*ShardedIsoLoCo",
    ):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and not opt.state, "changed on refusal"
    D.average_([p.grad for p in params], process_group=group)
    opt.step()  # now bit-identical on every rank
    want = _isoloco_steps(SHAPES_2, torch.float32, world, 1, LR, MU)
    assert all(rel_err(p, w) <= 1e-6 for p, w in zip(params, want)), "averaged grads: not IsoLoCo's step"
    sharded_params = [b.clone() for b in before]
    sharded = D.ShardedIsoLoCo(sharded_params, lr=LR, momentum=MU, process_group=group)
    for p, g in zip(sharded_params, own):
        p.grad = g.clone()
    sharded.step()
    assert all(rel_err(p, w) <= 1e-5 for p, w in zip(sharded_params, want)), "ShardedIsoLoCo on own grads"
    _averaged_boundary(rank, group)


def _averaged_boundary(rank, group):
    """The averaged-grads check decides bit identity, on both sides of the boundary: equal grads
    pass; one element one ulp off, noise of 1e-6 and 1e-3 of the mean magnitude, a permutation
    (same norm, same sum), -0.0 for 0.0, in float32, bfloat16 and float64 and near float32's
    largest value, are refused on every rank naming the first grad that differs and who holds what."""
    from isoloco_kernels.distributed.process_group import check_averaged

    def second(base, how):  # rank 1's grad (computed on every rank alike: same seeds)
        if how == "equal":
            return base.clone()
        if how == "last-bit":
            out = base.clone()
            out[3] = torch.nextafter(out[3], torch.tensor(float("inf"), dtype=out.dtype))
            return out
        if how == "permuted":
            return base[torch.randperm(base.numel(), generator=torch.Generator().manual_seed(1))]
        if how == "signed-zero":
            out = base.clone()
            out[0] = -0.0
            return out
        noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        return (base.double() + float(how) * base.double().abs().mean() * noise).to(base.dtype)

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        base = torch.randn(4096, generator=gen, dtype=torch.float64).to(dtype)
        base[0] = 0.0
        for how in ("equal", "last-bit", "1e-6", "1e-3", "permuted", "signed-zero"):
            other = second(base, how)
            g = other if rank == 1 else base.clone()
            name = f"{dtype} {how}"
            same = torch.equal(other, base) and not (how == "signed-zero")
            assert same == (how == "equal") or (how == "1e-6" and dtype == torch.bfloat16), name
            if same:  # bfloat16 does not resolve 1e-6 of the mean: the same grad
                check_averaged([base.clone(), g], ["other", name], group)
                continue
            with pytest.raises(
                D.DistributedStepError,
                match=rf"grads differ.*: {re.escape(name)} is the first that differs \(rank 0 holds one version, rank 1 holds another\)\. ",
            ):
                check_averaged([base.clone(), g], ["other", name], group)
    huge = torch.full((8, 8), 3e38)  # near float32's largest value: nothing to overflow in a fingerprint
    check_averaged([huge.clone()], ["huge float32"], group)
    if rank:
        huge[0, 0] = torch.nextafter(huge[0, 0], torch.tensor(float("inf")))
    with pytest.raises(D.DistributedStepError, match="huge float32 is the first that differs.*ALREADY AVERAGED"):
        check_averaged([huge], ["huge float32"], group)


@_pair_check
def _check_replicated_optimizer_refuses_per_rank_momentum(group, tmpdir):
    """Each rank's ShardedIsoLoCo.state_dict() holds only its own momentum; loaded into the
    replicated IsoLoCo(process_group=...) on every rank, the next step is refused on every rank
    naming a param whose momentum differs, nothing changed (and again until fixed); the same state
    on every rank (a whole-model IsoLoCo state, loaded everywhere) steps, and the check runs
    once per load, not per step."""
    from isoloco_kernels.distributed import process_group as PG

    rank = dist.get_rank(group)
    params = _model(SHAPES_2, torch.float32)
    sharded = D.ShardedIsoLoCo(params, lr=LR, momentum=MU, process_group=group)
    _run_sharded(params, SHAPES_2, torch.float32, rank, 1, sharded)
    per_rank = sharded.state_dict()
    opt = IsoLoCo(params, lr=LR, momentum=MU, process_group=group)
    with pytest.raises(ValueError, match="one rank's ShardedIsoLoCo state"):  # refused at load, by its "sharding" entry
        opt.load_state_dict(per_rank)
    # stripped of that entry, the momentum itself still differs between ranks: the next step refuses it
    opt.load_state_dict({k: v for k, v in per_rank.items() if k not in ("sharding", "merge")})
    grads = _pseudo_grads(SHAPES_2, torch.float32, 0, 5)  # equal on every rank: already averaged
    for p, g in zip(params, grads):
        p.grad = g.clone()
    before = [p.clone() for p in params] + [opt.state[p]["momentum_buffer"].clone() for p in params if p in opt.state]
    for _ in range(2):
        with pytest.raises(
            D.DistributedStepError,
            match=r"the ranks' momentum buffers differ.* momentum_buffer is the first that differs.*replicated",
        ):
            opt.step()
        after = [p for p in params] + [opt.state[p]["momentum_buffer"] for p in params if p in opt.state]
        assert all(torch.equal(a, b) for a, b in zip(after, before)), "changed although refused"
    whole = IsoLoCo(_model(SHAPES_2, torch.float32), lr=LR, momentum=MU)
    for p, g in zip(whole.param_groups[0]["params"], grads):
        p.grad = g.clone()
    whole.step()
    opt.load_state_dict(whole.state_dict())
    calls = []
    real = PG.momentum_bits
    PG.momentum_bits = lambda o: (calls.append(1), real(o))[1]
    try:
        for _ in range(2):
            opt.step()
    finally:
        PG.momentum_bits = real
    assert calls == [1], f"the momentum was compared {len(calls)} times over two steps after one load"
    _assert_same_everywhere(params, "params after the replicated load", group)


@_pair_check
def _check_sharded_takes_sgd_keywords(group, tmpdir):
    """ShardedIsoLoCo takes torch.optim.SGD's keywords in SGD's positions, as IsoLoCo does: the
    values meaning IsoLoCo's update are accepted (a partial written for SGD works), the others are
    refused with IsoLoCo's message, on every rank."""
    from functools import partial

    params = _model(SHAPES_2, torch.float32)
    opt = partial(D.ShardedIsoLoCo, lr=0.7, momentum=0.9, nesterov=True, foreach=True)(params, process_group=group)
    assert opt.param_groups[0]["nesterov"] is True and opt.param_groups[0]["foreach"] is True
    positional = D.ShardedIsoLoCo(params, 0.7, 0.9, 0, 0, True, process_group=group)
    assert positional.defaults == opt.defaults | {"foreach": None}
    for bad, match in (
        ({"nesterov": False}, "nesterov=False"),
        ({"weight_decay": 0.1}, "weight_decay=0.1"),
        ({"maximize": True}, "maximize=True"),
    ):
        with pytest.raises(ValueError, match=match):
            D.ShardedIsoLoCo(params, process_group=group, **bad)
    with pytest.raises(ValueError, match="ShardedIsoLoCo: param group 1: dampening"):
        D.ShardedIsoLoCo([{"params": params[:1]}, {"params": params[1:], "dampening": 0.5}], process_group=group)


@_pair_check
def _check_state_dict_resume(group, tmpdir):
    rank, world, lr, mu = dist.get_rank(group), 2, LR, MU
    # state_dict save, fresh optimizer, load, resume: same trajectory as running straight through
    dtype = torch.float64
    params = _model(SHAPES_2, dtype)
    opt = D.ShardedIsoLoCo(params, lr=lr, momentum=mu, process_group=group)
    _run_sharded(params, SHAPES_2, dtype, rank, 2, opt)
    sd = opt.state_dict()
    path = os.path.join(tmpdir, f"opt{dist.get_rank()}.pt")
    torch.save(sd, path)
    saved_p = [p.clone() for p in params]
    params2 = [p.clone() for p in saved_p]
    opt2 = D.ShardedIsoLoCo(params2, lr=lr, momentum=mu, process_group=group)
    opt2.load_state_dict(torch.load(path))
    _run_sharded(params2, SHAPES_2, dtype, rank, 2, opt2, start=2)
    _run_sharded(params, SHAPES_2, dtype, rank, 2, opt, start=2)
    for i, (a, b) in enumerate(zip(params, params2)):
        assert torch.equal(a, b), f"resumed trajectory differs at param {i}"
    ref_p, _ = _single_process_steps(SHAPES_2, dtype, world, 4, lr, mu)
    _assert_close_to_ref(params2, ref_p, dtype, "resumed")
    # the other rank's state, or a different plan, is refused with a clear error
    dist.barrier(group=group)
    other = torch.load(os.path.join(tmpdir, f"opt{dist.get_global_rank(group, 1 - rank)}.pt"))
    with pytest.raises(ValueError, match=f"saved by rank {1 - rank}"):
        opt2.load_state_dict(other)
    wrong = D.ShardedIsoLoCo(_model(SHAPES_2[:-1], dtype), lr=lr, momentum=mu, process_group=group)
    with pytest.raises(ValueError, match="different shard plan"):
        wrong.load_state_dict(sd)
    dist.barrier(group=group)


@_pair_check
def _check_failure_on_one_rank_changes_nothing(group, tmpdir):
    rank, lr, mu = dist.get_rank(group), LR, MU
    # NaN in one rank's pseudo-gradients: every rank raises, nothing changes anywhere
    params = _model(SHAPES_2, torch.float32)
    opt = D.ShardedIsoLoCo(params, lr=lr, momentum=mu, process_group=group)
    _run_sharded(params, SHAPES_2, torch.float32, rank, 1, opt)
    before_p = [p.clone() for p in params]
    before_b = {i: opt.state[p]["momentum_buffer"].clone() for i, p in enumerate(params) if opt.state[p]}
    for p, g in zip(params, _pseudo_grads(SHAPES_2, torch.float32, rank, 1)):
        p.grad = g
    if rank == 1:
        params[2].grad[1, 3] = float("nan")
    t0 = time.monotonic()
    with pytest.raises(D.DistributedStepError, match=r"rank 1: .*param 2.*NaN"):
        opt.step()
    assert time.monotonic() - t0 < PG_TIMEOUT_S
    _assert_unchanged(opt, params, before_p, before_b)
    # a missing grad on one rank is bad input too
    saved = params[4].grad
    if rank == 0:
        params[4].grad = None
    with pytest.raises(D.DistributedStepError, match=r"rank 0: ValueError: param 4 .* has no grad"):
        opt.step()
    params[4].grad = saved
    _assert_unchanged(opt, params, before_p, before_b)
    # a flatten that fails on one rank (not bad input): same all-or-nothing behaviour
    for p, g in zip(params, _pseudo_grads(SHAPES_2, torch.float32, rank, 1)):
        p.grad = g
    real = ops.flatten_chunked_  # the flatten behind the isoloco::iso_merge_ op, which the step runs
    if rank == 0:

        def broken(x, method, workspace=None):
            real(x, method, workspace)  # scribbles on the scratch copies first
            raise RuntimeError("injected flatten failure")

        ops.flatten_chunked_ = broken
    with pytest.raises(D.DistributedStepError, match="rank 0: RuntimeError: injected flatten failure"):
        opt.step()
    ops.flatten_chunked_ = real
    _assert_unchanged(opt, params, before_p, before_b)
    # and the optimizer still works afterwards
    opt.step()
    assert not torch.equal(params[0], before_p[0])


@_pair_check
def _check_sharded_iso_merge_equals_iso_merge(group, tmpdir):
    rank = dist.get_rank(group)
    # pre-averaged grads: sharded_iso_merge_ equals iso_merge_, odd shapes, batched, non-contiguous
    g = torch.Generator().manual_seed(7)
    bk = [
        torch.randn(12, 5, generator=g),
        torch.randn(3, 4, 6, generator=g, dtype=torch.float64),
        torch.randn(9, 7, generator=g).mT,
        torch.randn(1, 8, generator=g),
        torch.randn(8, 1, generator=g),
        torch.randn(5, 5, generator=g).to(torch.bfloat16),
    ]
    for rep, bucket in ((1.0, 1 << 20), (None, 48)):
        got = [b.clone() if b.is_contiguous() else b.clone().mT.contiguous().mT for b in bk]
        D.sharded_iso_merge_(got, group, method="svd", solo_above=rep, chunk_bytes=bucket)
        want = isoloco_kernels.iso_merge_([b.clone() for b in bk], method="svd")
        for i, (a, b) in enumerate(zip(got, want)):
            e = rel_err(a, b)
            assert e <= TOL[("exact", b.dtype)], f"sharded_iso_merge_ bucket {i}: rel err {e:.3g} vs iso_merge_"
            assert rel_err(a, iso_flatten_ref(bk[i])) <= TOL[("exact", b.dtype)]
        _assert_same_everywhere(got, "sharded_iso_merge_", group)
    # its bad input (NaN on one rank only) fails everywhere and writes nothing
    got = [b.clone() for b in bk]
    if rank == 0:
        got[3][0, 2] = float("inf")
    snap = [b.clone() for b in got]
    with pytest.raises(D.DistributedStepError, match=r"rank 0: ValueError: bucket 3: .*Inf"):
        D.sharded_iso_merge_(got, group)
    for i, (a, b) in enumerate(zip(got, snap)):
        assert torch.equal(a, b), f"bucket {i} changed although the merge failed"


@_pair_check
def _check_old_keyword_names_are_refused(group, tmpdir):
    """`group=` and `bucket_bytes=`, names of an unreleased 0.1, are refused by Python itself on every distributed
    entry point (ShardedIsoLoCo, sharded_iso_merge_, average_), before any collective and with nothing changed."""
    params = _model(SHAPES_2, torch.float32)
    for kw in ({"group": group}, {"process_group": group, "bucket_bytes": 640}):
        bad = next(k for k in kw if k != "process_group")
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{bad}'"):
            D.ShardedIsoLoCo(params, **kw)
    bk = [torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(1)), torch.randn(9, 4)]
    before = [b.clone() for b in bk]
    for fn in (D.sharded_iso_merge_, D.average_):
        for kw in ({"group": group}, {"bucket_bytes": 64}):
            with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(kw))}'"):
                fn(bk, **kw)
    assert all(torch.equal(a, b) for a, b in zip(bk, before))


@_pair_check
def _check_average_is_the_mean(group, tmpdir):
    rank, world = dist.get_rank(group), 2
    # average_: mean over ranks, in place, multi-bucket, non-contiguous, mixed dtypes
    xs = [_noncontig(t) for t in _pseudo_grads([(5, 3), (11,), (4, 4)], torch.float32, rank, 9)]
    xs.append(_pseudo_grads([(6,)], torch.float64, rank, 9)[0])
    all_x = [
        [_noncontig(t) for t in _pseudo_grads([(5, 3), (11,), (4, 4)], torch.float32, r, 9)]
        + [_pseudo_grads([(6,)], torch.float64, r, 9)[0]]
        for r in range(world)
    ]
    D.average_(xs, group, chunk_bytes=24)
    for i, x in enumerate(xs):
        want = torch.stack([a[i].double() for a in all_x]).mean(0)
        assert rel_err(x, want) <= TOL[("update", x.dtype)], f"average_ tensor {i}"


def _assert_unchanged(opt, params, before_p, before_b):
    for i, (p, b) in enumerate(zip(params, before_p)):
        assert torch.equal(p, b), f"param {i} changed although the step failed"
    for i, b in before_b.items():
        assert torch.equal(opt.state[params[i]]["momentum_buffer"], b), f"momentum {i} changed"


# ----------------------------------------------------------------------------------------------
# 4 ranks: fewer matrices than ranks, uneven counts, and a rank that vanishes

SHAPES_4 = [(6, 10), (10,), (8, 3)]


FOUR_RANK_CHECKS = Checks()
_four_rank_check = FOUR_RANK_CHECKS


@_four_rank_check
def _check_uneven_plan_matches_isoloco(rank, world, tmpdir):
    """Fewer matrices than ranks (one rank owns nothing), solo tensors off and on."""
    lr, mu = 1.8, 0.8
    for rep in (None, 1.0):
        params = _model(SHAPES_4, torch.float64)
        opt = D.ShardedIsoLoCo(params, lr=lr, momentum=mu, solo_above=rep, chunk_bytes=640)
        if rep is None:
            assert len(set(opt.plan.owners)) == 3 and not opt.plan.owned(3), opt.plan.owners
        _run_sharded(params, SHAPES_4, torch.float64, rank, 3, opt)
        ref_p, _ = _single_process_steps(SHAPES_4, torch.float64, world, 3, lr, mu)
        _assert_close_to_ref(params, ref_p, torch.float64, f"4 ranks, solo_above {rep}")
        want = _isoloco_steps(SHAPES_4, torch.float64, world, 3, lr, mu)
        _assert_matches_isoloco(params, want, torch.float64, "4 ranks")
        _assert_same_everywhere(params, "4 ranks")


@_four_rank_check
def _check_merge_three_matrices(rank, world, tmpdir):
    """3 matrices on 4 ranks through sharded_iso_merge_."""
    g = torch.Generator().manual_seed(3)
    bk = [torch.randn(7, 4, generator=g), torch.randn(4, 7, generator=g), torch.randn(2, 3, 3, generator=g)]
    got = D.sharded_iso_merge_([b.clone() for b in bk], solo_above=None)
    for i, (a, b) in enumerate(zip(got, bk)):
        assert rel_err(a, iso_flatten_ref(b)) <= TOL[("exact", torch.float32)], f"bucket {i}"


@_four_rank_check
def _check_different_shapes_are_refused(rank, world, tmpdir):
    """Ranks passing different shapes are told so, instead of exchanging garbage."""
    mine = [torch.randn(4, 4)] if rank != 2 else [torch.randn(4, 5)]
    with pytest.raises(D.DistributedStepError, match=r"shard plan .*rank 2\b"):
        D.sharded_iso_merge_(mine)


def _four_dead_rank(rank, world, tmpdir):
    """A rank that dies before the step: the others fail within the process group timeout (last:
    the group is broken afterwards)."""
    lr, mu = 1.8, 0.8
    params = _model(SHAPES_4, torch.float32)
    opt = D.ShardedIsoLoCo(params, lr=lr, momentum=mu)
    for p, gr in zip(params, _pseudo_grads(SHAPES_4, torch.float32, rank, 0)):
        p.grad = gr
    if rank == 3:
        record(tmpdir, 3, "dead_rank", lambda: None)
        finished(tmpdir, 3)
        os._exit(0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        opt.step()
    assert time.monotonic() - t0 < PG_TIMEOUT_S + 10


def _single_checks(group):
    """A group of one: the sharded step is IsoLoCo's on this rank's own pseudo-gradients."""
    params = _model(SHAPES_2, torch.float32)
    opt = D.ShardedIsoLoCo(params, process_group=group)
    _run_sharded(params, SHAPES_2, torch.float32, 0, 2, opt)
    _assert_matches_isoloco(params, _isoloco_steps(SHAPES_2, torch.float32, 1, 2, 1.8, 0.8), torch.float32, "1 rank")
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)


def _body(rank, world, tmpdir):
    singles = [dist.new_group([r]) for r in range(world)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    record(tmpdir, rank, "single_rank_group", _single_checks, singles[rank])
    dist.barrier()
    PAIR_CHECKS.run(tmpdir, rank, pairs[rank // 2], tmpdir)
    FOUR_RANK_CHECKS.run(tmpdir, rank, rank, world, tmpdir)
    record(tmpdir, rank, "dead_rank", _four_dead_rank, rank, world, tmpdir)


gloo_group_of_four = groups(_body, 4)  # one spawned group of 4 processes runs every check below


@pytest.mark.parametrize("name", ["single_rank_group", *PAIR_CHECKS])
def test_pair_check(gloo_group_of_four, name):
    """ShardedIsoLoCo, IsoLoCo(process_group=...), sharded_iso_merge_ and average_ on 2-rank groups."""
    gloo_group_of_four[4].assert_ok(name)


@pytest.mark.parametrize("name", [*FOUR_RANK_CHECKS, "dead_rank"])
def test_four_rank_check(gloo_group_of_four, name):
    """All 4 ranks: uneven plans, sharded_iso_merge_, mismatched shapes, a rank that vanishes."""
    gloo_group_of_four[4].assert_ok(name)


# ----------------------------------------------------------------------------------------------
# Plans (no processes needed)


def test_plan_is_deterministic_and_balanced():
    shapes = [(64, 32), (32,), (128, 64), (64, 64), (32, 128), (7,)]
    a = D.plan_shards(shapes, 3)
    b = D.plan_shards(list(reversed(list(reversed(shapes)))), 3)
    assert a == b and a.fingerprint == b.fingerprint
    # largest first: (128, 64) and (32, 128) land on different ranks
    assert a.owners[2] != a.owners[4]
    loads = a.loads()
    assert max(loads) <= sum(loads) / 3 + max(a.costs), loads
    assert D.plan_shards(shapes, 4).fingerprint != a.fingerprint
    assert D.plan_shards(shapes, 3, dtypes=[torch.bfloat16] * 6).fingerprint != a.fingerprint


def test_plan_sends_oversized_tensors_solo():
    shapes = [(1000, 64), (64, 64), (64, 64), (64, 64), (64,)]
    p = D.plan_shards(shapes, 4)
    assert p.solo == {0}
    w = p.wire_elements()
    # the 1-D tensor joins a 64×64 owner's segment: 4 ranks × (64·64 + 64) padded elements
    assert w["solo"] == 64000 and w["segments"] == 4 * (64 * 64 + 64)
    padded = D.plan_shards(shapes, 4, solo_above=None)
    assert padded.owners == p.owners  # solo changes how a tensor travels, not who owns it
    assert padded.wire_elements()["segments"] == 4 * 64000 and padded.wire_elements()["solo"] == 0


def test_plan_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        D.plan_shards([(2, 2)], 0)


# ----------------------------------------------------------------------------------------------
# 2 ranks: a failure on one rank fails every rank, quickly, with nothing changed anywhere


def _fails_everywhere(fn, match, tensors, what):
    """fn() must raise DistributedStepError (matching `match`) on this rank within a few seconds,
    leaving `tensors` bit-identical."""
    before = [t.detach().clone() for t in tensors]
    t0 = time.monotonic()
    with pytest.raises(D.DistributedStepError, match=match):
        fn()
    assert time.monotonic() - t0 < PG_TIMEOUT_S / 2, f"{what}: took {time.monotonic() - t0:.1f} s"
    for a, b in zip(tensors, before):  # NaN compares equal to NaN here
        assert torch.equal(a.detach().nan_to_num(nan=7.0), b.nan_to_num(nan=7.0)), f"{what}: a tensor changed"


# Each check runs on every rank of a 2-rank group (the half-precision means below on 2 and 3).
SMALL_CHECKS = Checks()
_small_check = SMALL_CHECKS
REL_SHAPES = [(6, 10), (10, 6), (10,)]


@_small_check
def _check_isoloco_nan_or_closure_on_one_rank(rank, world):
    """IsoLoCo(process_group) with a NaN grad on rank 1 only, then a closure that raises there."""
    g = torch.Generator().manual_seed(77)
    params = [torch.randn(s, generator=g) for s in REL_SHAPES]
    opt = IsoLoCo(params, lr=0.5, momentum=0.9, process_group=dist.group.WORLD)
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(5)) for s in REL_SHAPES]
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    if rank == 1:
        params[1].grad[2, 3] = float("nan")
    _fails_everywhere(opt.step, r"failed on 1 of 2 ranks.*rank 1.*NaN", params, "IsoLoCo NaN on rank 1")
    assert not any(opt.state.values())
    params[1].grad = grads[1].clone()
    opt.step()  # the group is still usable, and the step now runs
    assert all(torch.isfinite(p).all() for p in params) and len(opt.state) == 3
    assert all(torch.equal(p.grad, gr) for p, gr in zip(params, grads))

    def closure1():
        if rank == 1:
            raise RuntimeError("no loss here")
        return 0.0

    _fails_everywhere(lambda: opt.step(closure1), r"rank 1: RuntimeError: no loss here", params, "IsoLoCo closure")


@_small_check
def _check_sharded_closure_on_one_rank(rank, world):
    """ShardedIsoLoCo: a closure that raises on rank 0 only."""
    params = _model(SHAPES_2, torch.float32)
    opt = D.ShardedIsoLoCo(params, lr=0.5, momentum=0.9)
    for p, gr in zip(params, _pseudo_grads(SHAPES_2, torch.float32, rank, 0)):
        p.grad = gr

    def closure():
        if rank == 0:
            raise RuntimeError("loss went away")
        return 1.0

    _fails_everywhere(lambda: opt.step(closure), r"rank 0: RuntimeError: loss went away", params, "closure")
    assert not any(opt.state.values())


@_small_check
def _check_sharded_huge_or_overflowing_grads(rank, world):
    """ShardedIsoLoCo: huge pseudo-gradients give the right finite step (Iso-C is homogeneous);
    one whose update overflows float32 is refused on both ranks, nothing changed."""
    params = _model(SHAPES_2, torch.float32)
    before = [p.detach().clone() for p in params]
    opt = D.ShardedIsoLoCo(params, lr=1.8, momentum=0.8)
    grads = [gr * 1e37 for gr in _pseudo_grads(SHAPES_2, torch.float32, 0, 0)]
    for p, gr in zip(params, grads):
        p.grad = gr.clone()
    opt.step()
    ref_p, _ = isoloco_step_ref(before, [torch.zeros_like(p) for p in before], grads, 1.8, 0.8)
    for p, r in zip(params, ref_p):
        # float64 svd/eigh, then the float32 update (IsoLoCo's step: measured ≤ 5e-8)
        assert torch.isfinite(p).all() and rel_err(p, r) <= TOL[("update", torch.float32)]
    params = _model(SHAPES_2, torch.float32)
    opt = D.ShardedIsoLoCo(params, lr=1.8, momentum=0.8)
    for p in params:
        p.grad = torch.full_like(p, 3e38)
    _fails_everywhere(opt.step, r"overflow|not finite|NaN|Inf", params, "overflowing update")


@_small_check
def _check_merge_expanded_bucket_on_one_rank(rank, world):
    """sharded_iso_merge_ with an expanded (self-overlapping) bucket on rank 1 only."""
    a = torch.randn(4, 6, generator=torch.Generator().manual_seed(8))
    b = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(9))
    if rank == 1:
        b = torch.randn(1, 4, 6).expand(2, 4, 6)
    _fails_everywhere(lambda: D.sharded_iso_merge_([a, b]), r"rank 1.*bucket 1.*overlap", [a, b], "expanded bucket")


@_small_check
def _check_average_refusals(rank, world):
    """average_: different element counts (gloo would abort the process), then same count but
    different shapes (would be averaged silently), overlap, NaN, an integer tensor."""
    x = torch.full((6,), float(rank))
    y = torch.ones(5 if rank == 0 else 7)
    _fails_everywhere(lambda: D.average_([x, y]), "different tensors", [x, y], "average_ counts")
    z = torch.ones((2, 3) if rank == 0 else (3, 2))
    _fails_everywhere(lambda: D.average_([x, z]), "different tensors", [x, z], "average_ shapes")
    w = torch.ones(3).expand(2, 3) if rank == 1 else torch.ones(2, 3)
    _fails_everywhere(lambda: D.average_([x, w]), r"rank 1.*tensor 1.*overlap", [x, w], "average_ expanded")
    v = torch.ones(4)
    if rank == 0:
        v[1] = float("nan")
    _fails_everywhere(lambda: D.average_([x, v]), r"rank 0.*tensor 1.*NaN", [x, v], "average_ NaN")
    n = torch.ones(4, dtype=torch.int64)
    _fails_everywhere(lambda: D.average_([x, n]), r"tensor 1 has dtype torch.int64", [x, n], "average_ int")
    D.average_([x])  # still usable
    assert torch.equal(x, torch.full((6,), 0.5))


RELIABILITY = list(SMALL_CHECKS)


# ----------------------------------------------------------------------------------------------
# Half-precision means: summed in float32, rounded once


def _half_grads(shapes, dtype, rank, world, step=0):
    """Every rank's grads in `dtype`. float16: entries near 40000 (the sum of two overflows
    float16, the mean fits); bfloat16: magnitudes in [0.5, 2) (a float32 sum of a few is exact,
    so the float32 mean rounded once is one well-defined value)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(100 * step + 10 * r + 1)
        if dtype == torch.float16:
            out.append([(40000 + 20000 * torch.rand(s, generator=g)).to(dtype) for s in shapes])
        else:
            out.append(
                [
                    ((0.5 + 1.5 * torch.rand(s, generator=g)) * (torch.randint(0, 2, s, generator=g) * 2 - 1)).to(dtype)
                    for s in shapes
                ]
            )
    return out


def _mean_rounded_once(grads, i, dtype):
    return (sum(g[i].float() for g in grads) / len(grads)).to(dtype)


def _half_average(rank, world, dtype):
    """average_: several chunks, a non-contiguous tensor."""
    shapes = HALF_SHAPES
    grads = _half_grads(shapes, dtype, rank, world)
    xs = [_noncontig(g.clone()) for g in grads[rank]]
    D.average_(xs, chunk_bytes=40)
    for i, x in enumerate(xs):
        want = _mean_rounded_once(grads, i, dtype)
        assert x.dtype == dtype and torch.equal(x, want), (
            f"average_ {dtype}, {world} ranks: tensor {i} is not the float32 mean rounded once "
            f"({int((x != want).sum())} of {x.numel()} elements differ, max {float(x.float().abs().max()):.6g})"
        )


def _half_sharded(rank, world, dtype):
    """ShardedIsoLoCo: the reduce-scatter (segments) and the reduce to an owner (solo tensors);
    iso off, so the first step's momentum buffer is the mean pseudo-gradient itself."""
    shapes = HALF_SHAPES
    grads = _half_grads(shapes, dtype, rank, world)
    for solo in (None, 0.2):
        params = [torch.zeros(s, dtype=dtype) for s in shapes]
        opt = D.ShardedIsoLoCo(params, lr=1e-6, momentum=0.5, iso=False, chunk_bytes=64, solo_above=solo)
        assert solo is None or opt.plan.solo
        for p, g in zip(params, grads[rank]):
            p.grad = g.clone()
        opt.step()
        for i in opt.mine:
            buf = opt.state[params[i]]["momentum_buffer"]
            want = _mean_rounded_once(grads, i, dtype).float()
            assert torch.equal(buf, want), (
                f"ShardedIsoLoCo {dtype}, {world} ranks, solo_above={solo}: param {i}'s mean is not the "
                f"float32 mean rounded once ({int((buf != want).sum())} of {buf.numel()} elements differ)"
            )
        for i, p in enumerate(params):
            want = (-1e-6 * 1.5 * _mean_rounded_once(grads, i, dtype).float()).to(dtype)
            assert rel_err(p, want) <= TOL[("update", dtype)], f"ShardedIsoLoCo {dtype}: param {i}"


HALF_SHAPES = [(7, 5), (33,), (4, 6), (257,)]


def _half_check(how, dtype) -> str:
    name = f"{how.__name__.removeprefix('_half_')}-{str(dtype).removeprefix('torch.')}"
    SMALL_CHECKS.add(name, lambda rank, world: how(rank, world, dtype))
    return name


HALF_MEANS = [_half_check(how, dt) for dt in (torch.float16, torch.bfloat16) for how in (_half_average, _half_sharded)]


def _body_small(rank, world, tmpdir):
    checks = SMALL_CHECKS if world == 2 else Checks({n: SMALL_CHECKS[n] for n in HALF_MEANS})
    checks.run(tmpdir, rank, rank, world)


small_groups = groups(_body_small, 2, 3)  # one spawned group each of 2 and 3 ranks


@pytest.mark.parametrize("name", RELIABILITY)
def test_a_failure_on_one_rank_fails_every_rank_with_nothing_changed(small_groups, name):
    small_groups[2].assert_ok(name)


@pytest.mark.parametrize("name", HALF_MEANS)
@pytest.mark.parametrize("world", [pytest.param(2, id="2ranks"), pytest.param(3, id="3ranks")])
def test_half_precision_means_are_float32_means_rounded_once(small_groups, world, name):
    """average_ and ShardedIsoLoCo's reduce-scatter and reduce-to-owner sum float16/bfloat16 in
    float32: float16 grads near 40000 (the sum overflows, the mean fits) give their mean, not a
    refused step; bfloat16 over 3 ranks is rounded once, bit for bit."""
    small_groups[world].assert_ok(name)
