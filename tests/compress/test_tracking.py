"""Tracking (feedback "ef21"): each worker sends the correction to its tracked estimate of its Δ, the owner merges
its tracked estimate of the mean. `track` against the float64 oracle (compress/reference.py `tracking_ref`),
MergeLoCo's rounds against an independent simulation of the docs' arithmetic, the estimate converging to a
constant mean, the spec's rules, the estimates in state dicts, and bad input refused with nothing changed. The
sharded route: tests/distributed/test_compress_skip_tracking_sharded.py."""

from __future__ import annotations

import copy

import pytest
import torch

from isoloco_kernels import MergeLoCo
from isoloco_kernels.compress import Compression, compress, decompress_add_, parse, residual_bytes, track
from isoloco_kernels.compress.reference import tracking_ref
from isoloco_kernels.distributed.sharded import stream_spec

SPECS = ["int4:64:0.9:nearest:ef21", "int2:32:1:stochastic:ef21", "stat2:64:0.8:nearest:ef21"]


def test_the_spec_string_and_what_each_leg_keeps():
    s = parse("stat2:256:0.9:nearest:ef21")
    assert s == Compression("stat2", 256, ef_beta=0.9, feedback="ef21") and parse(s.cli()) == s
    assert s.leg("workers") is s and s.leg("owner").ef_beta is None  # the update goes back without a residual
    assert s.keeps("workers") and s.keeps("owner")  # each worker's g_k, the owner's G
    # both estimates in the compute dtype, whatever the params' (so the owner's stays the mean of the workers')
    assert residual_bytes(s, 100, torch.bfloat16) == 400 and residual_bytes(s, 100, torch.bfloat16, "owner") == 400
    assert residual_bytes(s, 100, torch.float64) == 800
    with pytest.raises(ValueError, match="residual_dtype=torch.bfloat16 with feedback='ef21'"):
        Compression("stat2", ef_beta=0.9, feedback="ef21", residual_dtype=torch.bfloat16)
    full = Compression("int4", ef_beta=0.9, feedback="ef21", update="full")
    assert full.keeps("owner") and residual_bytes(full, 10, torch.float32, "owner") == 40
    with pytest.raises(ValueError, match="feedback is set but ef_beta is None"):
        Compression("int4", feedback="ef21")
    with pytest.raises(ValueError, match="leg must be one of"):
        s.keeps("nowhere")


@pytest.mark.parametrize("text", SPECS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_track_is_the_oracle(text, dtype):
    """c = Q(Δ − β·g), g ← β·g + c: the sent values bit-equal to the float64 oracle's on the same v (the
    compute-dtype difference the path takes; each decoded as one float32 product), the new estimate to the
    dtype's rounding of β·g + c."""
    spec = parse(text)
    g = torch.Generator().manual_seed(3)
    delta = torch.randn(300, generator=g).to(dtype)
    estimate = None
    for step in range(3):
        packed, new = track(delta, estimate, spec, step=step, tensor_id=2)
        v = delta if estimate is None else delta - spec.ef_beta * estimate  # in the compute dtype, as the path
        sent, want = tracking_ref(v, None, spec, step, 2)
        got_sent = decompress_add_(torch.zeros(300, dtype=torch.float64), packed)
        assert torch.equal(got_sent, sent.float().double()), (text, step)  # decoded as one float32 product
        prior = torch.zeros(300, dtype=torch.float64) if estimate is None else spec.ef_beta * estimate.double()
        tol = 0 if dtype == torch.float64 else 2**-23  # float32: one rounding of β·g + c
        torch.testing.assert_close(new.double(), prior + sent.float().double(), rtol=tol, atol=tol)
        assert new.dtype == dtype and new.shape == delta.shape
        estimate = new
        delta = delta + 0.05 * torch.randn(300, generator=g).to(dtype)


@pytest.mark.parametrize("text", ["int2:128:1:nearest:ef21", "stat2:256:1:nearest:ef21"])
def test_the_estimate_converges_to_a_constant_delta(text):
    """With Δ held fixed and β = 1, g_k → Δ_k: the correction shrinks each round (EF21's point), where a plain
    2-bit message keeps its error for ever."""
    spec = parse(text)
    delta = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    estimate, errors = None, []
    for step in range(12):
        _, estimate = track(delta, estimate, spec, step=step, tensor_id=0)
        errors.append(float((estimate - delta).norm() / delta.norm()))
    assert errors[0] > 0.2 and errors[-1] < 0.02 * errors[0], errors


def test_mergeloco_rounds_are_the_docs_arithmetic():
    """Four rounds of MergeLoCo(merge="mean", momentum 0, ef21, update "full") in float64 against a simulation
    written from the docs: every param equal to float64 rounding, the workers' and the owner's estimates too."""
    spec = Compression("stat2", 64, ef_beta=0.9, feedback="ef21", update="full")
    shapes = [(20, 12), (7,)]
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    rounds = [[torch.randn(3, *s, generator=gen, dtype=torch.float64) for s in shapes] for _ in range(4)]
    ps = [t.clone() for t in init]
    opt = MergeLoCo(ps, lr=0.5, momentum=0.0, merge="mean", iso=False, compress=spec)
    for deltas in rounds:
        opt.step(deltas=deltas)
    theta = [t.clone() for t in init]
    g = {(i, k): torch.zeros(shapes[i]).double().flatten() for i in range(2) for k in range(3)}
    G = {i: torch.zeros(shapes[i]).double().flatten() for i in range(2)}
    for step, deltas in enumerate(rounds):
        for i, stack in enumerate(deltas):
            total = torch.zeros(stack[0].numel(), dtype=torch.float64)
            for k in range(3):
                sent, g[i, k] = tracking_ref(stack[k], g[i, k], stream_spec(spec, k + 1), step, i)
                total += sent
            G[i] = spec.ef_beta * G[i] + total / 3
            theta[i] = theta[i] - 0.5 * G[i].view(shapes[i])
    for i in range(2):
        torch.testing.assert_close(ps[i], theta[i], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(opt._update_residuals[i].flatten(), G[i], rtol=1e-12, atol=1e-12)
        for k in range(3):
            torch.testing.assert_close(opt._residuals[i][k].flatten(), g[i, k], rtol=1e-12, atol=1e-12)


def _opt(ps, text="stat2:64:0.9:nearest:ef21", **kw):
    return MergeLoCo(ps, lr=0.7, momentum=0.5, compress=text, **kw)


def test_the_estimates_survive_a_save_and_load_and_another_placement_is_refused():
    gen = torch.Generator().manual_seed(1)
    shapes = [(16, 8), (8,)]
    rounds = [[torch.randn(2, *s, generator=gen) for s in shapes] for _ in range(4)]
    a = [torch.randn(s, generator=gen) for s in shapes]
    b = [t.clone() for t in a]
    oa = _opt(a)
    for d in rounds[:2]:
        oa.step(deltas=d)
    saved = copy.deepcopy(oa.state_dict())
    assert set(saved["compress"]["residuals"]) == {0, 1} and set(saved["compress"]["update_residuals"]) == {0, 1}
    with torch.no_grad():
        for p, q in zip(b, a):
            p.copy_(q)
    ob = _opt(b)
    ob.load_state_dict(saved)
    for d in rounds[2:]:
        oa.step(deltas=d)
        ob.step(deltas=d)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    other = _opt([t.clone() for t in a], "stat2:64:0.9:nearest:both")
    with pytest.raises(ValueError, match="feedback='ef21'"):
        other.load_state_dict(saved)
    assert not other._residuals and not other._update_residuals


def test_a_stack_merge_is_refused_with_tracking():
    with pytest.raises(ValueError, match="feedback='ef21' tracks the mean.*merge 'tsv'"):
        MergeLoCo([torch.zeros(4, 4)], merge="tsv", compress="int4:128:1:nearest:ef21")


def test_bad_input_changes_nothing():
    """A NaN in a Δ, and an estimate that does not fit float16: refused by name, nothing written (params,
    momentum, estimates, step count)."""
    gen = torch.Generator().manual_seed(2)
    ps = [torch.randn(16, 8, generator=gen), torch.randn(8, generator=gen)]
    opt = _opt(ps)
    opt.step(deltas=[torch.randn(2, *p.shape, generator=gen) for p in ps])
    before = copy.deepcopy((ps, opt.state_dict()))
    bad = [torch.randn(2, *p.shape, generator=gen) for p in ps]
    bad[0][1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"worker 1's Δ of param 0 .*NaN"):
        opt.step(deltas=bad)
    after = (ps, opt.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(before[0], after[0])) and opt.merged_steps == 1
    for key in ("residuals", "update_residuals"):
        assert all(torch.equal(before[1]["compress"][key][i], after[1]["compress"][key][i]) for i in (0, 1))
    big = [torch.zeros(16, 8)]
    ob = MergeLoCo(big, lr=1e-30, momentum=0.0, compress="int8:32:1:nearest:ef21")
    ob.step(deltas=[torch.full((2, 16, 8), 1.5e38)])  # g ≈ 1.5e38 on each worker, G ≈ 1.5e38
    held = copy.deepcopy((big, ob._residuals, ob._update_residuals))
    with pytest.raises(ValueError, match=r"track: worker 0's Δ of param 0 .*Δ − β·estimate overflows"):
        ob.step(deltas=[torch.full((2, 16, 8), -2e38)])  # Δ − g does not fit float32
    assert ob.merged_steps == 1 and torch.equal(big[0], held[0][0])
    assert torch.equal(ob._residuals[0], held[1][0]) and torch.equal(ob._update_residuals[0], held[2][0])


def test_compress_refuses_a_tracking_spec():
    """compress() runs error feedback; a spec that tracks goes through track() (the routes call it)."""
    with pytest.raises(ValueError, match="call track"):
        compress(torch.randn(10), None, parse("int4:128:0.9:nearest:ef21"), step=0, tensor_id=0)
    with pytest.raises(ValueError, match="feedback must be 'ef21'"):
        track(torch.randn(10), None, parse("int4:128:0.9"), step=0, tensor_id=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_owners_estimate_stays_the_mean_of_the_workers(dtype):
    """200 rounds of a fixed Δ at β 1 with half-precision params: G − mean_k g_k stays at float32 rounding (a
    narrower worker estimate would stop moving once its correction is below its last bit while the owner kept
    adding it: linear drift)."""
    ps = [torch.zeros(64, 48, dtype=dtype)]
    opt = MergeLoCo(ps, lr=1e-3, momentum=0.0, merge="mean", iso=False, compress="stat2:256:1:nearest:ef21")
    d = [torch.randn(4, 64, 48, generator=torch.Generator().manual_seed(7)).to(dtype)]
    for _ in range(200):
        opt.step(deltas=d)
    G, g = opt._update_residuals[0], opt._residuals[0]
    assert G.dtype == g.dtype == torch.float32
    assert float((G - g.mean(0)).norm() / g.mean(0).norm()) < 1e-6
    assert float((G - d[0].float().mean(0)).norm() / d[0].float().mean(0).norm()) < 1e-6  # and it tracked Δ


def test_a_state_with_one_side_of_the_estimates_is_refused():
    gen = torch.Generator().manual_seed(9)
    ps = [torch.randn(16, 8, generator=gen)]
    opt = _opt(ps)
    opt.step(deltas=[torch.randn(2, 16, 8, generator=gen)])
    saved = copy.deepcopy(opt.state_dict())
    for key in ("residuals", "update_residuals"):
        half = copy.deepcopy(saved)
        half["compress"][key] = {}
        fresh = _opt([ps[0].clone()])
        with pytest.raises(ValueError, match="restored together"):
            fresh.load_state_dict(half)
        assert not fresh._residuals and not fresh._update_residuals and not fresh.state
    none = copy.deepcopy(saved)
    none["compress"]["residuals"], none["compress"]["update_residuals"] = {}, {}
    _opt([ps[0].clone()]).load_state_dict(none)  # both restart from zero together
