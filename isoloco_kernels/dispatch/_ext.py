"""Loads the optional compiled extension `isoloco_kernels._C` (CUDA kernels for the isoloco ops).

The extension is a plain shared library whose static initialisers run TORCH_LIBRARY_IMPL blocks; it
holds no Python bindings. Its absence is normal (a pure-Python install): `STATUS` says why, and
the Python/Triton implementations in ops.py serve instead.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import shutil

import torch

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package folder, beside _C*.so
_BUILD_HINT = "ISOLOCO_CUDA=1 pip install --no-build-isolation [-e] ."

LOADED = False
STATUS = "not loaded yet"
PATH: str | None = None  # the loaded library

#: The kernels use bf16 conversions (cvt.rn.bf16.f32) that need compute capability 8.0.
MIN_CAPABILITY = (8, 0)


def _find_library() -> str | None:
    hits = sorted(glob.glob(os.path.join(_HERE, "_C*.so")))
    return hits[0] if hits else None


def _why_absent() -> str:
    """Why there is no _C*.so next to this file, as far as this environment tells."""
    where = f"no _C*.so in {_HERE}"
    if torch.version.cuda is None:
        return f"not built ({where}): torch {torch.__version__} is a CPU-only build"
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.isfile("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None and not os.environ.get("CUDA_HOME"):
        return f"not built ({where}): no nvcc found to build it with (set CUDA_HOME)"
    return (
        f"not built ({where}): the install skipped it (pip's build isolation hides torch from the "
        f"build, or ISOLOCO_CUDA=0); build it with `{_BUILD_HINT}`"
    )


def load() -> bool:
    """Load the extension once; returns whether it is loaded. Never raises."""
    global LOADED, STATUS, PATH
    if LOADED:
        return True
    if os.environ.get("ISOLOCO_DISABLE_EXT") == "1":
        STATUS = "disabled by ISOLOCO_DISABLE_EXT=1"
        return False
    path = _find_library()
    if path is None:
        STATUS = _why_absent()
        return False
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as e:  # built against another torch, or CUDA libraries missing
        STATUS = (
            f"found {os.path.basename(path)} but could not load it ({e}); rebuild it against this "
            f"torch {torch.__version__} with `{_BUILD_HINT}`"
        )
        return False
    LOADED = True
    PATH = path
    STATUS = f"loaded {path}"
    return True


def built_archs() -> tuple[str, ...] | None:
    """The GPU code the loaded extension carries, as recorded at build time from nvcc's -gencode
    targets: "sm_80" (a cubin) or "compute_90" (PTX); None if unknown (not loaded, or built by
    a CMakeLists.txt that did not record them)."""
    return None if PATH is None else _archs_of(PATH)


@functools.lru_cache(maxsize=None)
def _archs_of(path: str) -> tuple[str, ...] | None:
    try:
        fn = ctypes.CDLL(path).isoloco_cuda_archs
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_char_p
    archs = tuple(a for a in fn().decode().split(",") if a)
    return archs or None


def runs_on(capability: tuple[int, int], archs) -> bool:
    """Whether code built for `archs` runs on a device of compute capability `capability`: a
    cubin sm_XY runs on X.Y' with Y' ≥ Y (same major), PTX compute_XY on any X'.Y' ≥ X.Y (the
    driver JIT-compiles it). Arch-specific cubins (sm_90a) run on exactly that capability."""
    major, minor = capability
    for a in archs:
        m = re.fullmatch(r"(sm|compute)_(\d+?)(\d)([af]?)", a)
        if not m:
            continue
        kind, amaj, amin, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == "compute" and (major, minor) >= (amaj, amin) and not suffix:
            return True
        if kind == "sm" and major == amaj and (minor == amin if suffix else minor >= amin):
            return True
    return False


def device_problem(capability: tuple[int, int], archs=None) -> str:
    """Why the csrc kernels (extension or CuPy) cannot run on a device of this capability, or ""
    (archs: the extension's built code; None skips that check, as for CuPy's JIT)."""
    if capability < MIN_CAPABILITY:
        return (
            f"compute capability {capability[0]}.{capability[1]} is below 8.0, which the "
            f"kernels' bfloat16 conversions need"
        )
    if archs is not None and not runs_on(capability, archs):
        return (
            f"the extension was built for {', '.join(archs)}: no kernel image for compute "
            f"capability {capability[0]}.{capability[1]} (rebuild with TORCH_CUDA_ARCH_LIST "
            f"including {capability[0]}.{capability[1]} or a lower arch with +PTX)"
        )
    return ""


def has_kernel(op: str, key: str = "CUDA") -> bool:
    """Whether `isoloco::<op>` has a kernel registered for dispatch key `key` (no GPU needed)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"isoloco::{op}", key)
    except RuntimeError:
        return False
