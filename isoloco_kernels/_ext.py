"""Loads the optional compiled extension `isoloco_kernels._C` (CUDA kernels for the isoloco ops).

The extension is a plain shared library whose static initialisers run TORCH_LIBRARY_IMPL blocks; it
holds no Python bindings. Its absence is normal (a pure-Python install): `STATUS` says why, and
the Python/Triton implementations in ops.py serve instead.
"""
from __future__ import annotations

import glob
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))

LOADED = False
STATUS = "not built (pure-Python install; build with ISOLOCO_CUDA=1, see README)"


def _find_library() -> str | None:
    for pattern in ("_C*.so", "_C*.pyd", "lib_C*.so"):
        hits = sorted(glob.glob(os.path.join(_HERE, pattern)))
        if hits:
            return hits[0]
    return None


def load() -> bool:
    """Load the extension once; returns whether it is loaded. Never raises."""
    global LOADED, STATUS
    if LOADED or os.environ.get("ISOLOCO_DISABLE_EXT") == "1":
        if not LOADED:
            STATUS = "disabled by ISOLOCO_DISABLE_EXT=1"
        return LOADED
    path = _find_library()
    if path is None:
        return False
    try:
        torch.ops.load_library(path)
    except OSError as e:  # built against another torch, or missing CUDA runtime libraries
        STATUS = f"found {os.path.basename(path)} but could not load it: {e}"
        return False
    LOADED = True
    STATUS = f"loaded {os.path.basename(path)}"
    return True


def has_kernel(op: str, key: str = "CUDA") -> bool:
    """Whether `isoloco::<op>` has a kernel registered for dispatch key `key` (no GPU needed)."""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"isoloco::{op}", key)
    except RuntimeError:
        return False
