"""The outer step's read budget and bounded workspace: what IsoLoCo.step reads for its checks
(grads and params once, a momentum buffer only when something other than the step wrote it),
and the flatten in slices of bounded scratch giving what the whole batch gives."""

from __future__ import annotations

import copy

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels import ops
from isoloco_kernels._validate import ResultOverflowError
from isoloco_kernels.flatten import registry as buckets
from isoloco_kernels.flatten import registry as flatten
from isoloco_kernels.reference import isoloco_step_ref
from tests.helpers import CheckReads, rel_err

GROWS = torch.tensor([[-1, 1, 1, 1], [-1, 1, 0.4, 0.4], [-0.8, 1, 1, -1], [-0.5, 1, -1, 1]], dtype=torch.float64)
METHODS = [m for m in flatten.METHODS if m != "auto"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = _gen(seed)
    return [torch.randn(s, generator=g) for s in ((6, 10), (10, 6), (6, 10), (7,), (3, 3, 2))]


def _grads(ps, seed: int) -> None:
    g = _gen(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 0.1


@pytest.mark.parametrize("iso", [False, True], ids=["sgd", "iso"])
def test_step_reads_grads_and_params_once_and_its_own_buffers_not_at_all(monkeypatch, iso):
    ps = _params()
    opt = ik.IsoLoCo(ps, lr=0.7, momentum=0.9, iso=iso, method="svd")
    reads = CheckReads(monkeypatch)
    size = sum(p.numel() for p in ps)
    for step in range(3):
        _grads(ps, 10 + step)
        reads.elements = 0
        opt.step()
        assert reads.elements == 2 * size, f"step {step}: read {reads.elements} elements, want grads + params"
    # a buffer written in place since the last step is read again; loaded buffers are all read
    opt.state[ps[3]]["momentum_buffer"].mul_(1.0)
    reads.elements = 0
    opt.step()
    assert reads.elements == 2 * size + ps[3].numel()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new buffer tensors: read
    reads.elements = 0
    opt.step()
    assert reads.elements == 3 * size
    reads.elements = 0
    opt.step()
    assert reads.elements == 2 * size


def test_steps_with_trusted_buffers_match_the_reference():
    ps = _params(1)
    want = [p.clone().double() for p in ps]
    bufs = [torch.zeros_like(w) for w in want]
    opt = ik.IsoLoCo(ps, lr=1.8, momentum=0.8, method="svd")
    for step in range(4):
        _grads(ps, 20 + step)
        want, bufs = isoloco_step_ref(want, bufs, [p.grad.double() for p in ps], 1.8, 0.8)
        opt.step()
    for p, w in zip(ps, want):
        assert rel_err(p, w) < 1e-5


def test_a_buffer_written_in_place_is_checked_again_with_nothing_written():
    ps = [torch.randn(4, 6, generator=_gen(2)), torch.randn(5, generator=_gen(3))]
    opt = ik.IsoLoCo(ps, lr=1.0, momentum=1.5)
    _grads(ps, 4)
    opt.step()
    buf = opt.state[ps[1]]["momentum_buffer"]
    buf[2] = float("nan")  # a write the optimizer did not make: its recorded bound no longer holds
    before = [p.clone() for p in ps] + [opt.state[p]["momentum_buffer"].clone() for p in ps]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*momentum_buffer.*NaN"):
        opt.step()
    after = ps + [opt.state[p]["momentum_buffer"] for p in ps]
    assert all(torch.equal(a, b) for a, b in zip(after[:2], before[:2]))
    assert torch.equal(after[2], before[2]) and torch.allclose(after[3], before[3], equal_nan=True)
    # finite but huge: 1.5 · 3e38 overflows float32, which only a fresh read of the buffer shows
    buf.fill_(3e38)
    before = [p.clone() for p in ps] + [opt.state[p]["momentum_buffer"].clone() for p in ps]
    with pytest.raises(ResultOverflowError, match=r"param_groups\[0\]\['params'\]\[1\].*overflows"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ps + [opt.state[p]["momentum_buffer"] for p in ps], before))


def test_a_loose_bound_is_checked_against_the_exact_largest_entry():
    g = _gen(5)
    P, B, U = ([torch.randn(9, generator=g)] for _ in range(3))
    want_p, want_b = P[0].clone(), B[0].clone()
    ops.prepare_nesterov_outer_([want_p], [want_b], U, 0.5, 0.9)()
    fn = ops.prepare_nesterov_outer_(P, B, U, 0.5, 0.9, amax=[None, 1e38, None])  # bound too loose to fit
    assert fn.amax[1] == float(B[0].abs().max())  # read once more, exactly
    fn()
    assert torch.equal(P[0], want_p) and torch.equal(B[0], want_b)


# ----------------------------------------------------------------------------------------------
# bounded workspace: the flatten in slices


@pytest.mark.parametrize("method", METHODS)
def test_chunked_flatten_gives_what_the_whole_batch_gives(method):
    x = torch.randn(5, 12, 20, generator=_gen(6))
    whole, sliced = x.clone(), x.clone()
    buckets.flatten_chunked_(whole, method, workspace=1 << 40)
    assert buckets.chunk_rows(method, x, 1) == 1
    buckets.flatten_chunked_(sliced, method, workspace=1)  # one matrix per call
    assert not torch.equal(whole, x)
    assert rel_err(sliced, whole) < 1e-6


def test_isoloco_step_with_a_tiny_workspace_matches_the_default(monkeypatch):
    runs = []
    for workspace in (None, "1"):
        if workspace:
            monkeypatch.setenv(buckets.WORKSPACE_ENV, workspace)
        ps = _params(7)
        opt = ik.IsoLoCo(ps, lr=1.8, momentum=0.8, method="eigh")
        for step in range(2):
            _grads(ps, 30 + step)
            opt.step()
        runs.append(ps)
    for a, b in zip(*runs):
        assert rel_err(a, b) < 1e-6


def test_workspace_env_is_checked(monkeypatch):
    monkeypatch.setenv(buckets.WORKSPACE_ENV, "lots")
    with pytest.raises(ValueError, match="ISOLOCO_WORKSPACE_BYTES must be a whole number of bytes"):
        buckets.workspace_bytes()


@pytest.mark.parametrize("bad_at", [0, 2], ids=["in-a-slice-aside", "in-the-slice-in-place"])
def test_iso_merge_in_slices_is_all_or_nothing(monkeypatch, bad_at):
    monkeypatch.setenv(buckets.WORKSPACE_ENV, "1")  # every matrix its own slice
    small = torch.randn(2, 3, 5, generator=_gen(8))
    big = (torch.rand(3, 4, 4, generator=_gen(9)) - 0.5).mul(6e4).to(torch.float16)
    big[bad_at] = (GROWS * 6e4).to(torch.float16)
    before = small.clone(), big.clone()
    with pytest.raises(ResultOverflowError, match=rf"bucket 1.*matrix {bad_at}\b.*(fit|overflow)"):
        ik.iso_merge_([small, big], method="svd")
    assert torch.equal(small, before[0]) and torch.equal(big, before[1])


def test_iso_merge_in_slices_gives_the_whole_result(monkeypatch):
    xs = [torch.randn(4, 6, 9, generator=_gen(10)), torch.randn(3, 8, 5, generator=_gen(11))]
    whole = [x.clone() for x in xs]
    ik.iso_merge_(whole, method="eigh")
    monkeypatch.setenv(buckets.WORKSPACE_ENV, "1")
    ik.iso_merge_(xs, method="eigh")
    for a, b in zip(xs, whole):
        assert rel_err(a, b) < 1e-6


# ----------------------------------------------------------------------------------------------
# the memory model


def _peak(fn) -> int:
    """Peak bytes fn allocates (torch's MemTracker), the isoloco ops' insides included: a dispatch mode
    sees a registered op as one call, so the op's own implementation runs under the tracker here."""
    from torch.distributed._tools.mem_tracker import MemTracker

    impls = {
        "isoloco::iso_merge_": ops._iso_merge_impl,
        "isoloco::iso_flatten_": ops._iso_flatten_,
        "isoloco::nesterov_outer_": ops._nesterov_outer_impl,
        "isoloco::iso_scale_": ops._iso_scale_impl,
    }

    class Inside(MemTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            impl = impls.get(func._schema.name)
            if impl is None:
                return super().__torch_dispatch__(func, types, args, kwargs)
            torch._C._push_on_torch_dispatch_stack(self)
            try:
                return impl(*args, **(kwargs or {}))
            finally:
                torch._C._pop_torch_dispatch_stack(None)

    mt = Inside()
    with mt:
        fn()
    return sum(v for per in mt.get_tracker_snapshot("peak").values() for k, v in per.items() if k == "Total")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("method", [m for m in METHODS if m in buckets.WORKSPACE_MODEL[torch.float32]])
@pytest.mark.parametrize("shape", [(2, 48, 160), (2, 160, 48), (2, 72, 72)], ids=["wide", "tall", "square"])
def test_the_workspace_model_bounds_the_measured_peak(method, dtype, shape):
    x = torch.randn(shape, generator=_gen(12)).to(dtype)
    measured = _peak(lambda: flatten.iso_flatten_impl(x, method))
    model = shape[0] * buckets.method_workspace(method, shape[1], shape[2], dtype)
    assert measured <= model, f"{method} {dtype} {shape}: measured {measured} B, modelled {model} B"


def test_isoloco_step_scratch_stays_within_the_workspace(monkeypatch):
    # 16 matrices of 32×256 (512 KiB of grads): eigh's scratch for all at once is ~5 MiB
    ps = [torch.randn(32, 256, generator=_gen(13 + i)) for i in range(16)]
    opt = ik.IsoLoCo(ps, lr=1.0, momentum=0.9, method="eigh")
    _grads(ps, 40)
    opt.step()  # bucket buffers and momentum made
    # MemTracker counts the tensors the step touches too: the momentum and the bucket buffers
    held = sum(b.numel() * 4 for b in (opt.state[p]["momentum_buffer"] for p in ps)) + opt._plan.nbytes
    per = buckets.method_workspace("eigh", 32, 256, torch.float32)
    monkeypatch.setenv(buckets.WORKSPACE_ENV, str(2 * per))
    _grads(ps, 41)
    peak = _peak(opt.step)
    assert peak <= held + 2 * per, f"peak {peak} B: held {held} B and a workspace of {2 * per} B"
    monkeypatch.delenv(buckets.WORKSPACE_ENV)
    _grads(ps, 42)
    assert _peak(opt.step) > held + 8 * per  # the whole bucket at once: the bound above is not trivial
