"""Multi-tensor Nesterov outer update (placeholder: plain torch loop; fused versions to come)."""
from __future__ import annotations

import torch


def nesterov_outer_torch(params, bufs, updates, lr: float, momentum: float, scales) -> None:
    for i, (p, b, u) in enumerate(zip(params, bufs, updates)):
        g = u.to(b.dtype)
        if scales is not None:
            g = g * scales[i].to(b.dtype)
        b.mul_(momentum).add_(g)
        p.sub_((lr * (g + momentum * b)).to(p.dtype))


nesterov_outer_cuda = nesterov_outer_torch
