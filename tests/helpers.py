"""Shared test helpers: the one tolerance table, error measure, and input generators."""
from __future__ import annotations

import torch

# Relative Frobenius error allowed vs reference.py (float64), per (method family, dtype).
# Half/bfloat16 results are rounded to the input dtype, which alone costs ~2^-11 / 2^-8 per element.
TOL = {
    ("exact", torch.float64): 1e-9,
    ("exact", torch.float32): 2e-5,
    ("exact", torch.float16): 2e-3,
    ("exact", torch.bfloat16): 1e-2,
    ("polar", torch.float64): 1e-3,
    ("polar", torch.float32): 1e-3,
    ("polar", torch.float16): 3e-3,
    ("polar", torch.bfloat16): 1.2e-2,
    # polar_bf16 on well-conditioned inputs (cond ≤ 1e2); it is not accurate beyond (polar.py).
    ("polar_bf16", torch.float64): 4e-2,
    ("polar_bf16", torch.float32): 4e-2,
    ("polar_bf16", torch.float16): 4e-2,
    ("polar_bf16", torch.bfloat16): 4e-2,
    # gram (float64 Gram-space iteration): the result rounded to the input dtype (float32: ~2.5e-8
    # measured, ×8 margin) plus the Gram matrix's conditioning: A₀ = X Xᵀ holds the small σ² to
    # eps64·κ² relative, so the error grows as κ² (measured at κ 1e5, flat tails: 3.5e-7…1.1e-6 for
    # float32 input, 2.5e-7…8.4e-7 for float64 input; 8× below the allowance). Use `gram_tol(dtype, cond)`: targets for float32 ≤ 1e-6 at κ ≤ 1e4 and
    # ≤ 1e-5 at κ 1e5 are met by the formula.
    ("gram", torch.float64): 1e-11,
    ("gram", torch.float32): 2e-7,
    ("gram", torch.float16): 2e-3,
    ("gram", torch.bfloat16): 1e-2,
    ("gram_per_cond2", torch.float64): 4 * 2.0**-52,  # × κ², added to the row above
    ("update", torch.float64): 1e-12,
    ("update", torch.float32): 1e-6,
    ("update", torch.float16): 2e-3,
    ("update", torch.bfloat16): 1e-2,
    # iso_scale_ (⟨x, q⟩ accumulated in float32, float64 for float64 x; x rounded to its dtype).
    ("iso_scale", torch.float64): 1e-12,
    ("iso_scale", torch.float32): 1e-5,
    ("iso_scale", torch.float16): 2e-3,
    ("iso_scale", torch.bfloat16): 1e-2,
    # Held-out loss of a torchrun run (one worker per rank) vs the single-process simulation: the
    # same float32 math with the pseudo-gradient sums taken in another order (~1 ulp per round;
    # measured ≤ 1e-7 after 2 rounds of the tiny model). A wrong shard or average moves it ≥ 1e-3.
    ("train_dist", torch.float32): 1e-5,
}

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def gram_tol(dtype: torch.dtype, cond: float) -> float:
    """Allowed relative error of method="gram" at condition number `cond` (see the TOL rows)."""
    return TOL[("gram", dtype)] + TOL[("gram_per_cond2", torch.float64)] * cond**2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    den = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num if den == 0 else num / den


def with_spectrum(b: int, m: int, n: int, sigma: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[b, m, n] float64 matrices U diag(sigma) Vᵀ with Haar-random U, V (sigma has min(m, n) entries)."""
    r = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(b, m, r, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(b, n, r, generator=gen, dtype=torch.float64))
    return (u * sigma.to(torch.float64)) @ v.mT


def spectrum(kind: str, r: int, cond: float = 1e3) -> torch.Tensor:
    """Singular values (descending, σ_1 = 1) of a named test spectrum."""
    i = torch.arange(r, dtype=torch.float64)
    if kind == "geometric":
        return cond ** (-i / max(r - 1, 1))
    if kind == "lowrank_noise":  # a few strong directions over a noise floor 1/cond
        k = max(1, r // 16)
        s = torch.full((r,), 1.0 / cond, dtype=torch.float64)
        s[:k] = torch.linspace(1.0, 0.3, k, dtype=torch.float64)
        return s
    if kind == "flat":
        return torch.ones(r, dtype=torch.float64)
    raise ValueError(kind)
