"""nesterov_outer_: the torch foreach backend (CPU op), the Triton kernel under the interpreter, and
the CUDA dispatch, against reference.nesterov_ref in float64."""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch

import isoloco_kernels  # noqa: F401  (registers torch.ops.isoloco)
from isoloco_kernels.dispatch import table as nesterov
from isoloco_kernels.reference import nesterov_ref
from tests.helpers import TOL, rel_err

LR, MU = 0.7, 0.9
# (param dtype, buf dtype): the compute dtype is float64 if either is, else float32.
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
]
SHAPES = [(7, 5), (1, 9), (9, 1), (33,), (1,), (2, 3, 4), (0, 4), (130,)]


def _rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _case(pd, bd, ud=None, shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [_rand(s, pd, g) for s in shapes]
    bufs = [_rand(s, bd, g) for s in shapes]
    updates = [_rand(s, ud or pd, g) for s in shapes]
    return params, bufs, updates


def _reference(params, bufs, updates):
    return [nesterov_ref(p, b, u, LR, MU) for p, b, u in zip(params, bufs, updates)]


def _check(params, bufs, ref):
    """Norm-wise error within TOL, and elementwise within TOL·max|ref| (an unwritten element shows)."""
    for i, (p, b, (rp, rb)) in enumerate(zip(params, bufs, ref)):
        if p.numel() == 0:
            continue
        for name, out, want in (("param", p, rp), ("buf", b, rb)):
            tol = TOL[("update", out.dtype)]
            assert rel_err(out, want) <= tol, f"{name} {i} {tuple(out.shape)} {out.dtype}"
            worst = (out.detach().to("cpu", torch.float64) - want.cpu()).abs().max().item()
            assert worst <= tol * want.abs().max().item() + 1e-300, f"{name} {i}: max abs error {worst}"


def _clone(ts):
    return [t.clone() for t in ts]


@pytest.mark.parametrize("pd,bd", DTYPE_PAIRS, ids=lambda d: str(d)[6:])
def test_op_cpu_matches_reference(pd, bd):
    params, bufs, updates = _case(pd, bd, seed=1)
    ref = _reference(params, bufs, updates)
    u_before = _clone(updates)
    torch.ops.isoloco.nesterov_outer_(params, bufs, updates, LR, MU, None)
    _check(params, bufs, ref)
    assert all(torch.equal(a, b) for a, b in zip(updates, u_before)), "updates must be read-only"


def test_op_cpu_mixed_dtypes_and_strides_in_one_call():
    g = torch.Generator().manual_seed(2)
    base = _rand((6, 10), torch.float32, g)
    params = [
        _rand((5, 3), torch.bfloat16, g),
        _rand((8,), torch.float64, g),
        base.t(),  # non-contiguous param
        _rand((20, 4), torch.float32, g)[::2],  # strided param
        _rand((4, 4), torch.float16, g),
    ]
    bufs = [torch.zeros(p.shape, dtype=nesterov.update_compute_dtype(p.dtype, p.dtype)) for p in params]
    bufs[1] = _rand((8,), torch.float64, g)
    updates = [_rand(p.shape, torch.float32, g) for p in params]
    updates[2] = _rand((6, 10), torch.float32, g).t()  # non-contiguous update
    ref = _reference(params, bufs, updates)
    torch.ops.isoloco.nesterov_outer_(params, bufs, updates, LR, MU, None)
    _check(params, bufs, ref)
    assert params[2].data_ptr() == base.data_ptr()  # updated in place


def test_first_step_from_zero_buffer_equals_sgd():
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(_rand((6, 7), torch.float32, g))
    grad = _rand((6, 7), torch.float32, g)
    sgd_p = torch.nn.Parameter(p.detach().clone())
    sgd = torch.optim.SGD([sgd_p], lr=LR, momentum=MU, nesterov=True, foreach=True)
    sgd_p.grad = grad.clone()
    sgd.step()
    buf = torch.zeros_like(p)
    with torch.no_grad():
        torch.ops.isoloco.nesterov_outer_([p], [buf], [grad], LR, MU, None)
    assert torch.equal(buf, sgd.state[sgd_p]["momentum_buffer"])
    assert rel_err(p, sgd_p) <= TOL[("update", torch.float32)]


def test_bad_arguments_change_nothing():
    params, bufs, updates = _case(torch.float32, torch.float32, shapes=[(3, 4), (5,)], seed=4)
    before = _clone(params) + _clone(bufs)
    with pytest.raises(ValueError, match="tensor 1"):
        torch.ops.isoloco.nesterov_outer_(params, bufs, [updates[0], torch.zeros(6)], LR, MU, None)
    with pytest.raises(ValueError, match="amax must have 3 entries per tensor"):
        torch.ops.isoloco.nesterov_outer_(params, bufs, updates, LR, MU, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="one entry each"):
        torch.ops.isoloco.nesterov_outer_(params, bufs[:1], updates, LR, MU, None)
    with pytest.raises(TypeError, match="update 0"):
        torch.ops.isoloco.nesterov_outer_(params, bufs, [updates[0].int(), updates[1]], LR, MU, None)
    assert all(torch.equal(a, b) for a, b in zip(params + bufs, before))


def test_opcheck():
    params, bufs, updates = _case(torch.float32, torch.float32, shapes=[(3, 4), (5,)], seed=5)
    # valid bounds: every tensor's largest |entry| (3 per tensor: params, bufs, updates), one unknown (NaN)
    amax = [t.abs().max().item() for t in (*params, *bufs, *updates)]
    amax[4] = float("nan")
    torch.library.opcheck(torch.ops.isoloco.nesterov_outer_.default, (params, bufs, updates, LR, MU, None))
    torch.library.opcheck(torch.ops.isoloco.nesterov_outer_.default, (params, bufs, updates, LR, MU, amax))


# ------------------------------------------------------------------------------------------------
# The Triton kernel on CPU tensors, under the interpreter. triton.jit picks the interpreter when the
# kernel is defined, so a private copy of triton/nesterov.py is loaded with TRITON_INTERPRET=1 set
# for the duration of the import; the package's own copy (and other tests) are left as they are.

_KERNEL_FILE = pathlib.Path(nesterov.__file__).parent.parent / "triton" / "nesterov.py"


@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("_isoloco_nesterov_interpreted", _KERNEL_FILE)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    if type(mod._nesterov_outer_kernel).__name__ != "InterpretedFunction":
        pytest.skip("this triton does not offer the interpreter")
    return mod


INTERP_SHAPES = [(7, 5), (1, 9), (9, 1), (33,), (1,), (2, 3, 4), (0, 4)]


@pytest.mark.parametrize(
    "pd,bd,ud",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.float64, torch.float64, torch.float64),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float16, torch.float32, torch.float16),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    ],
    ids=lambda d: str(d)[6:],
)
def test_triton_kernel_interpreted(interp, pd, bd, ud):
    params, bufs, updates = _case(pd, bd, ud, shapes=INTERP_SHAPES, seed=6)
    ref = _reference(params, bufs, updates)
    # block=16: several programs per tensor, and tensors ending mid-block
    interp.nesterov_outer_triton(params, bufs, updates, LR, MU, block=16)
    _check(params, bufs, ref)


def test_triton_kernel_interpreted_mixed_groups_and_strided_updates(interp):
    g = torch.Generator().manual_seed(7)
    params = [_rand((5, 6), torch.float32, g), _rand((40,), torch.bfloat16, g), _rand((6, 5), torch.float32, g)]
    bufs = [torch.zeros(5, 6), _rand((40,), torch.float32, g), _rand((6, 5), torch.float32, g)]
    updates = [_rand((6, 5), torch.float32, g).t(), _rand((40,), torch.bfloat16, g), _rand((6, 5), torch.float32, g)]
    # contiguous views 4 bytes off a 16-byte boundary: the unaligned launch
    params.append(_rand((41,), torch.float32, g)[1:])
    bufs.append(_rand((41,), torch.float32, g)[1:])
    updates.append(_rand((40,), torch.float32, g))
    ref = _reference(params, bufs, updates)
    interp.nesterov_outer_triton(params, bufs, updates, LR, MU, block=8)
    _check(params, bufs, ref)
    with pytest.raises(ValueError, match="contiguous"):
        interp.nesterov_outer_triton([params[0].t()], [bufs[0].t()], [updates[0].t()], LR, MU)


def test_cuda_table_takes_triton_for_contiguous_and_torch_for_strided(interp, monkeypatch):
    """The CUDA table of nesterov_outer_ (dispatch/table.py): the Triton kernel for contiguous params and
    bufs, torch foreach when one is strided; both give the reference result (CPU tensors, the
    interpreted kernel)."""
    from isoloco_kernels import triton as tk
    from isoloco_kernels.dispatch import table as dispatch

    monkeypatch.setattr(tk, "usable_for", lambda t: True)
    monkeypatch.setattr(dispatch, "_triton_nesterov", lambda *a: interp.nesterov_outer_triton(*a))
    table = dispatch.TABLES[("nesterov_outer_", "cuda")]
    monkeypatch.setitem(
        dispatch.TABLES,
        ("nesterov_outer_", "cuda"),
        [
            dispatch.Candidate(
                c.name, c.available, c.supports, dispatch._triton_nesterov if c.name == "triton" else c.run
            )
            for c in table
        ],
    )
    g = torch.Generator().manual_seed(8)
    for strided in (False, True):
        params = [_rand((4, 6), torch.float32, g), _rand((6, 4), torch.float32, g), _rand((9,), torch.float64, g)]
        if strided:
            params[1] = params[1].t()
        bufs = [_rand(p.shape, p.dtype, g) for p in params]
        updates = [_rand(p.shape, p.dtype, g) for p in params]
        ref = _reference(params, bufs, updates)
        c = dispatch.select("nesterov_outer_", "cuda", params, bufs, updates, LR, MU)
        if dispatch._cupy_available()[0] or dispatch.TABLES[("nesterov_outer_", "cuda")][0].available()[0]:
            pytest.skip("a csrc backend is available here and comes first")
        assert c.name == ("torch (foreach)" if strided else "triton"), (strided, c.name)
        c.run(params, bufs, updates, LR, MU)
        _check(params, bufs, ref)


@pytest.mark.parametrize(
    "pd,bd,aligned,vector_op",
    [
        ("fp32", "fp32", True, "ld.global.v4"),
        ("bf16", "fp32", True, "ld.global.v4"),
        ("fp64", "fp64", True, "ld.global.v2"),  # 2×64 bit
        ("fp32", "fp32", False, None),
    ],
)
def test_triton_kernel_compiles_for_sm90(pd, bd, aligned, vector_op):
    """Compile (no GPU needed) for sm_90: the kernel builds for every switch, and with ALIGNED its
    table-loaded pointers get 128-bit vector loads and stores."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from isoloco_kernels.triton import nesterov as tn

    kernel = tn._nesterov_outer_kernel
    if type(kernel).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET=1 in this process")
    tdt = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp64": tl.float64}
    cdt = tl.float64 if "fp64" in (pd, bd) else tl.float32
    names = ["table_ptr", "block_tensor_ptr", "P_DTYPE", "B_DTYPE", "U_DTYPE", "C_DTYPE", "ALIGNED", "BLOCK"]
    pointers = {"table_ptr": "*i64", "block_tensor_ptr": "*i32"}
    values = [tdt[pd], tdt[bd], tdt[bd], cdt, aligned, tn.BLOCK]
    try:
        src = ASTSource(
            fn=kernel,
            signature={n: pointers.get(n, "constexpr") for n in names},
            constexprs={(i,): v for i, v in enumerate(values, start=2)},
            attrs={(i,): [["tt.divisibility", 16]] for i in range(2)},
        )
    except TypeError as e:  # another triton's ASTSource API
        pytest.skip(f"ASTSource API differs in triton {triton.__version__}: {e}")
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": tn.NUM_WARPS})
    ptx = compiled.asm["ptx"]
    assert ".entry _nesterov_outer_kernel" in ptx
    if vector_op:
        assert vector_op in ptx and vector_op.replace("ld.", "st.") in ptx


# ------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("pd,bd", DTYPE_PAIRS, ids=lambda d: str(d)[6:])
def test_op_cuda_matches_reference(pd, bd):
    shapes = SHAPES + [(257, 300), (5000,)]
    params, bufs, updates = _case(pd, bd, shapes=shapes, seed=9)
    ref = _reference(params, bufs, updates)
    dev = [[t.cuda() for t in ts] for ts in (params, bufs, updates)]
    torch.ops.isoloco.nesterov_outer_(*dev, LR, MU, None)
    _check(dev[0], dev[1], ref)


@cuda
def test_triton_kernel_cuda_matches_torch():
    from isoloco_kernels import triton as tk

    if not tk.AVAILABLE:
        pytest.skip("triton not importable")
    from isoloco_kernels.triton import nesterov as tn

    case = _case(torch.bfloat16, torch.float32, torch.float32, shapes=SHAPES + [(300, 257)], seed=10)
    params, bufs, updates = ([t.cuda() for t in ts] for ts in case)
    p2, b2 = _clone(params), _clone(bufs)
    ref = _reference(params, bufs, updates)
    tn.nesterov_outer_triton(params, bufs, updates, LR, MU)
    nesterov.nesterov_outer_torch(p2, b2, updates, LR, MU)
    _check(params, bufs, ref)
    for a, b in zip(bufs, b2):
        assert rel_err(a, b) <= TOL[("update", torch.float32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mu", [0.0, 0.9])
def test_cpu_fused_and_foreach_paths_agree_with_reference(dtype, mu):
    """Contiguous fp32/fp64 groups take torch's fused SGD kernel (μ ≠ 0), the rest foreach;
    both must write buf ← μ·buf + u (also for μ = 0) and p ← p − lr·(u + μ·buf)."""
    g = torch.Generator().manual_seed(31)
    shapes = [(33, 17), (5,), (1, 40)]
    params = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    bufs = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    updates = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    frozen = [u.clone() for u in updates]
    want = [nesterov_ref(p, b, u, LR, mu) for p, b, u in zip(params, bufs, updates)]
    torch.ops.isoloco.nesterov_outer_(params, bufs, updates, LR, mu, None)
    for i, (p, b, (wp, wb)) in enumerate(zip(params, bufs, want)):
        assert rel_err(p, wp) <= TOL[("update", dtype)], f"param {i}"
        assert rel_err(b, wb) <= TOL[("update", dtype)], f"buf {i}"
    assert all(torch.equal(u, f) for u, f in zip(updates, frozen)), "updates must stay read-only"
