"""The fused TIES / DARE Triton kernel (isoloco_kernels/triton/sparse_merge.py) against the torch
path and the float64 definition. On a GPU it runs on CUDA; without one this file re-runs itself in
a fresh Python under TRITON_INTERPRET=1 (see tests/dispatch/test_triton.py for why). Small sizes: the
interpreter is slow. Outputs are poisoned (NaN) first, so unwritten elements show."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
pytest.importorskip("triton")

from isoloco_kernels.merges.options import resolve_options  # noqa: E402
from isoloco_kernels.merges.reference import merge_ref  # noqa: E402
from isoloco_kernels.merges.sparse import _merge_torch, cut_of, sparse_merge  # noqa: E402
from tests.helpers import gen, merge_tol, rel_err, rerun_under_interpreter  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE = "cuda" if CUDA else "cpu"
kernels = pytest.mark.skipif(not (CUDA or INTERPRETER), reason="needs CUDA or TRITON_INTERPRET=1")


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.skipif(CUDA or INTERPRETER, reason="the kernel tests run in this process")
def test_kernels_under_the_interpreter():
    rerun_under_interpreter(__file__, min_passed=12, timeout=600)


def _kernel_used(monkeypatch) -> list:
    from isoloco_kernels.triton import sparse_merge as km

    calls = []
    real = km.sparse_merge_triton
    monkeypatch.setattr(km, "sparse_merge_triton", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@kernels
@pytest.mark.parametrize(
    "method,opts",
    [
        ("ties", {}),
        ("ties", {"sparsity": 0.8}),
        ("dare", {"seed": 5}),
        ("dare", {"sparsity": 0.5, "disjoint": True}),
        ("ties", {"sparsity": 0.0}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_kernel_matches_torch_path_and_definition(monkeypatch, method, opts, dtype):
    calls = _kernel_used(monkeypatch)
    for K, shape in ((2, (37, 29)), (4, (5, 300)), (3, (1030,)), (1, (300,))):  # a partial block, 1-D, K = 1
        x = torch.randn(K, *shape, generator=gen((method, K, shape)), dtype=torch.float64).to(dtype).to(DEVICE)
        full = resolve_options(method, opts)
        got = sparse_merge(x, full, stack=2)
        assert torch.isfinite(got).all()
        ref = merge_ref(x.cpu(), method, stack=2, **opts)
        assert rel_err(got, ref) <= merge_tol(method, dtype), (method, K, shape, rel_err(got, ref))
    assert len(calls) == 4  # the kernel, not the torch loop, served every call


@kernels
def test_kernel_writes_every_element_and_scales_back():
    from isoloco_kernels.triton.sparse_merge import sparse_merge_triton

    x = torch.randn(3, 2500, generator=gen("poison"), device=DEVICE) * 1e30
    out = torch.full((2500,), float("nan"), device=DEVICE)
    thr = torch.zeros(3, device=DEVICE)
    sparse_merge_triton(x, out, thresholds=thr, keys=None, cut=0, inv_scale=2.0**-100, post=2.0**100, disjoint=False)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, x.mean(0), rtol=1e-6)
    ref = _merge_torch(
        x,
        torch.float32,
        {"prune": "random", "dim": "all", "disjoint": True},
        None,
        torch.tensor([11, 12, 13]),
        cut_of(0.3),
        1.0,
        1.0,
    )
    keys = torch.tensor([11, 12, 13], device=DEVICE)
    sparse_merge_triton(x, out, thresholds=None, keys=keys, cut=cut_of(0.3), inv_scale=1.0, post=1.0, disjoint=True)
    assert torch.equal(out.cpu(), ref.cpu())  # the same drops and arithmetic, bit for bit


@pytest.mark.skipif(INTERPRETER, reason="compiles real GPU code; the interpreter builds no kernels")
@pytest.mark.parametrize("capability", (80, 90), ids=lambda c: f"sm_{c}")
@pytest.mark.parametrize(
    "random,disjoint,dtype",
    [
        (False, True, torch.float32),
        (True, False, torch.bfloat16),
        (True, True, torch.float64),
        (False, False, torch.float16),
    ],
)
def test_kernel_compiles_for_gpus(monkeypatch, capability, random, disjoint, dtype):
    """Real GPU code, built without a GPU (the interpreter accepts code the compiler rejects):
    the uint32 hash, the constexpr K loop, float64 and half loads."""
    from isoloco_kernels.triton import sparse_merge as km
    from tests.dispatch.test_triton import _compile_launch, _launches

    cd = torch.float64 if dtype == torch.float64 else torch.float32
    x, out = torch.empty(4, 3000, dtype=dtype), torch.empty(3000, dtype=cd)
    thr, keys = torch.zeros(4, dtype=cd), torch.arange(4, dtype=torch.int64)
    (launch,) = _launches(
        monkeypatch,
        km,
        ["_sparse_merge_kernel"],
        lambda: km.sparse_merge_triton(
            x,
            out,
            thresholds=None if random else thr,
            keys=keys if random else None,
            cut=cut_of(0.1),
            inv_scale=0.5,
            post=2.0,
            disjoint=disjoint,
        ),
    )
    compiled, _ = _compile_launch(*launch, capability)
    assert compiled.asm["cubin"]
