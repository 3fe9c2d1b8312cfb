"""The one-triangle symmetric product (isoloco_kernels/triton/sym_gram.py) against torch's full GEMM:
every shape class (r = 1, r below / across / at a multiple of the tile, k below the K tile, batched,
transposed and strided views), every operand dtype, the β·B + γ·I epilogue, exact symmetry, and the
polar iteration on its step pieces against polar.TorchSteps. On a GPU on CUDA; without one this file
re-runs itself under TRITON_INTERPRET=1 (tests/dispatch/test_triton.py says why). The kernel also compiles for
sm_80 and sm_90 here, for every specialization a launch can take."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
pytest.importorskip("triton")

from tests.helpers import gen, rel_err, rerun_under_interpreter  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
kernels = pytest.mark.skipif(not (CUDA or INTERPRETER), reason="needs CUDA or TRITON_INTERPRET=1")
# float32 products (IEEE) to a few ulps of the sum; bfloat16 / float16 operands are rounded the same
# way on both sides (torch's GEMM reads the same rounded values), so only accumulation order differs
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.skipif(CUDA or INTERPRETER, reason="the kernel tests run in this process")
def test_kernels_under_the_interpreter():
    rerun_under_interpreter(__file__, min_passed=20, timeout=600)


def _ref(x, alpha=1.0, b=None, beta=0.0, gamma=0.0):
    x64 = x.double()
    out = alpha * x64 @ x64.mT
    if b is not None:
        out = out + beta * b.double()
    return out + gamma * torch.eye(x.shape[1], dtype=torch.float64, device=x.device)


SHAPES = {
    "1xk": (2, 1, 40),
    "r<tile": (3, 17, 50),
    "r across tiles": (2, 70, 33),
    "r = 2 tiles": (1, 128, 64),
    "k < K tile": (2, 90, 5),
    "square": (2, 65, 65),
}


@kernels
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_sym_gram_matches_torch_and_is_symmetric(dtype, shape):
    from isoloco_kernels.triton.sym_gram import sym_gram

    x = torch.randn(shape, generator=gen(("sym", shape)), dtype=torch.float64).to(dtype).to(DEVICE)
    out = sym_gram(x)
    assert out.dtype == torch.float32 and out.shape == (shape[0], shape[1], shape[1])
    assert torch.equal(out, out.mT)  # exactly: each entry above the diagonal is a copy
    assert rel_err(out, _ref(x)) <= TOL[dtype]


@kernels
@pytest.mark.parametrize("view", ["transposed", "strided", "batch-strided"])
def test_sym_gram_reads_any_strides(view):
    from isoloco_kernels.triton.sym_gram import sym_gram

    base = torch.randn(3, 80, 150, generator=gen(("sym-view", view))).to(DEVICE)
    x = {"transposed": base[:, :, :40].mT, "strided": base[:, ::2, ::3], "batch-strided": base[::2]}[view]
    assert not x.is_contiguous()
    assert rel_err(sym_gram(x), _ref(x)) <= TOL[torch.float32]


@kernels
def test_the_epilogue_forms_the_polynomial_in_one_kernel():
    """a·I + b·A + c·A² for a symmetric A: the polar step's matrix, one launch."""
    from isoloco_kernels.triton.sym_gram import sym_gram

    x = torch.randn(2, 70, 90, generator=gen("sym-poly")).to(DEVICE)
    a_mat = (x @ x.mT) / 90
    got = sym_gram(a_mat, alpha=0.375, b=a_mat, beta=-1.25, gamma=1.875)
    assert torch.equal(got, got.mT)
    assert rel_err(got, _ref(a_mat, 0.375, a_mat, -1.25, 1.875)) <= TOL[torch.float32]
    empty_k = sym_gram(torch.zeros(2, 5, 0, device=DEVICE), b=a_mat[:, :5, :5], beta=2.0, gamma=1.0)
    assert torch.allclose(empty_k, 2 * a_mat[:, :5, :5] + torch.eye(5, device=DEVICE))


@kernels
def test_the_polar_iteration_on_its_pieces_matches_torch():
    """polar.polar_factor with SymSteps (every symmetric product one-triangle) against TorchSteps."""
    from isoloco_kernels.flatten import polar
    from isoloco_kernels.triton.sym_gram import SymSteps

    x = torch.randn(3, 48, 160, generator=gen("sym-polar")).to(DEVICE)
    want, _ = polar.polar_factor(x, steps=polar.TorchSteps)
    got, resid = polar.polar_factor(x, steps=SymSteps)
    assert rel_err(got, want) <= 1e-5
    assert float(resid.max()) <= polar.CHECK_TOL


@kernels
def test_bad_arguments_are_refused_by_name():
    from isoloco_kernels.triton.sym_gram import sym_gram

    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        sym_gram(torch.zeros(1, 3, 4, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="precision must be one of"):
        sym_gram(torch.zeros(1, 3, 4, device=DEVICE), precision="tf64")
    with pytest.raises(ValueError, match=r"B must be \[1, 3, 3\]"):
        sym_gram(torch.zeros(1, 3, 4, device=DEVICE), b=torch.zeros(1, 4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="expected X"):
        sym_gram(torch.zeros(3, 4, device=DEVICE))


@pytest.mark.skipif(INTERPRETER, reason="compiles real GPU code; the interpreter builds no kernels")
@pytest.mark.parametrize("capability", (80, 90), ids=lambda c: f"sm_{c}")
@pytest.mark.parametrize(
    "dtype,precision,with_b",
    [(torch.float32, "ieee", False), (torch.float32, "tf32x3", True), (torch.bfloat16, "ieee", True)],
    ids=["f32-ieee", "f32-tf32x3-poly", "bf16-poly"],
)
def test_the_kernel_compiles_for_tensor_core_gpus(monkeypatch, capability, dtype, precision, with_b):
    from isoloco_kernels.triton import sym_gram as sg
    from tests.dispatch.test_triton import _compile_launch, _launches

    x = torch.empty(2, 100, 300, dtype=dtype)
    b = torch.empty(2, 100, 100) if with_b else None
    launches = _launches(monkeypatch, sg, ["_sym_kernel"], lambda: sg.sym_gram(x, b=b, beta=1.0, precision=precision))
    for kernel, args, kw in launches:
        compiled, _ = _compile_launch(kernel, args, kw, capability)
        assert compiled.asm["cubin"]


@kernels
def test_fast_on_one_triangle_products_keeps_its_contract():
    """fast's direct route with sym="triton" (its bfloat16 steps' symmetric products one-triangle)
    against the same route on torch's GEMMs: the same certificate decisions, results within the
    bfloat16 steps' noise, and both inside fast's band."""
    from isoloco_kernels.flatten import fast
    from isoloco_kernels.reference import iso_flatten_ref
    from tests.helpers import FLATNESS, flatness, method_tol, spectrum, with_spectrum

    x = with_spectrum(2, 40, 110, spectrum("geometric", 40, 1e2), gen("sym-fast")).float().to(DEVICE)
    outs = {}
    for sym in fast.SYM_GEMMS:
        y = x.clone()
        fast.flatten_fast_(y, route="direct", low=torch.bfloat16, sym=sym)
        outs[sym] = y
        assert flatness(y.cpu(), x.cpu()) <= FLATNESS["fast"]
        assert rel_err(y.cpu(), iso_flatten_ref(x.cpu())) <= method_tol("fast", torch.float32, 1e2)
    assert rel_err(outs["triton"], outs["torch"]) <= 2e-2
    y = x.double()  # float64 steps (which sym_gram does not take) stay on torch's GEMMs
    fast.flatten_fast_(y, route="direct", sym="triton")
    assert rel_err(y.cpu(), iso_flatten_ref(x.double().cpu())) <= method_tol("fast", torch.float64, 1e2)
    with pytest.raises(ValueError, match="sym must be one of"):
        fast.flatten_fast_(x.clone(), route="direct", sym="cublas")


@pytest.mark.skipif(CUDA or INTERPRETER, reason="Triton can run here")
def test_fast_refuses_triton_products_where_triton_cannot_run():
    from isoloco_kernels.flatten import fast

    with pytest.raises(RuntimeError, match="sym='triton' cannot run on this cpu tensor"):
        fast.flatten_fast_(torch.randn(1, 4, 6), route="direct", sym="triton")
