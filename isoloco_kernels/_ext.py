"""Loads the optional compiled extension `isoloco_kernels._C` (CUDA kernels for the isoloco ops).

The extension is a plain shared library whose static initialisers run TORCH_LIBRARY_IMPL blocks; it
holds no Python bindings. Its absence is normal (a pure-Python install): `STATUS` says why, and
the Python/Triton implementations in ops.py serve instead.
"""
from __future__ import annotations

import glob
import os
import shutil

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_BUILD_HINT = "ISOLOCO_CUDA=1 pip install --no-build-isolation [-e] ."

LOADED = False
STATUS = "not loaded yet"


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
    global LOADED, STATUS
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
    STATUS = f"loaded {path}"
    return True


def has_kernel(op: str, key: str = "CUDA") -> bool:
    """Whether `isoloco::<op>` has a kernel registered for dispatch key `key` (no GPU needed)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"isoloco::{op}", key)
    except RuntimeError:
        return False
