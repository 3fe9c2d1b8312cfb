"""Iso-C flatten of one [m, n] or [B, m, n] tensor, in place: method choice and dispatch.

Every backend takes a [B, m, n] view and writes the result back with `copy_` only after the whole
batch is computed, so a failure leaves the input untouched.
"""
from __future__ import annotations

import torch

from . import exact
from ._validate import check_all_finite, check_matrix_tensor

METHODS = ("auto", "svd", "eigh")

_BACKENDS = {
    "svd": exact.flatten_svd_,
    "eigh": exact.flatten_eigh_,
}


def check_method(method) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def resolve_method(method: str, x3: torch.Tensor) -> str:
    """The backend `method` means for this tensor. "auto" is "svd" for now (exact everywhere)."""
    if method != "auto":
        return method
    return "svd"


def iso_flatten_impl(x: torch.Tensor, method: str) -> None:
    check_matrix_tensor(x, "iso_flatten_: x")
    check_method(method)
    if x.numel() == 0:
        return
    x3 = x if x.ndim == 3 else x.unsqueeze(0)
    check_all_finite([x], ["iso_flatten_: x"])
    _BACKENDS[resolve_method(method, x3)](x3)
