"""The CUDA kernels through CuPy: a second way in when the compiled extension `_C` is absent.

The same device code as the extension (csrc/kernels/*.cuh, NVRTC-clean by design) is compiled at
first use with CuPy's RawModule (NVRTC), one small module per dtype combination, and launched on
torch tensors through their data pointers, on torch's current stream. Semantics, launch plans and
checks mirror csrc/iso_scale.cu and csrc/nesterov.cu; the constants below mirror the kernels'.

    ok, why = available()      # (False, reason) without CuPy, a GPU or the kernel sources
    iso_scale_(x, q) -> s̄      # isoloco::iso_scale_
    nesterov_outer_(params, bufs, updates, lr, momentum)   # isoloco::nesterov_outer_
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import torch

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package folder

# Must match csrc/kernels/common.cuh and nesterov.cuh.
BLOCK = 256
VEC = 4
NESTEROV_CHUNK = 8192
NESTEROV_FIELDS = 5

_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.M)

_STORAGE = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "ik::half_t",
    torch.bfloat16: "ik::bf16_t",
}


def kernel_dir() -> str | None:
    """Where the kernel sources are: shipped in the package, or csrc/kernels of a source checkout."""
    for d in (os.path.join(_HERE, "csrc", "kernels"), os.path.join(os.path.dirname(_HERE), "csrc", "kernels")):
        if os.path.isfile(os.path.join(d, "iso_scale.cuh")):
            return d
    return None


def kernel_code(*headers: str) -> str:
    """One self-contained source holding `headers` with their local includes expanded in place.

    Inlining (rather than an include path) keeps NVRTC free of any search path and makes CuPy's
    compile cache, keyed by the source text, see every change to the kernels.
    """
    d = kernel_dir()
    if d is None:
        raise FileNotFoundError("isoloco_kernels: the CUDA kernel sources (csrc/kernels) are not installed")
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        with open(os.path.join(d, name), encoding="utf-8") as f:
            text = f.read()
        return _LOCAL_INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return "\n".join(expand(h) for h in headers)


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """(True, "cupy <version>") when the CuPy path can run here, else (False, why not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    if kernel_dir() is None:
        return False, "the kernel sources (csrc/kernels/*.cuh) are not installed"
    try:
        import cupy
    except ImportError as e:
        major = (torch.version.cuda or "13").split(".")[0]
        return False, (
            f"cupy is not installed ({e}); pip install cupy-cuda{major}x (the wheel for "
            f"torch's CUDA {torch.version.cuda})"
        )
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDA driver/runtime mismatch and the like
        return False, f"cupy cannot reach the GPU: {e}"
    return True, f"cupy {cupy.__version__}"


@functools.lru_cache(maxsize=None)
def _kernels(device: int, header: str, names: tuple[str, ...]):
    """Compile `header`'s template instantiations `names` for `device` (cached here and by CuPy)."""
    import cupy

    with cupy.cuda.Device(device):
        mod = cupy.RawModule(code=kernel_code(header), options=("-std=c++17",), name_expressions=names)
        return tuple(mod.get_function(n) for n in names)


def external_stream(cupy, stream, device: int):
    """CuPy's handle on a torch CUDA stream: `cupy.cuda.Stream.from_external` over the stream's
    `__cuda_stream__` protocol where both have it (CuPy 14 deprecates `ExternalStream`, and warns
    at every use), else `cupy.cuda.ExternalStream(pointer, device)` (older CuPy or torch)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream, device)


def _launch(fn, device: int, blocks: int, args: tuple) -> None:
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device):
        fn((blocks,), (BLOCK,), args, stream=external_stream(cupy, stream, device))


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def launch_plan(L: int) -> tuple[int, int]:
    """(nchunks, chunk_len) per matrix of L elements; the same as launch_plan in csrc/iso_scale.cu."""
    want = min(max(-(-L // 8192), 1), 256)
    length = -(-L // want)
    length = -(-length // VEC) * VEC
    return -(-L // length), length


def iso_scale_(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """s̄ = ⟨x, q⟩ / min(m, n) per matrix; x ← s̄·q in place; returns s̄ (float32, float64 for float64 x).
    Unchecked: reached only through the isoloco::iso_scale_ op, whose checks ran (ops.py)."""
    cd = _compute(x.dtype)
    sbar = torch.zeros(x.shape[:-2], dtype=cd, device=x.device)
    if x.numel() == 0:
        return sbar
    m, n = x.shape[-2:]
    L = m * n
    B = x.numel() // L
    nchunks, chunk_len = launch_plan(L)
    xc, qc = x.contiguous(), q.contiguous()
    partial = torch.empty(B * nchunks, dtype=cd, device=x.device)
    c = "double" if cd == torch.float64 else "float"
    targs = f"{_STORAGE[x.dtype]}, {_STORAGE[q.dtype]}, {c}"
    dev = x.device.index
    fpart, fapply = _kernels(dev, "iso_scale.cuh", (f"ik::iso_scale_partial<{targs}>", f"ik::iso_scale_apply<{targs}>"))
    real = np.float64 if cd == torch.float64 else np.float32
    L64, nc, cl = np.int64(L), np.int32(nchunks), np.int64(chunk_len)
    _launch(fpart, dev, B * nchunks, (_ptr(xc), _ptr(qc), _ptr(partial), L64, nc, cl))
    _launch(fapply, dev, B * nchunks, (_ptr(xc), _ptr(qc), _ptr(partial), _ptr(sbar), L64, nc, cl, real(min(m, n))))
    if not x.is_contiguous():
        x.copy_(xc)
    return sbar


def nesterov_outer_(params, bufs, updates, lr: float, momentum: float) -> None:
    """Per tensor i, reference.nesterov_ref's step with g = u; one launch per dtype combination.
    Unchecked: reached only through the isoloco::nesterov_outer_ op, whose checks ran (ops.py)."""
    params, bufs, updates = list(params), list(bufs), list(updates)
    if not params:
        return
    dev = params[0].device
    groups: dict[tuple, list[int]] = {}
    work = {}
    for i, (p, b, u) in enumerate(zip(params, bufs, updates)):
        if p.numel():
            work[i] = (p.contiguous(), b.contiguous(), u.contiguous())
            groups.setdefault((p.dtype, b.dtype, u.dtype), []).append(i)
    if not groups:
        return
    rows, blocks = [], []
    for idx in groups.values():
        chunk = 0
        for i in idx:
            p, b, u = work[i]
            rows.append([p.data_ptr(), b.data_ptr(), u.data_ptr(), p.numel(), chunk])
            chunk += -(-p.numel() // NESTEROV_CHUNK)
        blocks.append(chunk)
    host = torch.tensor(rows, dtype=torch.int64).flatten().pin_memory()
    table = host.to(dev, non_blocking=True)

    offset = 0
    for ((pt, bt, ut), idx), nblocks in zip(groups.items(), blocks):
        c = "double" if pt == torch.float64 else "float"
        name = f"ik::nesterov_outer<{_STORAGE[pt]}, {_STORAGE[bt]}, {_STORAGE[ut]}, {c}>"
        (fn,) = _kernels(dev.index, "nesterov.cuh", (name,))
        real = np.float64 if c == "double" else np.float32
        tptr = np.uint64(table.data_ptr() + offset * NESTEROV_FIELDS * 8)
        _launch(fn, dev.index, nblocks, (tptr, np.int32(len(idx)), real(lr), real(momentum)))
        offset += len(idx)
    for i, (p, b, _) in work.items():
        if p.data_ptr() != params[i].data_ptr() or not params[i].is_contiguous():
            params[i].copy_(p)
        if b.data_ptr() != bufs[i].data_ptr() or not bufs[i].is_contiguous():
            bufs[i].copy_(b)
