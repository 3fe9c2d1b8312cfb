"""The outer optimizer step, side by side with torch.optim.SGD and the published composition.

test_nesterov — the update alone, over a whole model's parameters (2-D weights and 1-D norms),
fp32, DiLoCo's lr 0.7 / momentum 0.9, steady state (momentum buffers exist):
  fused              torch.ops.isoloco.nesterov_outer_(params, bufs, updates, lr, μ): the op checks its
                     input itself (reads p, buf and u once more: 8 passes, at best 62 % of copy)
  fused+bounds       the same op given `amax`, bounds the caller holds (the optimizers' route:
                     `outer.core.collect` found them): the five compulsory passes only
  sgd-foreach        torch.optim.SGD(nesterov=True, foreach=True)
  sgd-fused          torch.optim.SGD(nesterov=True, fused=True), where torch has it for the device
  sgd-forloop        torch.optim.SGD(nesterov=True, foreach=False)
All impls step the same params and buffers (SGD's momentum_buffer state is the shared buffer).
SGD's foreach Nesterov path adds μ·buf into p.grad in place, so the SGD impls step a copy of the
updates that an untimed setup restores before each round. Bytes: compulsory 5 × the params' size
(read p, buf, u; write p, buf).

test_outer_step — a whole IsoLoCo outer step (Iso-C of every 2-D pseudo-gradient, then Nesterov;
lr 1.8, μ 0.8) for every flatten method, beside:
  svd-loop+sgd       the published code's way: per 2-D weight U,S,V = svd(Δ), grad = U·mean(S)·Vᵀ,
                     then SGD(nesterov=True, foreach=True)
  sgd-foreach        DiLoCo's outer step (no Iso-C), for scale
"""

from __future__ import annotations

import pytest
import torch

from bench import harness
from bench.shapes import SETS, bucket_shapes, cpu_variant, decoder_param_shapes, pseudo_gradient
from isoloco_kernels.flatten import registry as flatten
from isoloco_kernels.reference import iso_flatten_ref, nesterov_ref

NESTEROV_IMPLS = ("fused", "fused+bounds", "sgd-foreach", "sgd-fused", "sgd-forloop")
#: fused+bounds' amax: a bound above every entry of the benchmark's tensors (|p| ~ 0.1, |buf|, |u| ~ 1e-3)
#: for as many rounds as any run takes (each moves p by ~1e-3), and small enough that the op sees every
#: update fits float32 without reading anything.
BOUND = 1e3
DILOCO_LR, DILOCO_MU = 0.7, 0.9
ISOLOCO_LR, ISOLOCO_MU = 1.8, 0.8

METHODS = tuple(m for m in flatten.METHODS if m != "auto") + ("auto",)
STEP_IMPLS = tuple(f"isoloco-{m}" for m in METHODS) + ("svd-loop+sgd", "sgd-foreach")
EXACT = {"svd", "eigh", "svd-loop"}
# The quick run (no --bench-full) times whole outer steps on ref-tiny only: on llama-tiny they take
# a minute on a 2-core CPU, and test_flatten / test_nesterov time both halves of the step there.
STEP_FULL_ONLY = {"llama-tiny"}

# The Nesterov cases hold 3 fp32 copies of the model: llama-1b (19 GB) does not fit the CPU
# machines this runs on next to other jobs.
NESTEROV_CPU_MAX_PARAMS = 400_000_000
ERROR_SANITY = 0.25  # as in test_bench_flatten.py: catches garbage, accuracy is tests/'s job


def _sgd_kwargs(kind: str) -> dict:
    return {"foreach": {"foreach": True}, "fused": {"fused": True}, "forloop": {"foreach": False}}[kind]


def _make_nesterov(impl: str, ps, bs, us):
    """(step, reset) for `impl` over params ps with momentum buffers bs (in place) and updates us."""
    if impl == "fused":
        return lambda: torch.ops.isoloco.nesterov_outer_(ps, bs, us, DILOCO_LR, DILOCO_MU), None
    if impl == "fused+bounds":
        bounds = [BOUND] * (3 * len(ps))
        return lambda: torch.ops.isoloco.nesterov_outer_(ps, bs, us, DILOCO_LR, DILOCO_MU, bounds), None
    kind = impl.removeprefix("sgd-")
    opt = torch.optim.SGD(ps, lr=DILOCO_LR, momentum=DILOCO_MU, nesterov=True, **_sgd_kwargs(kind))
    for p, b in zip(ps, bs):
        opt.state[p]["momentum_buffer"] = b
    # SGD(nesterov=True, foreach=True) adds μ·buf into p.grad in place, so each SGD impl steps its
    # own copy of the updates, restored (untimed) before every round.
    grads = [u.clone() for u in us]
    for p, g in zip(ps, grads):
        p.grad = g

    def reset():
        torch._foreach_copy_(grads, us)

    return opt.step, reset


_CACHE: dict = {}


def _cached(kind: str, spec, device: torch.device, seed: int, make) -> dict:
    """make(shapes, params, generator) for one model's shapes, kept until another model is asked for
    (one model resident at a time)."""
    key = (kind, spec.name, spec.layers, spec.embeddings, device.type)
    if key not in _CACHE:
        _CACHE.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        gen = torch.Generator(device=device).manual_seed(seed)
        shapes = [s for _, s in decoder_param_shapes(spec)]
        ps = [torch.randn(s, generator=gen, device=device) * 0.02 for s in shapes]
        _CACHE[key] = {"shapes": shapes, "ps": ps, **make(shapes, gen)}
    return _CACHE[key]


def _model_state(spec, device: torch.device) -> dict:
    """Params, momentum buffers and updates (pseudo-gradients) of one model."""

    def make(shapes, gen):
        bs = [torch.randn(s, generator=gen, device=device) * 1e-3 for s in shapes]
        us = [torch.randn(s, generator=gen, device=device) * 1e-3 for s in shapes]
        return {"bs": bs, "us": us}

    return _cached("nesterov", spec, device, 7, make)


def _nesterov_error(impl: str, st: dict) -> float:
    """Error of one step on a sample (the first 2-D and the first 1-D tensor) vs reference.py."""
    idx = [
        next(i for i, s in enumerate(st["shapes"]) if len(s) == 2),
        next(i for i, s in enumerate(st["shapes"]) if len(s) == 1),
    ]
    ps = [st["ps"][i].clone() for i in idx]
    bs = [st["bs"][i].clone() for i in idx]
    us = [st["us"][i].clone() for i in idx]
    u0 = [u.clone() for u in us]
    p0, b0 = [p.clone() for p in ps], [b.clone() for b in bs]
    step, reset = _make_nesterov(impl, ps, bs, us)
    if reset:
        reset()
    step()
    outs, refs = [], []
    for k in range(len(idx)):
        rp, rb = nesterov_ref(p0[k], b0[k], u0[k].to("cpu", torch.float64), DILOCO_LR, DILOCO_MU)
        p064 = p0[k].to("cpu", torch.float64)
        outs += [ps[k].to("cpu", torch.float64) - p064, bs[k]]  # the step Δp, and the new buffer
        refs += [rp - p064, rb]
    return harness.rel_fro(outs, refs)[0]


def _timed(benchmark, group: str, step, reset, device, bench_seconds: float, may_compile: bool):
    """(median, first call's seconds, its peak extra memory) of `step` in benchmark group
    "<group> <device>": one untimed call, then the timed rounds, `reset()` untimed before each."""

    def target():
        step()
        harness.sync(device)

    reset()
    harness.sync(device)
    first_s, mem = harness.peak_extra_memory(target, device)
    benchmark.group = f"{group} {device.type}"
    median = harness.run_timed(
        benchmark, target, reset, device=device, seconds=bench_seconds, first_s=first_s, may_compile=may_compile
    )
    return median, first_s, mem


@pytest.mark.parametrize("impl", NESTEROV_IMPLS)
@pytest.mark.parametrize("set_name", list(SETS))
@pytest.mark.parametrize("device", ["cpu", "cuda"], indirect=True)
def test_nesterov(benchmark, impl, set_name, device, bench_seconds, ceilings):
    spec = SETS[set_name]
    if device.type == "cpu" and spec.n_params > NESTEROV_CPU_MAX_PARAMS:
        pytest.skip(f"{set_name}: 3 fp32 copies of {spec.n_params / 1e9:.1f}B params do not fit the CPU run")
    st = _model_state(spec, device)
    try:
        step, reset = _make_nesterov(impl, st["ps"], st["bs"], st["us"])
        err = _nesterov_error(impl, st)
    except (RuntimeError, ValueError) as e:
        if impl == "sgd-fused":
            pytest.skip(f"torch.optim.SGD(fused=True) is not available on {device.type}: {e}")
        raise

    median, first_s, _ = _timed(
        benchmark, f"nesterov {set_name}", step, reset or (lambda: None), device, bench_seconds, device.type == "cuda"
    )
    n = sum(p.numel() for p in st["ps"])
    nbytes = 5.0 * n * 4
    for p in st["ps"]:
        p.grad = None
    harness.describe(
        benchmark,
        "nesterov",
        impl,
        set_name,
        spec,
        device,
        "fp32",
        n_tensors=len(st["ps"]),
        n_params=n,
        bytes=nbytes,
        flops=None,
        err_rel_fro=err,
        err_sample="one step on the first 2-D and 1-D tensor: Δp and the new buffer",
        first_call_s=first_s,
        **harness.roofline_and_rates(median, None, nbytes, ceilings(device)),
    )
    assert err == err, f"{impl}: NaN"
    assert err <= 1e-4, f"{impl} on {set_name}: step error {err:.3g} vs reference.py (fp32 update)"


# ----------------------------------------------------------------------------------------------
# the whole outer step


def _outer_state(spec, device: torch.device) -> dict:
    """Params and pseudo-gradients of one model (the matrices' with a real spectrum)."""

    def make(shapes, gen):
        grads = [
            pseudo_gradient(1, *s, dtype=torch.float32, device=device, seed=2000 + i)[0]
            if len(s) == 2
            else torch.randn(s, generator=gen, device=device) * 1e-3
            for i, s in enumerate(shapes)
        ]
        return {"grads": grads}

    return _cached("outer", spec, device, 11, make)


def _make_outer(impl: str, ps, grads):
    """(step, reset) of one outer step of `impl` over params ps whose pseudo-gradients are grads
    (never modified: SGD, which writes into p.grad, steps copies that reset() restores)."""
    if impl.startswith("isoloco-"):
        from isoloco_kernels.optim.isoloco import IsoLoCo

        opt = IsoLoCo(ps, lr=ISOLOCO_LR, momentum=ISOLOCO_MU, method=impl.removeprefix("isoloco-"))
        for p, g in zip(ps, grads):
            p.grad = g
        return opt.step, lambda: None
    lr, mu = (DILOCO_LR, DILOCO_MU) if impl == "sgd-foreach" else (ISOLOCO_LR, ISOLOCO_MU)
    opt = torch.optim.SGD(ps, lr=lr, momentum=mu, nesterov=True, foreach=True)
    own = [g.clone() for g in grads]

    def reset():
        for p, g in zip(ps, own):
            p.grad = g
        torch._foreach_copy_(own, list(grads))

    if impl == "sgd-foreach":
        return opt.step, reset
    pairs = [(p, g) for p, g in zip(ps, own) if g.ndim == 2]

    def step():
        for p, g in pairs:
            u, s, vh = torch.linalg.svd(g, full_matrices=False)
            p.grad = (u * s.mean()) @ vh
        opt.step()

    return step, reset


def _outer_error(impl: str, st: dict) -> tuple[float, str]:
    """First-step error on a sample (first 2-D param of each shape and one 1-D) vs reference.py."""
    seen, idx = set(), []
    for i, s in enumerate(st["shapes"]):
        key = tuple(sorted(s))
        if key not in seen and (len(s) == 1 or max(s) * min(s) ** 2 <= 5e10):
            seen.add(key)
            idx.append(i)
    ps = [st["ps"][i].clone() for i in idx]
    gs = [st["grads"][i].clone() for i in idx]
    p0 = [p.clone() for p in ps]
    step, reset = _make_outer(impl, ps, gs)
    reset()
    step()
    iso = impl != "sgd-foreach"
    lr, mu = (DILOCO_LR, DILOCO_MU) if not iso else (ISOLOCO_LR, ISOLOCO_MU)
    ref_cache = st.setdefault("iso_ref", {})
    outs, refs = [], []
    for i, p, q0, g in zip(idx, ps, p0, gs):
        if iso and g.ndim == 2:
            if i not in ref_cache:
                ref_cache[i] = iso_flatten_ref(g)
            m = ref_cache[i]
        else:
            m = g.to("cpu", torch.float64)
        rp, _ = nesterov_ref(q0, torch.zeros_like(q0), m, lr, mu)
        q64 = q0.to("cpu", torch.float64)
        outs.append(p.to("cpu", torch.float64) - q64)
        refs.append(rp - q64)
    return harness.rel_fro(outs, refs)[0], f"first step Δp of {len(idx)} params (one per shape)"


@pytest.mark.parametrize("impl", STEP_IMPLS)
@pytest.mark.parametrize(
    "set_name", [pytest.param(s, marks=pytest.mark.bench_full) if s in STEP_FULL_ONLY else s for s in SETS]
)
@pytest.mark.parametrize("device", ["cpu", "cuda"], indirect=True)
def test_outer_step(benchmark, impl, set_name, device, bench_seconds, ceilings):
    spec = SETS[set_name]
    if device.type == "cpu":
        if cpu_variant(spec) is not spec:
            pytest.skip(
                f"{set_name}: outer steps run on the CPU for the unscaled sets only (the "
                "flatten of the scaled one is timed in test_flatten)"
            )
        if impl.endswith("_bf16"):
            pytest.skip(f"{impl}: bf16 GEMMs have no fast path on this CPU; GPU only")
    if impl.startswith("isoloco-"):
        pytest.importorskip("isoloco_kernels.optim", reason="IsoLoCo optimizer not available")
    shapes2d = bucket_shapes(s for _, s in decoder_param_shapes(spec) if len(s) == 2)
    method = impl.removeprefix("isoloco-") if impl.startswith("isoloco-") else impl.removesuffix("+sgd")
    resolved = harness.resolved_backends(method, shapes2d, device)
    if device.type == "cuda" and set_name == "llama-1b" and set(resolved) & EXACT:
        pytest.skip(f"{impl} on llama-1b: minutes per call on a GPU, beyond the device script's budget")
    if device.type == "cuda" and spec.n_params > 100e6 and impl.startswith("isoloco-") and set(resolved) <= EXACT:
        pytest.skip(
            f"{impl} on {set_name}: exact flatten methods are timed in test_flatten; on big "
            "sets the GPU run spends its budget on the matmul methods and the svd-loop baseline"
        )

    st = _outer_state(spec, device)
    err, sample = _outer_error(impl, st)
    ps = [p.clone() for p in st["ps"]]  # the timed steps move these, never the cached params
    step, reset = _make_outer(impl, ps, st["grads"])

    may_compile = device.type == "cuda" and not set(resolved) <= EXACT
    median, first_s, mem = _timed(benchmark, f"outer step {set_name}", step, reset, device, bench_seconds, may_compile)
    n = sum(p.numel() for p in ps)
    n2 = sum(b * m * k for b, m, k in shapes2d)
    iso = impl != "sgd-foreach"
    nbytes = 5.0 * n * 4 + (2.0 * n2 * 4 if iso else 0.0)  # Nesterov + the flatten's read/write
    flops = harness.flatten_work(resolved, shapes2d, "fp32") if iso else None
    harness.describe(
        benchmark,
        "outer_step",
        impl,
        set_name,
        spec,
        device,
        "fp32",
        resolved=resolved,
        buckets=[list(s) for s in shapes2d],
        n_params=n,
        bytes=nbytes,
        flops=flops,
        err_rel_fro=err,
        err_sample=sample,
        first_call_s=first_s,
        **mem,
        **harness.roofline_and_rates(median, flops, nbytes, ceilings(device)),
    )
    assert err == err, f"{impl}: NaN"
    if not impl.endswith("_bf16"):
        assert err <= ERROR_SANITY, f"{impl} on {set_name}: step error {err:.3g} vs reference.py"
