"""The Nesterov momentum rule of every outer optimizer (outer/momentum.py): iso=False is torch.optim.SGD
(nesterov=True) bit for bit for any lr and μ set between steps or by torch's lr schedulers, half params
keep float32 momentum, μ = 0 with Nesterov is the plain step SGD refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import isoloco_kernels as ik
from isoloco_kernels.reference import sgd_nesterov_ref
from tests.helpers import gen, rel_err
from tests.outer.test_nd import _step_and_compare

# -- momentum 0 with Nesterov: accepted (plain averaging), where SGD refuses --------------------


@pytest.mark.usefixtures("one_thread")
def test_momentum_zero_with_nesterov_is_the_plain_step_sgd_refuses():
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0, momentum=0, nesterov=True)
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(5, 3))
    q = nn.Parameter(p.detach().clone())
    opt = ik.IsoLoCo([p], lr=0.7, momentum=0, nesterov=True, iso=False)
    sgd = torch.optim.SGD([q], lr=0.7, momentum=0)
    for _ in range(3):
        g = torch.randn(5, 3)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        sgd.step()
        assert torch.allclose(p, q, atol=1e-6)
    _step_and_compare(iso_nd=True, momentum=0.0)  # with Iso-C: θ ← θ − lr·iso(Δ)


def _three_params(dtype=torch.float32, key="contracts"):
    g = gen(key)
    shapes = [(7, 5), (4,), (3, 6)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


# -- 6. iso=False is torch.optim.SGD(nesterov=True) for any lr and μ set between steps ---------------


SCHEDULE = [(0.7, 0.9), (0.5, 0.0), (0.3, 0.0), (0.7, 0.5), (1.0, 0.9), (0.2, 0.0), (0.4, 0.8)]


def _sgd_twins(cls, dtype, kw=None):
    a = _three_params(dtype, "sgd-twins")
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
    params = _three_params(dtype, "half-schedule")
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
