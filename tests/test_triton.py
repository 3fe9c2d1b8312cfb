"""The Triton kernels (isoloco_kernels/triton) against torch / reference.py.

With a GPU they run on CUDA. Without one they run under Triton's interpreter, which must be chosen
before triton is first imported (triton reads TRITON_INTERPRET when its own library functions are
decorated, at import). So in an ordinary CPU pytest process the kernel tests skip and
`test_kernels_under_the_interpreter` re-runs this file in a fresh Python with TRITON_INTERPRET=1;
other tests in the parent process never see the variable. The interpreter has no bfloat16
tl.dot, so GEMM kernels are tested in float32/float16 there; sizes stay small (it is slow).
Outputs are poisoned (NaN) before kernels run, so unwritten elements show.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
triton = pytest.importorskip("triton")

from isoloco_kernels import polar  # noqa: E402
from isoloco_kernels.reference import iso_flatten_ref, polar_ref  # noqa: E402
from tests.helpers import TOL, rel_err, spectrum, with_spectrum  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(CUDA or INTERPRETER, reason="the kernel tests run in this process")
def test_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        env=env, cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=900,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 25, tail  # the kernel tests really ran
    assert "failed" not in proc.stdout.splitlines()[-1], tail


def _compile_sm90(fn, signature: dict, constexprs: dict) -> int:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return len(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"])


@pytest.mark.skipif(INTERPRETER, reason="compiles real GPU code; the interpreter builds no kernels")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts things the compiler rejects: build the real cubins (ptxas ships with
    triton), for the dtypes the polar path and the epilogue launch."""
    from isoloco_kernels.experimental import triton_gram as gram, triton_polar_steps as polar_step
    from isoloco_kernels.triton import iso_scale

    i32 = "i32"
    st = lambda *names: {n: i32 for n in names}  # noqa: E731
    for dt in ("fp32", "bf16"):
        assert _compile_sm90(gram._gram_kernel, {"x_ptr": f"*{dt}", "a_ptr": f"*{dt}", **st("M", "K", "sxb", "sxm", "sxk", "sab", "sam", "san")},
                             {"BLOCK_M": 64, "BLOCK_K": 32, "PRECISION": "ieee", "INT64": False}) > 0
        assert _compile_sm90(polar_step._poly_kernel, {"a_ptr": f"*{dt}", "out_ptr": f"*{dt}", "M": i32, "coef_b": "fp32", "coef_c": "fp32",
                                                       **st("sab", "sam", "san", "sob", "som", "son")},
                             {"BLOCK_M": 64, "BLOCK_K": 32, "HAS_LINEAR": True, "PRECISION": "ieee", "INT64": False}) > 0
        assert _compile_sm90(polar_step._step_kernel, {"x_ptr": f"*{dt}", "b_ptr": f"*{dt}", "out_ptr": f"*{dt}", "M": i32, "N": i32, "coef_a": "fp32",
                                                       **st("sxb", "sxm", "sxn", "sbb", "sbm", "sbn", "sob", "som", "son")},
                             {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "PRECISION": "ieee", "INT64": False}) > 0
    # one matrix of 2^31 elements or more: the 64-bit-offset variants build too
    assert _compile_sm90(gram._gram_kernel, {"x_ptr": "*fp32", "a_ptr": "*fp32", **st("M", "K", "sxb", "sab", "sam", "san"),
                                             "sxm": "i64", "sxk": i32},
                         {"BLOCK_M": 64, "BLOCK_K": 32, "PRECISION": "ieee", "INT64": True}) > 0
    assert _compile_sm90(polar_step._poly_kernel, {"a_ptr": "*fp32", "out_ptr": "*fp32", "M": i32, "coef_b": "fp32", "coef_c": "fp32",
                                                   **st("sab", "sam", "san", "sob", "som", "son")},
                         {"BLOCK_M": 64, "BLOCK_K": 32, "HAS_LINEAR": True, "PRECISION": "ieee", "INT64": True}) > 0
    assert _compile_sm90(polar_step._step_kernel, {"x_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*fp32", "M": i32, "N": i32, "coef_a": "fp32",
                                                   **st("sxb", "sxm", "sxn", "sbb", "sbm", "sbn", "sob", "som", "son")},
                         {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "PRECISION": "ieee", "INT64": True}) > 0
    for dt, acc in (("bf16", "fp32"), ("fp64", "fp64")):
        strides = st("N", "NUMEL", "S", "sxb", "sxm", "sxn", "sqb", "sqm", "sqn")
        assert _compile_sm90(iso_scale._iso_dot_kernel, {"x_ptr": f"*{dt}", "q_ptr": "*fp32", "part_ptr": f"*{acc}", **strides},
                             {"BLOCK": 1024, "ACC_F64": acc == "fp64"}) > 0
        assert _compile_sm90(iso_scale._iso_write_kernel, {"x_ptr": f"*{dt}", "q_ptr": "*fp32", "part_ptr": f"*{acc}", "sbar_ptr": f"*{acc}",
                                                           **strides, "R0": i32},
                             {"BLOCK": 1024, "S_POW2": 256}) > 0


@pytest.mark.skipif(INTERPRETER, reason="compiles real GPU code; the interpreter builds no kernels")
def test_iso_scale_divides_by_integer_r0_in_float64_for_float64_input():
    """A Python float argument is typed fp32 by Triton, so 1/min(m, n) passed as one put ~1e-8
    relative error into a float64 s̄ (the interpreter hides it). r0 goes in as an integer and
    the division happens in the accumulator dtype: the compiled kernel takes an i32 and divides
    in f64."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from isoloco_kernels.triton import iso_scale

    params = inspect.signature(iso_scale._iso_write_kernel.fn).parameters
    assert "R0" in params and "inv_r0" not in params
    sig = {"x_ptr": "*fp64", "q_ptr": "*fp32", "part_ptr": "*fp64", "sbar_ptr": "*fp64",
           **{k: "i32" for k in ("N", "NUMEL", "S", "R0", "sxb", "sxm", "sxn", "sqb", "sqm", "sqn")},
           "BLOCK": "constexpr", "S_POW2": "constexpr"}
    src = ASTSource(fn=iso_scale._iso_write_kernel, signature=sig, constexprs={"BLOCK": 1024, "S_POW2": 256})
    ttir = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttir"]
    assert re.search(r"arith\.divf .*: f64", ttir), ttir
    assert re.search(r"arith\.sitofp .*i32 to f64", ttir), ttir


needs_kernels = pytest.mark.skipif(
    not (CUDA or INTERPRETER), reason="Triton kernels need a GPU or TRITON_INTERPRET=1 from process start"
)


@pytest.fixture(scope="module")
def tk():
    """(gram, polar_step, iso_scale) modules and the device their kernels take."""
    from isoloco_kernels.experimental import triton_gram as gram, triton_polar_steps as polar_step
    from isoloco_kernels.triton import iso_scale

    if INTERPRETER:
        assert type(gram._gram_kernel).__name__ == "InterpretedFunction"
    return gram, polar_step, iso_scale, "cuda" if CUDA else "cpu"


GEMM_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _x(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)


@needs_kernels
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("shape,block", [((2, 40, 21), 16), ((1, 1, 9), 16), ((1, 33, 70), 32)], ids=str)
def test_gram_lower_tiles_mirrored(tk, dtype, shape, block):
    gram_mod, _, _, dev = tk
    x = _x(shape, dtype, dev, seed=shape[1])
    a = gram_mod.gram(x, block_m=block, block_k=16)
    want = x.double() @ x.double().mT
    assert a.dtype == dtype and a.shape == want.shape and torch.isfinite(a).all()
    assert rel_err(a, want) <= GEMM_TOL[dtype]
    tile = torch.arange(shape[1], device=a.device) // block
    off = tile[:, None] != tile[None, :]
    assert torch.equal(a[:, off], a.mT[:, off])  # off-diagonal tiles are mirrored copies
    assert gram_mod.num_lower_tiles(shape[1], block) == (-(-shape[1] // block)) * (-(-shape[1] // block) + 1) // 2


@needs_kernels
def test_gram_non_contiguous_input(tk):
    gram_mod, _, _, dev = tk
    base = _x((2, 30, 18), torch.float32, dev, seed=3)
    x = base.transpose(-1, -2)  # [2, 18, 30], strided
    assert rel_err(gram_mod.gram(x, block_m=16, block_k=16), x.double() @ x.double().mT) <= GEMM_TOL[torch.float32]


@needs_kernels
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("coef_b,coef_c", [(0.0, 1.0), (-2.87, 0.52)])
def test_poly_symmetric(tk, dtype, coef_b, coef_c):
    _, ps, _, dev = tk
    x = _x((2, 21, 30), torch.float64, dev, seed=5) / 10
    a = (x @ x.mT).to(dtype)
    out = ps.poly(a, coef_b, coef_c, block_m=16, block_k=16)
    a64 = a.double()
    want = coef_b * a64 + coef_c * a64 @ a64
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, want) <= GEMM_TOL[dtype]


@needs_kernels
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)
@pytest.mark.parametrize("m,n", [(20, 45), (1, 17)])
def test_axpy_matmul(tk, dtype, m, n):
    _, ps, _, dev = tk
    x = _x((2, m, n), dtype, dev, seed=m * n)
    b = _x((2, m, m), dtype, dev, seed=m + n) / 4
    out = ps.axpy_matmul(x, b, 1.7, block_m=16, block_n=16, block_k=16)
    want = 1.7 * x.double() + b.double() @ x.double()
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, want) <= GEMM_TOL[dtype]


@needs_kernels
def test_step_pieces_match_torch_steps(tk):
    _, ps, _, dev = tk
    x = _x((2, 18, 40), torch.float32, dev, seed=11) / 8
    a = x @ x.mT
    for a2 in (None, a @ a):
        got = ps.step(x, a, a2, *polar.COEFFS[3])
        want = polar.TorchSteps.step(x.double(), a.double(), None if a2 is None else a2.double(), *polar.COEFFS[3])
        assert rel_err(got, want) <= 1e-5


@needs_kernels
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("shape", [(3, 7, 40), (5, 9), (1, 1, 1)], ids=str)
def test_iso_scale(tk, dtype, shape):
    _, _, iso, dev = tk
    x = _x(shape, dtype, dev, seed=sum(shape))
    q, _ = polar_ref(x)
    q = q.to(dtype).to(dev)
    want_sbar = (x.double() * q.double()).sum((-2, -1)) / min(shape[-2:])
    poisoned = x.clone()
    sbar = iso.iso_scale_triton(poisoned, q, block=64, max_splits=3)  # several splits per matrix
    assert sbar.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert sbar.shape == x.shape[:-2]
    assert rel_err(sbar, want_sbar) <= TOL[("exact", torch.float32)]
    assert rel_err(poisoned, want_sbar[..., None, None] * q.double()) <= TOL[("exact", dtype)]
    assert rel_err(poisoned, iso_flatten_ref(x)) <= TOL[("exact", dtype)] * 2


@needs_kernels
def test_iso_scale_strided_in_place(tk):
    _, _, iso, dev = tk
    base = _x((2, 12, 20), torch.float32, dev, seed=21)
    view = base.transpose(-1, -2)
    q, _ = polar_ref(view)
    q = q.float().to(dev)
    want = iso_flatten_ref(view)
    iso.iso_scale_triton(view, q, block=32, max_splits=4)
    assert rel_err(base.transpose(-1, -2), want) <= TOL[("exact", torch.float32)]


@needs_kernels
def test_polar_factor_through_triton(tk):
    """The whole iteration with the Triton pieces matches the torch one and the reference."""
    *_, dev = tk
    x = with_spectrum(1, 10, 24, spectrum("geometric", 10, cond=1e3), torch.Generator().manual_seed(4)).float().to(dev)
    q_tr, r_tr = polar.polar_factor(x, backend="triton")
    q_t, r_t = polar.polar_factor(x.cpu(), backend="torch")
    assert rel_err(q_tr, q_t) <= 1e-5 and (r_tr <= polar.CHECK_TOL).all()
    assert rel_err(q_tr, polar_ref(x)[0]) <= TOL[("polar", torch.float32)]


@needs_kernels
def test_poisoned_outputs_are_fully_written(tk, monkeypatch):
    """Every output element is stored: kernels writing into NaN-filled buffers leave no NaN."""
    gram_mod, ps, _, dev = tk
    real_empty = torch.empty

    def nan_empty(*args, **kw):
        t = real_empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    x = _x((1, 35, 19), torch.float32, dev, seed=8)
    a = gram_mod.gram(x, block_m=16, block_k=16)
    assert torch.isfinite(a).all()
    assert torch.isfinite(ps.poly(a, 0.5, -0.1, block_m=16, block_k=16)).all()
    assert torch.isfinite(ps.axpy_matmul(x, a, 2.0, block_m=16, block_n=16, block_k=16)).all()


def test_iso_scale_dispatch_takes_triton_where_it_runs_and_torch_last():
    """The CUDA table's Triton candidate runs (here on CPU tensors under the interpreter) and gives
    the reference result; the torch candidate serves what no kernel takes."""
    from isoloco_kernels import dispatch
    from isoloco_kernels import triton as tk

    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    q, _ = polar_ref(x)
    want = iso_flatten_ref(x)
    chosen = dispatch.select("iso_scale_", "cuda", x, q.float())
    assert chosen.name == ("triton" if tk.usable_for(x) else "torch"), chosen.name
    for c in (chosen, dispatch.TABLES[("iso_scale_", "cuda")][-1]):
        y = x.clone()
        sbar = c.run(y, q.float())
        assert sbar.shape == (2,) and rel_err(y, want) <= TOL[("exact", torch.float32)], c.name


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_cuda_polar_flatten_triton_vs_cublas(dtype):
    import isoloco_kernels as ik

    x = with_spectrum(4, 128, 512, spectrum("geometric", 128, cond=1e4), torch.Generator().manual_seed(1))
    xc = x.to(dtype).cuda()
    ref = iso_flatten_ref(x.to(dtype))
    for backend in ("triton", "torch"):
        y = xc.clone()
        polar.flatten_polar_(y, backend=backend)
        assert rel_err(y, ref) <= TOL[("polar", dtype)]
    assert rel_err(ik.iso_flatten(xc, method="auto"), ref) <= TOL[("polar", dtype)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (launches on cuda:1 under its own device guard)")
def test_kernels_on_the_second_gpu():
    """Triton launches on the current device: every wrapper must make the tensors' device current."""
    from isoloco_kernels.experimental import triton_gram as gram, triton_polar_steps as polar_step
    from isoloco_kernels.triton import iso_scale, nesterov

    dev = torch.device("cuda:1")
    torch.cuda.set_device(0)
    x = _x((2, 24, 40), torch.float32, dev, 81)
    assert rel_err(gram.gram(x), x @ x.mT) < GEMM_TOL[torch.float32]
    a = x @ x.mT
    assert rel_err(polar_step.poly(a, 0.5, 0.25), 0.5 * a + 0.25 * a @ a) < GEMM_TOL[torch.float32]
    q = polar_ref(x.double())[0].float().to(dev)
    y = x.clone()
    iso_scale.iso_scale_triton(y, q)
    assert rel_err(y, iso_flatten_ref(x.double())) < TOL[("polar", torch.float32)]
    ps = [torch.zeros(5, device=dev), torch.zeros(3, device="cuda:0")]
    bs = [torch.zeros_like(p) for p in ps]
    us = [torch.ones_like(p) for p in ps]
    nesterov.nesterov_outer_triton(ps, bs, us, 0.5, 0.0, None)  # one launch per device
    torch.cuda.synchronize(dev)
    assert all(torch.equal(p, torch.full_like(p, -0.5)) for p in ps)


def test_int64_offsets_only_for_matrices_reaching_2_31_elements():
    from isoloco_kernels.triton import needs_int64

    assert not needs_int64(torch.empty(3, 2**15, 2**15, device="meta"))  # 2^30 per matrix
    assert needs_int64(torch.empty(1, 2**16, 2**15, device="meta"))  # 2^31
    assert needs_int64(torch.empty(1, 2**15, 2**16, device="meta").mT)  # any strides


@needs_kernels
def test_batches_beyond_the_grid_axis_cap_run_in_chunks(tk, monkeypatch):
    """The batch rides grid axis 1/2 (CUDA caps those at 65535): a batch larger than the cap
    is launched in chunks (the cap lowered to 2 here, so 5 matrices take 3 launches)."""
    import isoloco_kernels.triton as T

    gram, polar_step, iso_scale, dev = tk
    monkeypatch.setattr(T, "MAX_GRID_YZ", 2)
    x = _x((5, 12, 20), torch.float32, dev, 91)
    a = gram.gram(x)
    assert rel_err(a, x @ x.mT) < GEMM_TOL[torch.float32]
    assert rel_err(polar_step.poly(a, 0.5, 0.25), 0.5 * a + 0.25 * a @ a) < GEMM_TOL[torch.float32]
    b = torch.randn(5, 12, 12, generator=torch.Generator().manual_seed(92)).to(dev)
    assert rel_err(polar_step.axpy_matmul(x, b, 0.3), 0.3 * x + b @ x) < GEMM_TOL[torch.float32]
    q = polar_ref(x.double())[0].float().to(dev)
    y = x.clone()
    iso_scale.iso_scale_triton(y, q)
    assert rel_err(y, iso_flatten_ref(x.double())) < TOL[("polar", torch.float32)]
