"""MergeLoCo(compress=...): the compressed owner route simulated in one process (optim/compressed.py) — its
known answer from the compress/ API alone, error feedback carrying what was not sent on both legs, each
feedback placement ("both", "workers", "owner") against the route computed leg by leg, all or nothing, a
resume bit for bit, refusals; and the reference loop's --compress (its bytes per round). The simulation equals
ShardedIsoLoCo(compress=...) on 2 and 3 ranks bit for bit: tests/distributed/test_compress_sharded.py."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math

import pytest
import torch

from isoloco_kernels import MergeLoCo
from isoloco_kernels.compress import Compression, allreduce_bytes, compress, dequantize, exchange_bytes, quantize
from isoloco_kernels.compress.reference import error_feedback_ref
from isoloco_kernels.optim.compressed import worker_bytes
from tests.helpers import seeded

SHAPES = [(12, 8), (5,), (8, 12), (40, 6)]

pytestmark = pytest.mark.usefixtures("one_thread")  # small computations (tests/conftest.py)


def _stacks(K: int, step: int, dtype=torch.float32):
    return seeded(SHAPES, 300 + step, dtype, k=K)


def _init(dtype=torch.float32):
    return seeded(SHAPES, 9, dtype)


def _state(opt, ps):
    """Everything a step may change: params, momentum, residuals, update residuals, step count."""
    mom = {i: opt.state[p]["momentum_buffer"].clone() for i, p in enumerate(ps) if "momentum_buffer" in opt.state[p]}
    res = {k: dict(getattr(opt, k)) for k in ("_residuals", "_update_residuals")}
    return [p.clone() for p in ps], mom, res, opt.merged_steps


def _same(a, b) -> bool:
    (pa, ma, ra, sa), (pb, mb, rb, sb) = a, b
    if sa != sb or ma.keys() != mb.keys() or ra.keys() != rb.keys():
        return False
    same_res = all(ra[k].keys() == rb[k].keys() and all(torch.equal(ra[k][i], rb[k][i]) for i in ra[k]) for k in ra)
    return same_res and all(map(torch.equal, pa, pb)) and all(torch.equal(ma[i], mb[i]) for i in ma)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_step_is_the_known_answer_from_the_compress_api(dtype):
    """μ = 0, the mean, nearest rounding, no error feedback: θ' = θ + deq(Q(−lr·Σ_k deq(Q(Δ_k))/K)), the sum
    in float32 in worker order, the mean rounded once to θ's dtype, θ + deq(u) in float32 rounded once."""
    spec = Compression("int4", 32)
    ps = _init(dtype)
    start = [p.clone() for p in ps]
    opt = MergeLoCo(ps, lr=0.7, momentum=0.0, merge="mean", compress=spec)
    stacks = _stacks(3, 0, dtype)
    opt.step(deltas=stacks)
    for i, (p, p0, st) in enumerate(zip(ps, start, stacks)):
        acc = torch.zeros(p.numel())
        for k in range(3):
            acc += dequantize(quantize(st[k], spec, tensor_id=i))
        mean = (acc / 3).to(dtype).float()
        want = (p0.float().reshape(-1) + dequantize(quantize(mean * -0.7, spec, tensor_id=i))).to(dtype)
        assert torch.equal(p.reshape(-1), want), f"param {i}"


@pytest.mark.parametrize("merge", ["iso_c", "mean", "tsv"])
def test_int8_stays_near_the_uncompressed_step(merge):
    """Five steps at int8 land within 3 % of the uncompressed MergeLoCo's params (random Δ, the worst case)."""
    runs = []
    for spec in (None, "int8:128:0.95"):
        ps = [torch.zeros(s) for s in SHAPES]
        opt = MergeLoCo(ps, lr=0.9, momentum=0.6, merge=merge, compress=spec)
        for step in range(5):
            opt.step(deltas=_stacks(4, step))
        runs.append(torch.cat([p.reshape(-1) for p in ps]))
    err = float((runs[1] - runs[0]).norm() / runs[0].norm())
    assert err < (0.03 if merge != "tsv" else 0.3), err


def test_error_feedback_carries_what_was_not_sent_on_both_legs():
    """β = 1, μ = 0, the mean, 2 bits: θ_T − θ_0 + e_u = −lr/K·Σ_k (Σ_t Δ_k,t − e_k,T) up to float32 rounding:
    every worker's residual holds what its payloads left out, the owner's what the updates left out (feedback
    "both"; the default "workers" keeps no owner residual: θ_T − θ_0 is then what the updates sent)."""
    K, T, lr = 3, 6, 0.5
    ps = [torch.zeros(s) for s in SHAPES]
    spec = Compression("int2", 32, ef_beta=1.0, feedback="both")
    opt = MergeLoCo(ps, lr=lr, momentum=0.0, merge="mean", compress=spec)
    total = [torch.zeros(K, *s) for s in SHAPES]
    for step in range(T):
        stacks = _stacks(K, step)
        opt.step(deltas=stacks)
        total = [a + b for a, b in zip(total, stacks)]
    for i, p in enumerate(ps):
        want = -lr / K * (total[i] - opt._residuals[i]).sum(0)
        got = p + opt._update_residuals[i]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())
        assert float(opt._update_residuals[i].abs().max()) > 1e-3  # 2 bits leave plenty out


def _leg_torch(x, e, spec, step, i):
    """One leg by the compress API: (the values sent, in x's dtype, the new residual or None)."""
    packed, new = compress(x, e, spec, step=step, tensor_id=i)
    return dequantize(packed, x.dtype), new


def _leg_float64(x, e, spec, step, i):
    """One leg by the float64 contract (compress/reference.py)."""
    _, _, sent, new = error_feedback_ref(x, e, spec, step, i)
    return sent, new


def _route_by_hand(spec, lr, init, steps, leg):
    """μ = 0, the mean, nearest rounding, leg by leg: c_k = leg(Δ_k, e_k) with spec.leg("workers"), the mean
    of the sent values summed in worker order, u = leg(−lr·mean, e_u) with spec.leg("owner"), θ ← θ + u.
    Returns (θ per param, {(param, worker): e_k}, {param: e_u}), flat, in the params' dtype."""
    theta = [p.reshape(-1).clone() for p in init]
    e_w, e_u = {}, {}
    for t, stacks in enumerate(steps):
        for i, st in enumerate(stacks):
            acc = torch.zeros_like(theta[i])
            for k in range(st.shape[0]):
                sent, e_w[i, k] = leg(st[k].reshape(-1), e_w.get((i, k)), spec.leg("workers"), t, i)
                acc += sent
            sent, e_u[i] = leg((acc / st.shape[0]) * -lr, e_u.get(i), spec.leg("owner"), t, i)
            theta[i] = theta[i] + sent
    return theta, e_w, e_u


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("feedback", ["both", "workers", "owner"])
def test_each_feedback_placement_is_the_route_by_hand(feedback, dtype):
    """3 steps of 3 workers at 2 bits, β 0.9: MergeLoCo(compress=...) equals the route computed leg by leg
    with each leg's spec, bit for bit (float32: from the compress API; float64: from the float64 contract,
    error_feedback_ref, which the float64 path meets exactly), keeps the residuals of its placement's legs
    only, and a placement other than "both" lands elsewhere than "both" does."""
    K, T, lr = 3, 3, 0.7
    spec = Compression("int2", 32, ef_beta=0.9, feedback=feedback)
    steps = [_stacks(K, t, dtype) for t in range(T)]
    runs = {}
    for fb in dict.fromkeys(("both", feedback)):
        ps = _init(dtype)
        opt = MergeLoCo(ps, lr=lr, momentum=0.0, merge="mean", compress=dataclasses.replace(spec, feedback=fb))
        for st in steps:
            opt.step(deltas=st)
        runs[fb] = ps, opt
    ps, opt = runs[feedback]
    theta, e_w, e_u = _route_by_hand(
        spec, lr, _init(dtype), steps, _leg_torch if dtype == torch.float32 else _leg_float64
    )
    workers, owner = feedback in ("both", "workers"), feedback in ("both", "owner")
    assert set(opt._residuals) == (set(range(len(SHAPES))) if workers else set())
    assert set(opt._update_residuals) == (set(range(len(SHAPES))) if owner else set())
    assert all((e is None) is not workers for e in e_w.values()) and all((e is None) is not owner for e in e_u.values())
    same = lambda got, want: torch.equal(got.reshape(-1), want)
    for i, p in enumerate(ps):
        assert same(p, theta[i]), f"param {i}"
        if workers:
            assert all(same(opt._residuals[i][k], e_w[i, k]) for k in range(K)), f"residuals of param {i}"
        if owner:
            assert same(opt._update_residuals[i], e_u[i]), f"update residual of param {i}"
    if feedback != "both":
        assert not any(torch.equal(p, q) for p, q in zip(ps, runs["both"][0]))


def test_a_refused_step_changes_nothing():
    """NaN in one worker's Δ at the second step, or an update that overflows float16: ValueError naming it,
    and no param, momentum, residual, update residual or step count changed."""
    ps = _init()
    opt = MergeLoCo(ps, lr=0.9, momentum=0.6, compress="int4:64:0.95:stochastic:both")  # update residuals too
    opt.step(deltas=_stacks(3, 0))
    before = _state(opt, ps)
    assert before[2]["_update_residuals"]
    bad = _stacks(3, 1)
    bad[2][1, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="worker 1's Δ of param 2.*NaN"):
        opt.step(deltas=bad)
    assert _same(_state(opt, ps), before)
    half = [torch.full((4, 4), 6.0e4, dtype=torch.float16)]
    opt = MergeLoCo(half, lr=4.0, momentum=0.0, iso=False, compress="int8")
    with pytest.raises(ValueError, match="after the step"):
        opt.step(deltas=[torch.full((2, 4, 4), -2000.0, dtype=torch.float16)])
    assert bool((half[0] == 6.0e4).all()) and opt.merged_steps == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_resume_is_bit_exact_and_residuals_come_back_whole(dtype):
    """2 steps, state_dict through torch.save, a fresh MergeLoCo loads it, 2 more: equal to 4 steps; a
    deepcopy carries the residuals too. Feedback "both" (both legs' residuals); the default "workers" and
    "owner": test_a_placement_saves_only_its_legs_residuals_and_resumes_bit_exact."""
    spec = Compression("fp4", 64, "stochastic", ef_beta=0.9, residual_dtype=torch.bfloat16, seed=3, feedback="both")
    a, b = _init(dtype), _init(dtype)
    oa = MergeLoCo(a, lr=0.8, momentum=0.7, compress=spec)
    ob = MergeLoCo(b, lr=0.8, momentum=0.7, compress=spec)
    for step in range(2):
        oa.step(deltas=_stacks(3, step, dtype))
        ob.step(deltas=_stacks(3, step, dtype))
    buf = io.BytesIO()
    torch.save(ob.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert {t.dtype for t in saved["compress"]["residuals"].values()} == {torch.bfloat16}
    assert all(t.shape[0] == 3 for t in saved["compress"]["residuals"].values())
    c = [p.clone() for p in b]
    oc = MergeLoCo(c, lr=0.8, momentum=0.7, compress=spec)
    oc.load_state_dict(saved)
    od, d = copy.deepcopy((oa, a))
    for i, r in oa._residuals.items():
        assert torch.equal(oc._residuals[i], r) and torch.equal(od._residuals[i], r)
    assert oa._update_residuals.keys() == oc._update_residuals.keys() == set(range(len(SHAPES)))
    for i, r in oa._update_residuals.items():
        assert torch.equal(oc._update_residuals[i], r) and torch.equal(od._update_residuals[i], r)
    for step in range(2, 4):
        oa.step(deltas=_stacks(3, step, dtype))
        oc.step(deltas=_stacks(3, step, dtype))
        od.step(deltas=_stacks(3, step, dtype))
    assert all(torch.equal(x, y) for x, y in zip(a, c)) and all(torch.equal(x, y) for x, y in zip(a, d))


def test_refusals_name_what_is_wrong():
    ps = _init()
    opt = MergeLoCo(ps, compress="int4:128:0.95")
    opt.step(deltas=_stacks(3, 0))
    saved = opt.state_dict()
    other = MergeLoCo(_init(), compress="int4:128:0.9")
    with pytest.raises(ValueError, match="saved with compression"):
        other.load_state_dict(saved)
    assert not other._residuals and not other.state
    with pytest.raises(ValueError, match="compress=None"):
        MergeLoCo(_init()).load_state_dict(saved)
    broken = copy.deepcopy(saved)
    broken["compress"]["residuals"][1] = broken["compress"]["residuals"][1][:, :2]
    with pytest.raises(ValueError, match="residuals of param 1"):
        MergeLoCo(_init(), compress="int4:128:0.95").load_state_dict(broken)
    with pytest.raises(ValueError, match="K must stay the same"):
        opt.step(deltas=_stacks(4, 1))
    with pytest.raises(ValueError, match="every param needs a stack"):
        opt.step(deltas=[None] + _stacks(3, 1)[1:])
    with pytest.raises(TypeError, match="compress must be a Compression"):
        MergeLoCo(_init(), compress=8)
    with pytest.raises(ValueError, match="MergeLoCo: compression spec 'int5'"):
        MergeLoCo(_init(), compress="int5")
    assert opt.merged_steps == 1


@pytest.mark.parametrize("feedback", ["workers", "owner", None])
def test_a_placement_saves_only_its_legs_residuals_and_resumes_bit_exact(feedback):
    """2 steps, state_dict through torch.save, a fresh MergeLoCo loads it, 2 more: equal to 4 steps. The state
    holds the residuals of the placement's leg only and its spec names the placement; a MergeLoCo with another
    placement refuses it (another spec), and a state holding the other leg's residuals is refused. None: the
    default placement, "workers", left unnamed."""
    named = {} if feedback is None else dict(feedback=feedback)
    spec = Compression("fp4", 64, "stochastic", ef_beta=0.9, residual_dtype=torch.bfloat16, seed=3, **named)
    feedback = spec.feedback
    kept, empty = ("residuals", "update_residuals") if feedback == "workers" else ("update_residuals", "residuals")
    a, b = _init(), _init()
    oa = MergeLoCo(a, lr=0.8, momentum=0.7, compress=spec)
    ob = MergeLoCo(b, lr=0.8, momentum=0.7, compress=spec)
    for step in range(2):
        oa.step(deltas=_stacks(3, step))
        ob.step(deltas=_stacks(3, step))
    buf = io.BytesIO()
    torch.save(ob.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf)
    entry = saved["compress"]
    assert entry["spec"]["feedback"] == feedback and entry[empty] == {} and set(entry[kept]) == set(range(len(SHAPES)))
    assert {t.dtype for t in entry[kept].values()} == {torch.bfloat16}
    for other in {"both", "workers", "owner"} - {feedback}:
        refusing = MergeLoCo(_init(), lr=0.8, momentum=0.7, compress=dataclasses.replace(spec, feedback=other))
        with pytest.raises(ValueError, match="saved with compression.*feedback placement"):
            refusing.load_state_dict(saved)
        assert not refusing._residuals and not refusing._update_residuals and not refusing.state
    broken = copy.deepcopy(saved)
    broken["compress"][empty] = copy.deepcopy(entry[kept])
    with pytest.raises(ValueError, match=f"holds {empty} but feedback='{feedback}'"):
        MergeLoCo(_init(), lr=0.8, momentum=0.7, compress=spec).load_state_dict(broken)
    c = [p.clone() for p in b]
    oc = MergeLoCo(c, lr=0.8, momentum=0.7, compress=spec)
    oc.load_state_dict(saved)
    for step in range(2, 4):
        oa.step(deltas=_stacks(3, step))
        oc.step(deltas=_stacks(3, step))
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    assert not getattr(oc, "_" + empty) and all(
        torch.equal(getattr(oc, "_" + kept)[i], r) for i, r in getattr(oa, "_" + kept).items()
    )


def test_a_state_saved_before_the_feedback_field_loads_as_both():
    """A "compress" entry whose spec has no "feedback" key (saved before the field existed, when both legs kept
    residuals) is a "both" spec: it loads under feedback="both", and the default spec ("workers") refuses it
    with an error that says to pass feedback='both'."""
    opt = MergeLoCo(_init(), compress="int4:128:0.95:nearest:both")
    opt.step(deltas=_stacks(3, 0))
    saved = opt.state_dict()
    assert set(saved["compress"]["update_residuals"]) == set(range(len(SHAPES)))
    del saved["compress"]["spec"]["feedback"]
    again = MergeLoCo(_init(), compress=Compression("int4", 128, ef_beta=0.95, feedback="both"))
    again.load_state_dict(saved)
    assert all(torch.equal(again._residuals[i], r) for i, r in opt._residuals.items())
    assert all(torch.equal(again._update_residuals[i], r) for i, r in opt._update_residuals.items())
    hint = "saved with compression.*pass feedback='both'.*'int4:128:0.95:nearest:both'"
    for default in ("int4:128:0.95", "int4:128:0.95:nearest:workers"):
        refusing = MergeLoCo(_init(), compress=default)
        with pytest.raises(ValueError, match=hint):
            refusing.load_state_dict(saved)
        assert not refusing._residuals and not refusing._update_residuals and not refusing.state


def test_worker_bytes_are_the_spec_byte_counts():
    ps = [torch.zeros(s) for s in SHAPES] + [torch.zeros(3000, dtype=torch.bfloat16)]
    spec = Compression("int2")
    got = worker_bytes(spec, ps, 4)
    assert got["compressed"] == sum(exchange_bytes(spec, p.numel(), 4, p.dtype) for p in ps)
    assert got["allreduce_fp32"] == sum(allreduce_bytes(p.numel(), 4) for p in ps)
    assert got["compressed"] <= 0.08 * got["allreduce_fp32"]
    assert worker_bytes(None, ps, 4)["compressed"] is None


# -- the reference loop ---------------------------------------------------------------------------------------

SMALL = dict(model="tiny", seq_len=16, workers=2, inner_steps=2, rounds=2, batch=2, warmup=1, eval_windows=8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["diloco", "isoloco"])
def test_the_loop_trains_compressed_and_records_its_bytes(mode):
    from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode

    corpus = load_corpus(max_bytes=60_000)
    runs = {}
    for spec in (None, "int4:128:0.95"):
        runs[spec] = run_mode(mode, Setup(TrainConfig(**SMALL, compress=spec), corpus))
        assert "diverged" not in runs[spec] and all(math.isfinite(x) for x in runs[spec]["heldout_loss"])
    plain, packed = runs[None], runs["int4:128:0.95"]
    n = sum(p.numel() for p in Setup(TrainConfig(**SMALL), corpus).model().parameters())
    assert plain["bytes_per_worker_per_round"] == plain["allreduce_fp32_bytes_per_worker_per_round"] == 4 * n
    assert packed["allreduce_fp32_bytes_per_worker_per_round"] == 4 * n and packed["compress"] == "int4:128:0.95"
    assert 0.13 * 4 * n < packed["bytes_per_worker_per_round"] <= 0.14 * 4 * n
    assert packed["final_loss"] != plain["final_loss"] and abs(packed["final_loss"] - plain["final_loss"]) < 0.1


@pytest.mark.slow
def test_the_cli_takes_compress_and_refuses_a_bad_spec(tmp_path, capsys):
    from isoloco_kernels.train.cli import main
    from isoloco_kernels.train.config import TrainConfig

    small = "-K 2 -H 2 -R 1 --batch 2 --seq-len 16 --eval-windows 8 --max-bytes 60000 --quiet --threads 1".split()
    out = tmp_path / "run"
    assert main(small + ["--mode", "isoloco", "--compress", "fp8:64:0.9", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["compress"] == "fp8:64:0.9" and res["modes"]["isoloco"]["compress"] == "fp8:64:0.9"
    with pytest.raises(ValueError, match="int3"):
        TrainConfig(compress="int3:128").validate()
    with pytest.raises(SystemExit):
        main(small + ["--mode", "diloco", "--compress", "int4:100", "--out", str(tmp_path / "bad")])
    assert "block" in capsys.readouterr().err


def _shared():
    base = torch.randn(2, 6, 5)
    return [torch.nn.Parameter(base[0]), torch.nn.Parameter(base[0])]  # one storage, twice


def _expanded():
    return [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(1, 5).expand(6, 5))]


def _inference():
    with torch.inference_mode():
        t = torch.randn(6, 5)
    return [torch.nn.Parameter(torch.randn(6, 5)), t]


@pytest.mark.parametrize(
    "make, match",
    [
        (_shared, r"param 0 .* and .*param 1 .* overlap in memory"),
        (_expanded, r"param 1 .*(overlap|expanded)"),
        (_inference, r"param 1 .*inference"),
    ],
    ids=["shared-storage", "expanded", "inference"],
)
def test_the_compressed_step_refuses_params_it_cannot_write_with_nothing_changed(make, match):
    """MergeLoCo(compress=...) checks what it writes before computing, as every other step does (before, a
    param sharing storage was written twice and an expanded one failed after earlier params were written)."""
    import isoloco_kernels as ik

    params = make()
    before = [p.detach().clone() for p in params]
    opt = ik.MergeLoCo(params, lr=1.0, momentum=0.0, merge="mean", compress="int8")
    deltas = [torch.randn(2, *p.shape) for p in params]
    with pytest.raises(RuntimeError, match=match):
        opt.step(deltas=deltas)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before)) and opt.merged_steps == 0


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_compressed_states_do_not_cross_between_mergeloco_and_sharded(one_rank_group):
    """A compressed MergeLoCo state (K simulated workers' residuals) is refused by ShardedIsoLoCo, and one rank's
    ShardedIsoLoCo state by MergeLoCo, each by name and with nothing loaded (before: the first loaded and dropped
    every residual silently, the second failed on a residual shape)."""
    import isoloco_kernels as ik

    def params():
        g = torch.Generator().manual_seed(3)
        return [torch.nn.Parameter(torch.randn(6, 5, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]

    merged = ik.MergeLoCo(params(), lr=1.0, momentum=0.8, merge="mean", compress="int8:128:0.9")
    merged.step(deltas=[torch.randn(2, *p.shape) for p in merged.param_groups[0]["params"]])
    sharded = ik.ShardedIsoLoCo(params(), lr=1.0, momentum=0.8, merge="mean", compress="int8:128:0.9")
    for p in sharded.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    sharded.step()
    before = {id(b): b.clone() for b in (s["momentum_buffer"] for s in sharded.state.values())}
    with pytest.raises(ValueError, match=r"compressed MergeLoCo's error-feedback residuals .* nothing was loaded"):
        sharded.load_state_dict(merged.state_dict())
    assert all(torch.equal(s["momentum_buffer"], before[id(s["momentum_buffer"])]) for s in sharded.state.values())
    with pytest.raises(ValueError, match=r"one rank's ShardedIsoLoCo state"):
        merged.load_state_dict(sharded.state_dict())


def test_a_finite_delta_whose_sum_overflows_is_an_overflow_not_an_inf_input():
    """K finite Δ near float32's largest values: their sum overflows float32 in the owner's mean. That is
    ResultOverflowError naming the param (the input was finite), with nothing changed."""
    import isoloco_kernels as ik

    p = torch.nn.Parameter(torch.zeros(4, 32))
    opt = ik.MergeLoCo([p], lr=1.0, momentum=0.0, merge="mean", compress="int8")
    deltas = [torch.full((3, 4, 32), 0.9 * torch.finfo(torch.float32).max)]
    with pytest.raises(
        ik.ResultOverflowError, match=r"the mean of the workers' decompressed Δ of param 0 .* overflows"
    ):
        opt.step(deltas=deltas)
    assert not p.detach().any() and opt.merged_steps == 0


@pytest.mark.slow
def test_the_loop_applies_a_skip_rule_by_name_and_counts_it():
    """--compress with a skip rule by name (the loop names the params, in both of iso_skip's groups too): it
    trains, and records the bytes of the kept params in float32 both ways and the rest compressed."""
    from isoloco_kernels.compress import model_exchange_bytes, parse
    from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode
    from isoloco_kernels.train.loop import memory_estimate

    corpus = load_corpus(max_bytes=60_000)
    spec = "stat2:256:skip=vectors+name=tok.+name=head."
    cfg = TrainConfig(**SMALL, compress=spec, iso_skip=("blocks.0.",))
    got = run_mode("isoloco", Setup(cfg, corpus))
    assert "diverged" not in got and all(math.isfinite(x) for x in got["heldout_loss"])
    named = list(Setup(cfg, corpus).model().named_parameters())
    shapes, names = [p.shape for _, p in named], [n for n, _ in named]
    want = model_exchange_bytes(parse(spec), shapes, SMALL["workers"], names=names)
    assert got["bytes_per_worker_per_round"] == want
    assert want > model_exchange_bytes(parse("stat2:256"), shapes, SMALL["workers"])  # the kept params cost more
    kept = sum(p.numel() for n, p in named if p.ndim < 2 or n.startswith(("tok.", "head.")))
    with_residuals = [
        memory_estimate(TrainConfig(**SMALL, compress=s), ["isoloco"], 2)
        for s in ("int4:128:0.95", "int4:128:0.95:skip=vectors+name=tok.+name=head.")
    ]
    assert with_residuals[0] - with_residuals[1] == 2 * 4 * kept  # each local worker's residual of a kept param


def test_the_loop_refuses_a_skip_name_that_matches_no_param():
    from isoloco_kernels.train import TrainConfig

    with pytest.raises(ValueError, match=r"skip name=tok_ matches no param of the model; its params: tok.weight"):
        TrainConfig(**SMALL, compress="stat2:256:skip=vectors+name=tok_").validate()
    TrainConfig(**SMALL, compress="stat2:256:skip=vectors+name=tok.").validate()
