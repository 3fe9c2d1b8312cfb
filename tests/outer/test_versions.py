"""The Nesterov update bumps the version counters of what it writes, as every in-place torch op
does: autograd refuses a backward through a param it changed (as with torch.optim.SGD), and a
momentum buffer shared by two optimizers is never trusted as unchanged by the one that did not
write it last (momentum._trusted_bound reads the counter)."""

from __future__ import annotations

import pytest
import torch

from isoloco_kernels import IsoLoCo, ResultOverflowError


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_op_bumps_what_it_writes(dtype):
    p, b, u = torch.zeros(5, dtype=dtype), torch.zeros(5, dtype=dtype), torch.ones(5, dtype=dtype)
    before = (p._version, b._version, u._version)
    torch.ops.isoloco.nesterov_outer_([p], [b], [u], 0.1, 0.9, None)
    assert p._version > before[0] and b._version > before[1] and u._version == before[2]


@pytest.mark.parametrize("iso", [False, True])
def test_backward_through_a_param_the_step_changed_is_refused_as_with_sgd(iso):
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), lambda ps: IsoLoCo(ps, iso=iso)):
        x = torch.nn.Parameter(torch.ones(3, 4))
        y = (x * x).sum()
        opt = make([x])
        x.grad = torch.ones(3, 4)
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


def test_a_buffer_shared_by_two_optimizers_is_read_again_after_the_other_wrote_it():
    """opt2 recorded a bound on the shared buffer; opt1 then wrote 8e37 into it. opt2's next step
    must see that (its update overflows float32) and refuse with nothing changed, not write -inf."""
    p1, p2 = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    opt1 = IsoLoCo([p1], lr=0.0, momentum=0.9, iso=False)
    opt2 = IsoLoCo([p2], lr=1e37, momentum=0.9, iso=False)
    p1.grad = torch.zeros(4)
    opt1.step()
    opt2.load_state_dict(opt1.state_dict())  # SGD's semantics: the buffer object is shared
    opt2.param_groups[0]["lr"] = 1e37
    assert opt2.state[p2]["momentum_buffer"] is opt1.state[p1]["momentum_buffer"]
    p2.grad = torch.full((4,), 1e-37)
    opt2.step()
    p1.grad = torch.full((4,), 8e37)
    opt1.step()
    p2.grad = torch.full((4,), 1e-37)
    keep = p2.detach().clone()
    with pytest.raises(ResultOverflowError, match="overflow"):
        opt2.step()
    assert torch.equal(p2.detach(), keep)


def test_a_write_marked_with_increment_version_is_read_again():
    """The remedy docs/guarantees.md gives for writes that bypass the version counter (a NumPy
    view here; torch.distributed collectives into the buffer alike): mark the write, and the next
    step reads the buffer and refuses its NaN by name, with nothing changed."""
    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = IsoLoCo([p], lr=0.5, momentum=0.9)
    p.grad = torch.randn(8, 4)
    opt.step()
    buf = opt.state[p]["momentum_buffer"]
    buf.numpy()[0, 0] = float("nan")  # bypasses the version counter
    torch.autograd.graph.increment_version(buf)
    p.grad = torch.randn(8, 4)
    keep = p.detach().clone()
    with pytest.raises(ValueError, match=r"momentum_buffer: the matrix contains NaN"):
        opt.step()
    assert torch.equal(p.detach(), keep)
