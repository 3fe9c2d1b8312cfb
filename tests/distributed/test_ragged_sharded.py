"""Ragged, weighted and clipped rounds of ShardedIsoLoCo on 2 and 3 gloo ranks (tests/spawn.py).

`step(weight=...)`: each rank's worker weight, agreed in the step's roll call; the owners merge the ranks with
weight > 0 under their normalized weights. Compared with the one-process `MergeLoCo.step(deltas=...,
weights=...)` on the same K = world deltas: bit for bit wherever the two add the same terms in the same order —
every merge of every worker's Δ (the owner receives the K copies and runs the same merge), and the mean route
(iso_c, mean) on 2 ranks and on 3 ranks with at most two ranks of weight > 0 or equal weights among them. With
three ranks weighted unequally the mean route's reduce-scatter adds three terms in gloo's ring order, the one-
process mean in rank order (as the unweighted 3-rank mean already does): there it is compared at the tolerance
of that rounding and against the float64 definition (merges/reference.py). Equal weights are the step without
weights, bit for bit; a round short of `min_workers` changes nothing on any rank and the next one works; bad,
mixed and all-zero weights are refused on every rank with nothing changed; `compress=` takes equal weights only.

`clip=`: each rank's norms travel in the same roll call; every rank computes every cap and clips its own Δ
before it sends it, which is what MergeLoCo(clip=...) computes: bit for bit on the same terms as above, and
`last_worker_norms` / `last_clip_caps` equal MergeLoCo's; compressed too.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import DistributedStepError, MergeLoCo, ShardedIsoLoCo
from isoloco_kernels.distributed import sharded
from isoloco_kernels.merges.reference import merge_ref
from tests.helpers import TOL, rel_err, seeded
from tests.spawn import Checks, groups, params

pytestmark = pytest.mark.slow  # spawns gloo ranks

#: one matrix per shape, so each owner's Iso-C / TSV-M bucket is the one-process bucket (bucket composition
#: changes the batched SVDs' last bits); a vector, a scalar
SHAPES = [(12, 8), (5,), (7, 10), (40, 6), (), (9, 9)]
TABLES = {2: Checks(), 3: Checks()}
#: per world: (name, the weights of each step, bit for bit?). Three ranks weighted unequally on the mean route add
#: three terms in another order than one process does (module docstring).
ROUNDS = {
    2: [("unequal-dropped-equal", [(3.0, 1.0), (0.0, 2.5), (1.0, 1.0)], True)],
    3: [
        ("two-active", [(0.0, 2.5, 1.0), (2.0, 0.0, 2.0), (1.0, 0.0, 0.0)], True),
        ("three-unequal", [(3.0, 1.0, 0.5), (1.0, 2.0, 3.0), (0.0, 2.0, 1.0)], False),
    ],
}
MEAN_ROUTE = ("iso_c", "mean")


def _deltas(world: int, step: int, dtype=torch.float32):
    return seeded(SHAPES, 1000 + step, dtype, k=world)


def _init(dtype=torch.float32):
    return seeded(SHAPES, 7, dtype)


def _step(opt, ps, stacks, rank, weight=None):
    for p, d in zip(ps, stacks):
        p.grad = d[rank].clone()
    return opt.step(weight=weight)


def _close(p, q, dtype) -> float:
    """Relative error of two params' trajectories that summed the same terms in another order."""
    return rel_err(p, q)


def _against_one_process(rank, world, merge, rounds, exact, dtype=torch.float32, solo=1.0, clip=None, compress=None):
    """Each round on the ranks (weight = this rank's) and in one process (MergeLoCo with every worker's Δ and the
    weights): params and the owner's momentum torch.equal (exact) or within the 3-term sum's rounding."""
    ps, ref = _init(dtype), _init(dtype)
    kw = dict(lr=0.9, momentum=0.6, merge=merge, clip=clip, compress=compress)
    opt = ShardedIsoLoCo(ps, solo_above=solo, **kw)
    one = MergeLoCo(ref, **kw)
    if solo != 1.0:
        assert opt.plan.solo, "the case means to send solo tensors"
    for step, w in enumerate(rounds):
        stacks = _deltas(world, step, dtype)
        _step(opt, ps, stacks, rank, w[rank])
        one.step(deltas=stacks, weights=list(w))
        assert opt.last_round == sharded.Round(True, sum(v > 0 for v in w), tuple(w)), opt.last_round
    what = f"{merge} {dtype} solo={solo} clip={clip} compress={compress} {rounds}"
    for i, (p, q) in enumerate(zip(ps, ref)):
        if exact:
            assert torch.equal(p, q), f"{what}: param {i} differs from MergeLoCo ({_close(p, q, dtype):.1e})"
        else:
            tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
            assert _close(p, q, dtype) <= tol, f"{what}: param {i} differs by {_close(p, q, dtype):.2e}"
        assert not torch.equal(p, _init(dtype)[i]), f"{what}: param {i} did not move"
    if exact:
        for i in opt.mine:
            assert torch.equal(opt.state[ps[i]]["momentum_buffer"], one.state[ref[i]]["momentum_buffer"]), i
    if clip is not None:  # what the clip saw: every rank's norm of every tensor and its cap, as MergeLoCo's
        assert opt.last_worker_norms.keys() == one.last_worker_norms.keys() == set(range(len(SHAPES)))
        for i, n in one.last_worker_norms.items():
            assert n.dtype == torch.float64 and n.shape == (world,)
            if exact:
                assert torch.equal(opt.last_worker_norms[i], n), (i, opt.last_worker_norms[i], n)
                assert opt.last_clip_caps[i] == one.last_clip_caps[i], i
            else:
                torch.testing.assert_close(opt.last_worker_norms[i], n, rtol=1e-5, atol=0)


for _world, _table in TABLES.items():
    for _name, _rounds, _exact in ROUNDS[_world]:
        for _merge in ("iso_c", "mean", "tsv"):
            exact = _exact or _merge not in MEAN_ROUTE  # the owner of a worker merge receives every Δ as it was
            for _dt in (torch.float32, torch.bfloat16, torch.float16):
                for _solo in (1.0, 0.2) if _merge in ("mean", "tsv") and _dt == torch.float32 else (1.0,):
                    _table.add(
                        f"weights-{_name}-{_merge}-{str(_dt)[6:]}-solo{_solo}",
                        lambda rank, world, m=_merge, r=_rounds, e=exact, d=_dt, s=_solo: _against_one_process(
                            rank, world, m, r, e, d, s
                        ),
                    )
        for _merge in ("iso_c", "mean", "tsv"):
            for _clip in ("median", 2.5):
                exact = _exact or _merge not in MEAN_ROUTE
                _table.add(
                    f"clip-{_clip}-{_name}-{_merge}",
                    lambda rank, world, m=_merge, r=_rounds, e=exact, c=_clip: _against_one_process(
                        rank, world, m, r, e, clip=c
                    ),
                )
    # compressed: equal weights (unequal ones are refused) with the clip before each worker compresses
    _eq = [tuple([2.0] * _world)] * 3
    for _spec, _merge in (("int4:64:0.95", "iso_c"), ("int8:64:0.9:stochastic:both", "tsv")):
        for _clip in (None, "median"):
            _table.add(
                f"compress-{_spec}-{_merge}-clip{_clip}",
                lambda rank, world, s=_spec, m=_merge, c=_clip, r=_eq: _against_one_process(
                    rank, world, m, r, True, clip=c, compress=s
                ),
            )


def _check_the_float64_definition(rank, world):
    """One step at lr 1, μ 0 (θ' = θ − M) of the mean route, weighted and clipped, on every rank: M is
    merges/reference.py's float64 weighted mean of the clipped deltas, within float32's rounding of a sum (the
    "merge_sparse" row), whatever order the reduce-scatter adds in."""
    weights = [3.0, 1.0, 0.5][:world]
    for clip in (None, "median", 2.5):
        ps = _init()
        opt = ShardedIsoLoCo(ps, lr=1.0, momentum=0.0, merge="mean", clip=clip)
        stacks = _deltas(world, 5)
        _step(opt, ps, stacks, rank, weights[rank])
        for i, (p, x, p0) in enumerate(zip(ps, stacks, _init())):
            want = merge_ref(x, "mean", weights=weights, clip=clip)
            got = p0.double() - p.double()
            # θ − M rounded to float32 once more: the update's own rounding on top of the sum's
            assert rel_err(got, want) <= TOL[("merge_sparse", torch.float32)] * 4, (clip, i, rel_err(got, want))


def _check_equal_weights_are_the_step_without_weights(rank, world):
    """weight=2.5 on every rank (and weight=1) is the step without weights, bit for bit: Iso-C, a merge of every
    worker's Δ, and compressed (int4 with error feedback), three steps each."""
    for kw in (dict(merge="iso_c"), dict(merge="tsv"), dict(merge="iso_c", compress="int4:128:0.95")):
        runs = []
        for weight in (None, 2.5, 1):
            ps = _init()
            opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.6, **kw)
            for step in range(3):
                _step(opt, ps, _deltas(world, step), rank, weight)
            assert opt.last_round.participants == world and opt.merged_steps == 3
            runs.append((ps, opt))
        (base, ob), *others = runs
        for ps, opt in others:
            assert all(torch.equal(p, q) for p, q in zip(ps, base)), kw
            assert all(
                torch.equal(opt.state[ps[i]]["momentum_buffer"], ob.state[base[i]]["momentum_buffer"]) for i in opt.mine
            )
        assert ob.last_round == sharded.Round(True, world, None)


def _snapshot(ps, opt):
    return (
        [p.detach().clone() for p in ps],
        {i: opt.state[ps[i]]["momentum_buffer"].clone() for i in opt.mine if ps[i] in opt.state},
        opt.merged_steps,
        dict(opt.last_worker_norms),
    )


def _unchanged(ps, opt, snap) -> None:
    before, bufs, steps, norms = snap
    assert all(torch.equal(p, q) for p, q in zip(ps, before)), "a param changed"
    assert all(torch.equal(opt.state[ps[i]]["momentum_buffer"], b) for i, b in bufs.items()), "a buffer changed"
    assert opt.merged_steps == steps, "the step count changed"
    assert opt.last_worker_norms.keys() == norms.keys() and all(
        opt.last_worker_norms[i] is n for i, n in norms.items()
    ), "the clip's norms changed"


def _check_a_round_short_of_the_quorum_changes_nothing(rank, world):
    """min_workers=2: a round with one rank of weight > 0 is skipped on every rank — no param, momentum, step
    count or clip norms changed, last_round.committed False — and the next round works: the trajectory is that of
    an optimizer that never saw the skipped round (the same merge, bit for bit)."""
    for merge in ("iso_c", "tsv"):
        ps, ref = _init(), _init()
        opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.6, merge=merge, min_workers=2, clip="median")
        never = ShardedIsoLoCo(ref, lr=0.9, momentum=0.6, merge=merge, min_workers=2, clip="median")
        full = tuple([1.0] * world)
        _step(opt, ps, _deltas(world, 0), rank, full[rank])
        _step(never, ref, _deltas(world, 0), rank, full[rank])
        snap = _snapshot(ps, opt)
        alone = tuple(1.0 if r == world - 1 else 0.0 for r in range(world))
        assert _step(opt, ps, _deltas(world, 1), rank, alone[rank]) is None
        assert opt.last_round == sharded.Round(False, 1, alone)
        _unchanged(ps, opt, snap)
        w = tuple(float(r + 1) for r in range(world))
        _step(opt, ps, _deltas(world, 2), rank, w[rank])
        _step(never, ref, _deltas(world, 2), rank, w[rank])
        assert opt.last_round == sharded.Round(True, world, w) and opt.merged_steps == 2
        assert all(torch.equal(p, q) for p, q in zip(ps, ref)), merge
        assert all(torch.equal(opt.last_worker_norms[i], n) for i, n in never.last_worker_norms.items())


def _check_bad_weights_are_refused_everywhere(rank, world):
    """A NaN, Inf, negative, bool or non-number weight on one rank, every weight 0, a weight on some ranks only,
    unequal (or zero) weights with compress=: DistributedStepError on every rank, naming it, nothing changed; the
    next step works."""
    ps = _init()
    opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.6, clip=3.0)
    _step(opt, ps, _deltas(world, 0), rank)
    snap = _snapshot(ps, opt)
    for bad, match in (
        (float("nan"), "rank 1: ValueError: .*weight= on rank 1 is nan"),
        (float("inf"), "rank 1: ValueError: .*must be finite"),
        (-1.0, "rank 1: ValueError: .*weights must be ≥ 0"),
        (True, "rank 1: TypeError: .*must be a number"),
        ("3", "rank 1: TypeError: .*must be a number"),
        (torch.ones(2), "rank 1: TypeError: .*got a tensor"),
    ):
        with pytest.raises(DistributedStepError, match=match):
            _step(opt, ps, _deltas(world, 1), rank, bad if rank == 1 else 1.0)
        _unchanged(ps, opt, snap)
    with pytest.raises(DistributedStepError, match="every rank's weight is 0"):
        _step(opt, ps, _deltas(world, 1), rank, 0.0)
    _unchanged(ps, opt, snap)
    with pytest.raises(DistributedStepError, match=r"weight= was given on ranks? \[0\] and not on"):
        _step(opt, ps, _deltas(world, 1), rank, 1.0 if rank == 0 else None)
    _unchanged(ps, opt, snap)
    _step(opt, ps, _deltas(world, 1), rank, torch.tensor(2.0))  # and the next step works
    assert opt.merged_steps == 2 and opt.last_round.weights == tuple([2.0] * world)
    packed = _init()
    zipped = ShardedIsoLoCo(packed, lr=0.9, momentum=0.6, compress="int4")
    for w in (tuple(float(r + 1) for r in range(world)), tuple(0.0 if r == 0 else 1.0 for r in range(world))):
        with pytest.raises(DistributedStepError, match="weights with compress= must be equal"):
            _step(zipped, packed, _deltas(world, 0), rank, w[rank])
        assert all(torch.equal(p, q) for p, q in zip(packed, _init())) and zipped.merged_steps == 0
        assert not zipped._residuals
    quorum = ShardedIsoLoCo(_init(), compress="int4", min_workers=world)  # short of the quorum: skipped, not refused
    _step(quorum, quorum._params, _deltas(world, 0), rank, 0.0 if rank == 0 else 1.0)
    assert quorum.last_round.committed is False and quorum.merged_steps == 0 and not quorum._residuals


def _check_settings_are_refused_by_name(rank, world):
    """min_workers outside [1, world] or not an int, a clip that is not "median" or > 0: refused on every rank
    (each raises its own error); ranks with another min_workers or clip: DistributedStepError naming it; a
    min_workers changed on one rank after construction: refused at the roll call, on every rank."""
    for bad, err in ((0, ValueError), (world + 1, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(err, match="min_workers"):
            ShardedIsoLoCo(_init(), min_workers=bad)
    for bad, err in (("mean", TypeError), (0.0, ValueError), (float("nan"), ValueError), (True, TypeError)):
        with pytest.raises(err, match="clip"):
            ShardedIsoLoCo(_init(), clip=bad)
    with pytest.raises(DistributedStepError, match="min_workers"):
        ShardedIsoLoCo(_init(), min_workers=1 if rank == 0 else 2)
    with pytest.raises(DistributedStepError, match="clip"):
        ShardedIsoLoCo(_init(), clip="median" if rank == 0 else 2.0)
    ps = _init()
    opt = ShardedIsoLoCo(ps)
    if rank == 0:
        opt.min_workers = 2
    with pytest.raises(DistributedStepError, match="min_workers differ"):
        _step(opt, ps, _deltas(world, 0), rank, 1.0)
    assert all(torch.equal(p, q) for p, q in zip(ps, _init())) and opt.merged_steps == 0
    for bad in ("2", None, 2**70):  # a min_workers that is no valid int on one rank: that rank's own error
        opt.min_workers = bad if rank == world - 1 else 1  # (it sends nothing of it), the others' agreed one
        with pytest.raises((DistributedStepError, TypeError, ValueError), match="min_workers"):
            _step(opt, ps, _deltas(world, 0), rank, 1.0)
        assert all(torch.equal(p, q) for p, q in zip(ps, _init())) and opt.merged_steps == 0
    opt.min_workers = 1
    opt.clip = "median"  # built without a clip: the roll call has no room for the norms
    with pytest.raises(DistributedStepError, match="built without a clip"):
        _step(opt, ps, _deltas(world, 0), rank)
    opt.clip = None
    _step(opt, ps, _deltas(world, 0), rank)
    assert opt.merged_steps == 1


def _check_the_roll_call_is_one_small_all_gather(rank, world):
    """What carrying the weights (and norms) costs: one all-gather before leg 1 of 3 int64 per rank (state,
    min_workers, weight), + one float64 per param with clip; the step's other collectives as without it."""
    calls = []
    real = sharded.all_gather_single

    def counting(out, inp, *a, **k):
        calls.append(inp.numel() * inp.element_size())
        return real(out, inp, *a, **k)

    for clip, words in ((None, 3), ("median", 3 + len(SHAPES))):
        ps = _init()
        opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.6, clip=clip)
        sharded.all_gather_single = counting
        try:
            calls.clear()
            _step(opt, ps, _deltas(world, 0), rank, 1.0 + rank)
        finally:
            sharded.all_gather_single = real
        assert calls == [8 * words], calls


for _table in TABLES.values():
    _table.add("float64_definition", _check_the_float64_definition)
    _table.add("equal_weights_are_none", _check_equal_weights_are_the_step_without_weights)
    _table.add("quorum_miss", _check_a_round_short_of_the_quorum_changes_nothing)
    _table.add("bad_weights", _check_bad_weights_are_refused_everywhere)
    _table.add("settings", _check_settings_are_refused_by_name)
    _table.add("roll_call_bytes", _check_the_roll_call_is_one_small_all_gather)


def _body(rank, world, tmpdir):
    warnings.simplefilter("ignore")
    TABLES[world].run(tmpdir, rank, rank, world)


ranks = groups(_body, 2, 3, deadline_s=400)


@pytest.mark.parametrize("world,name", params(TABLES))
def test_ragged_sharded_round(ranks, world, name):
    ranks[world].assert_ok(name)
