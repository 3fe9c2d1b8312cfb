"""The Triton kernels (isoloco_kernels/triton) against torch / reference.py.

With a GPU they run on CUDA. Without one they run under Triton's interpreter, which must be chosen
before triton is first imported (triton reads TRITON_INTERPRET when its own library functions are
decorated, at import). So in an ordinary CPU pytest process the kernel tests skip and
`test_kernels_under_the_interpreter` re-runs this file in a fresh Python with TRITON_INTERPRET=1;
other tests in the parent process never see the variable. Sizes stay small (the interpreter is
slow).
Outputs are poisoned (NaN) before kernels run, so unwritten elements show.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA
triton = pytest.importorskip("triton")

from isoloco_kernels.flatten import polar  # noqa: E402
from isoloco_kernels.reference import iso_flatten_ref, polar_ref  # noqa: E402
from tests.helpers import TOL, rel_err, rerun_under_interpreter, spectrum, with_spectrum  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.skipif(CUDA or INTERPRETER, reason="the kernel tests run in this process")
def test_kernels_under_the_interpreter():
    rerun_under_interpreter(__file__, min_passed=25)


# ----------------------------------------------------------------------------------------------
# Real GPU code, built without a GPU: every kernel of the package, compiled for sm_80 and sm_90
# with exactly the signature Triton's launcher would derive from the wrapper's arguments (an
# integer argument equal to 1 becomes a constexpr, one ≥ 2^31 an i64, 16-byte-aligned pointers
# and multiples of 16 get divisibility attributes). The interpreter accepts code the compiler
# rejects (`R0.to(...)` on a constexpr 1, for one), so only these compiles prove the kernels build.

TARGETS = (80, 90)


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kw)` records the launch."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.kernel, args, kw))


def _launches(monkeypatch, module, names, call) -> list:
    """The kernel launches `call()` makes through `module`'s kernels `names` (nothing runs)."""
    launches = []
    for name in names:
        monkeypatch.setattr(module, name, _Recorder(getattr(module, name), launches))
    call()
    assert launches, f"{call} launched none of {names}"
    return launches


def _compile_launch(kernel, args, kw, capability: int):
    """Compile one recorded launch for a CUDA GPU of this compute capability, as the launcher
    would (Triton's own argument binder and specialization; no device needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, specialization, options)
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options.__dict__), signature


def _iso_scale_cases():
    """(id, x, q): the shapes, dtypes and layouts iso_scale_ can get (CPU or meta stand-ins)."""
    f64, bf16, f16 = torch.float64, torch.bfloat16, torch.float16
    misaligned = torch.empty(1 + 2 * 64 * 48)[1:].view(2, 64, 48)
    return [
        ("1xn", torch.empty(1, 37), torch.empty(1, 37)),  # R0 = 1, S = 1: constexprs
        ("nx1-bf16", torch.empty(41, 1, dtype=bf16), torch.empty(41, 1, dtype=bf16)),  # N = 1
        ("1x1-f16", torch.empty(1, 1, dtype=f16), torch.empty(1, 1, dtype=f16)),  # NUMEL = 1
        ("batched-f64", torch.empty(3, 128, 64, dtype=f64), torch.empty(3, 128, 64, dtype=f64)),
        ("mixed-f32-f16", torch.empty(2, 300, 301), torch.empty(2, 300, 301, dtype=f16)),
        ("tall-transposed-bf16", torch.empty(2, 40, 300, dtype=bf16).mT, torch.empty(2, 300, 40)),
        ("misaligned", misaligned, torch.empty(2, 64, 48)),
        ("1xn-wide-f64", torch.empty(1, 1, 70001, dtype=f64), torch.empty(1, 1, 70001, dtype=f64)),
        # one matrix of 2^31 − 2^15 elements (32-bit arguments, 64-bit loop) and of 2^31 (i64)
        (
            "just-below-2^31",
            torch.empty(1, 2**16 - 1, 2**15, device="meta"),
            torch.empty(1, 2**16 - 1, 2**15, device="meta"),
        ),
        ("2^31-bf16", torch.empty(2**16, 2**15, dtype=bf16, device="meta"), torch.empty(2**16, 2**15, device="meta")),
        ("2^31-strided", torch.empty(2**15, 2**16, device="meta").mT, torch.empty(2**16, 2**15, device="meta")),
    ]


@pytest.mark.skipif(INTERPRETER, reason="compiles real GPU code; the interpreter builds no kernels")
@pytest.mark.parametrize("capability", TARGETS, ids=lambda c: f"sm_{c}")
@pytest.mark.parametrize("case", _iso_scale_cases(), ids=lambda c: c[0])
def test_iso_scale_kernels_compile_for_every_specialization(monkeypatch, capability, case):
    from isoloco_kernels.triton import iso_scale

    _, x, q = case
    launches = _launches(
        monkeypatch, iso_scale, ["_iso_dot_kernel", "_iso_write_kernel"], lambda: iso_scale.iso_scale_triton(x, q)
    )
    assert len(launches) == 2
    for kernel, args, kw in launches:
        compiled, signature = _compile_launch(kernel, args, kw, capability)
        assert compiled.asm["cubin"], kernel
        ttir = compiled.asm["ttir"]
        assert re.search(r"scf\.for .*: i64", ttir), f"{kernel}: the chunk loop is not 64-bit"
        if x.numel() >= 2**31:
            assert signature["NUMEL"] == "i64"


@pytest.mark.skipif(INTERPRETER, reason="compiles real GPU code; the interpreter builds no kernels")
def test_iso_scale_specializations_include_the_integer_one_constexprs(monkeypatch):
    """The 1×n case above really is the constexpr specialization that broke `R0.to(...)`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from isoloco_kernels.triton import iso_scale

    _, x, q = _iso_scale_cases()[0]
    (_, (kernel, args, kw)) = _launches(
        monkeypatch, iso_scale, ["_iso_dot_kernel", "_iso_write_kernel"], lambda: iso_scale.iso_scale_triton(x, q)
    )
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    spec = dict(zip((p.name for p in kernel.params), binder(*args, **kw)[1]))
    assert spec["R0"] == ("constexpr", 1) and spec["S"] == ("constexpr", 1)


def _nesterov_cases():
    f32, f64, bf16, f16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
    combos = [(d, d, d) for d in (f32, f64, bf16, f16)] + [
        (bf16, f32, bf16),
        (f16, f32, f32),
        (f64, f32, f16),
        (f32, f32, bf16),
    ]
    cases = [("-".join(str(d)[6:] for d in c), c, False) for c in combos]
    cases.append(("f32-misaligned", (f32, f32, f32), True))
    return cases


@pytest.mark.skipif(INTERPRETER, reason="compiles real GPU code; the interpreter builds no kernels")
@pytest.mark.parametrize("capability", TARGETS, ids=lambda c: f"sm_{c}")
@pytest.mark.parametrize("case", _nesterov_cases(), ids=lambda c: c[0])
def test_nesterov_kernel_compiles_for_every_specialization(monkeypatch, capability, case):
    from isoloco_kernels.triton import nesterov

    _, (pd, bd, ud), misaligned = case
    sizes = [1, 4097, 3 * 4096]  # a one-element tensor, a partial last block, full blocks
    ps = [torch.empty(n + misaligned, dtype=pd)[misaligned:] for n in sizes]
    bs = [torch.empty(n, dtype=bd) for n in sizes]
    us = [torch.empty(n, dtype=ud) for n in sizes]
    (launch,) = _launches(
        monkeypatch,
        nesterov,
        ["_nesterov_outer_kernel"],
        lambda: nesterov.nesterov_outer_triton(ps, bs, us, 0.7, 0.9),
    )
    kernel, args, kw = launch
    assert kw["ALIGNED"] == (not misaligned)
    compiled, _ = _compile_launch(kernel, args, kw, capability)
    assert compiled.asm["cubin"]


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
    sig = {
        "x_ptr": "*fp64",
        "q_ptr": "*fp32",
        "part_ptr": "*fp64",
        "sbar_ptr": "*fp64",
        **{k: "i32" for k in ("N", "NUMEL", "S", "R0", "sxb", "sxm", "sxn", "sqb", "sqm", "sqn")},
        "BLOCK": "constexpr",
        "S_POW2": "constexpr",
        "FLAT": "constexpr",
    }
    src = ASTSource(
        fn=iso_scale._iso_write_kernel, signature=sig, constexprs={"BLOCK": 1024, "S_POW2": 256, "FLAT": True}
    )
    ttir = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ttir"]
    assert re.search(r"arith\.divf .*: f64", ttir), ttir
    assert re.search(r"arith\.sitofp .*i32 to f64", ttir), ttir


needs_kernels = pytest.mark.skipif(
    not (CUDA or INTERPRETER), reason="Triton kernels need a GPU or TRITON_INTERPRET=1 from process start"
)


@pytest.fixture(scope="module")
def tk():
    """(iso_scale module, the device its kernels take)."""
    from isoloco_kernels.triton import iso_scale

    if INTERPRETER:
        assert type(iso_scale._iso_dot_kernel).__name__ == "InterpretedFunction"
    return iso_scale, "cuda" if CUDA else "cpu"


def _x(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)


@needs_kernels
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("shape", [(3, 7, 40), (5, 9), (1, 1, 1), (1, 37), (2, 41, 1)], ids=str)
def test_iso_scale(tk, dtype, shape):
    iso, dev = tk
    x = _x(shape, dtype, dev, seed=sum(shape))
    q, _ = polar_ref(x)
    q = q.to(dtype).to(dev)
    want_sbar = (x.double() * q.double()).sum((-2, -1)) / min(shape[-2:])
    poisoned = x.clone()
    sbar = iso.iso_scale_triton(poisoned, q, block=64, max_splits=3)  # several splits per matrix
    assert sbar.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert sbar.shape == x.shape[:-2]
    # the kernel's row (measured: float32 ≤ 9e-8, float64 ≤ 3e-16); vs the reference Q is rounded too
    assert rel_err(sbar, want_sbar) <= TOL[("iso_scale", sbar.dtype)]
    assert rel_err(poisoned, want_sbar[..., None, None] * q.double()) <= TOL[("iso_scale", dtype)]
    assert rel_err(poisoned, iso_flatten_ref(x)) <= TOL[("iso_scale", dtype)] * 2


@needs_kernels
def test_iso_scale_strided_in_place(tk):
    iso, dev = tk
    base = _x((2, 12, 20), torch.float32, dev, seed=21)
    view = base.transpose(-1, -2)
    q, _ = polar_ref(view)
    q = q.float().to(dev)
    want = iso_flatten_ref(view)
    iso.iso_scale_triton(view, q, block=32, max_splits=4)
    assert rel_err(base.transpose(-1, -2), want) <= TOL[("iso_scale", torch.float32)]


@needs_kernels
@pytest.mark.parametrize("layout", ["x-flat-q-transposed", "both-flat", "x-transposed-q-flat"])
def test_iso_scale_flat_and_strided_paths_agree(tk, layout):
    """The row-major fast path (FLAT) and the (row, col) path give the same result, also when
    only one operand is row-major; many splits per matrix (block 32, up to 1024 splits)."""
    iso, dev = tk
    x0 = _x((2, 24, 50), torch.float32, dev, seed=31)
    q0 = polar_ref(x0)[0].float().to(dev)
    x = x0.clone() if layout != "x-transposed-q-flat" else x0.mT.contiguous().mT
    q = q0 if layout != "x-flat-q-transposed" else q0.mT.contiguous().mT
    assert iso.splits_for(2, 24 * 50, 32) == triton.cdiv(24 * 50, 32)
    sbar = iso.iso_scale_triton(x, q, block=32)
    want = (x0.double() * q0.double()).sum((-2, -1)) / 24
    assert rel_err(sbar, want) <= TOL[("iso_scale", torch.float32)]
    assert rel_err(x, want[:, None, None] * q0.double()) <= TOL[("iso_scale", torch.float32)]


def test_iso_scale_splits_fill_the_gpu_for_few_huge_matrices():
    from isoloco_kernels.triton import iso_scale as iso

    assert iso.splits_for(1, 128256 * 2048, 1024) == iso.MAX_SPLITS  # one embedding: 1024 programs
    assert iso.splits_for(2, 128256 * 2048, 1024) == iso.MAX_SPLITS
    assert iso.splits_for(64, 2048 * 2048, 1024) == 256  # many matrices: as before
    assert iso.splits_for(3, 5, 1024) == 1


def test_iso_scale_dispatch_takes_triton_where_it_runs_and_torch_last():
    """The CUDA table's Triton candidate runs (here on CPU tensors under the interpreter) and gives
    the reference result; the torch candidate serves what no kernel takes."""
    from isoloco_kernels import triton as tk
    from isoloco_kernels.dispatch import table as dispatch

    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    q, _ = polar_ref(x)
    want = iso_flatten_ref(x)
    chosen = dispatch.select("iso_scale_", "cuda", x, q.float())
    assert chosen.name == ("triton" if tk.usable_for(x) else "torch"), chosen.name
    for c in (chosen, dispatch.TABLES[("iso_scale_", "cuda")][-1]):
        y = x.clone()
        sbar = c.run(y, q.float())
        assert sbar.shape == (2,) and rel_err(y, want) <= TOL[("iso_scale", torch.float32)], c.name


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_cuda_polar_flatten_and_auto(dtype):
    """The polar flatten on CUDA (cuBLAS GEMMs, the Triton/csrc epilogue) and auto's choice."""
    import isoloco_kernels as ik

    x = with_spectrum(4, 128, 512, spectrum("geometric", 128, cond=1e4), torch.Generator().manual_seed(1))
    xc = x.to(dtype).cuda()
    ref = iso_flatten_ref(x.to(dtype))
    y = xc.clone()
    polar.flatten_polar_(y)
    assert rel_err(y, ref) <= TOL[("polar", dtype)]
    assert rel_err(ik.iso_flatten(xc, method="auto"), ref) <= TOL[("polar", dtype)]


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (launches on cuda:1 under its own device guard)"
)
def test_kernels_on_the_second_gpu():
    """Triton launches on the current device: every wrapper must make the tensors' device current."""
    from isoloco_kernels.triton import iso_scale, nesterov

    dev = torch.device("cuda:1")
    torch.cuda.set_device(0)
    x = _x((2, 24, 40), torch.float32, dev, 81)
    q = polar_ref(x.double())[0].float().to(dev)
    y = x.clone()
    iso_scale.iso_scale_triton(y, q)
    assert rel_err(y, iso_flatten_ref(x.double())) <= TOL[("iso_scale", torch.float32)]  # Q exact: no polar error
    ps = [torch.zeros(5, device=dev), torch.zeros(3, device="cuda:0")]
    bs = [torch.zeros_like(p) for p in ps]
    us = [torch.ones_like(p) for p in ps]
    nesterov.nesterov_outer_triton(ps, bs, us, 0.5, 0.0)  # one launch per device
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

    iso_scale, dev = tk
    monkeypatch.setattr(T, "MAX_GRID_YZ", 2)
    x = _x((5, 12, 20), torch.float32, dev, 91)
    q = polar_ref(x.double())[0].float().to(dev)
    y = x.clone()
    iso_scale.iso_scale_triton(y, q)
    assert rel_err(y, iso_flatten_ref(x.double())) <= TOL[("iso_scale", torch.float32)]  # Q exact (measured 4.8e-8)
