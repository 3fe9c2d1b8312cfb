"""Parameters with 3 or more dims (convolution kernels, stacked experts) in the outer step.

Iso-C is defined on matrices. By default the outer optimizers give an N-D pseudo-gradient DiLoCo's
plain update (no flatten), as they do 1-D ones, and say so once when they are built
(`NDParamWarning`). `IsoLoCo(iso_nd=True)` instead flattens each N-D grad as the matrix
dim 0 × the rest (`as_matrix`: a [out, in, kh, kw] kernel as [out, in·kh·kw]), the view
Muon-style optimizers take of convolutions.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Iterable

import torch

__all__ = ["NDParamWarning", "as_matrix", "warn_nd_params"]


class NDParamWarning(UserWarning):
    """Some params have 3 or more dims: the outer step gives them DiLoCo's plain update."""


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """t as the matrix dim 0 × the rest (a view where t's layout allows, else a copy)."""
    return t.reshape(t.shape[0], -1)


def user_stacklevel() -> int:
    """The stacklevel of warnings.warn, called from here, that points at the first frame outside this package: the
    user's line, however many of the package's wrappers (constructors, agreements) stand between."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(pkg):
        frame, level = frame.f_back, level + 1
    return level


def warn_nd_params(where: str, named: Iterable[tuple[str, torch.Tensor]], hint: str) -> bool:
    """Warn once (NDParamWarning, at the user's line) if any of the (name, param) pairs, the params of groups with
    iso=True, has 3 or more dims and elements (the first named, with its shape); True when it warned."""
    nd = [(name, p) for name, p in named if p.ndim >= 3 and p.numel() > 0]
    if not nd:
        return False
    name = nd[0][0]
    warnings.warn(
        f"{where}: {len(nd)} param(s) with 3 or more dims (first: {name}) get "
        f"DiLoCo's plain averaged update, without Iso-C (Iso-C is defined on matrices); {hint}",
        NDParamWarning,
        stacklevel=user_stacklevel(),
    )
    return True
