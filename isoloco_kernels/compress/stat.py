"""The statistical formats' torch path (stat2, stat4): per block, bins over μ ± k·σ, each decoding to its centroid.

One flat tensor of n entries is cut into ceil(n/block) blocks (the last one short: its statistics count its own
entries only). Per block of m entries x_i (in the compute dtype: float32 for float16 / bfloat16 / float32
input, float64 for float64), with NB = 2^bits bins and k = spec.sigmas = KS/16:

    a = max|x_i|;  a < 2^-126 (float32's smallest normal): the block is sent as zeros (codes 0, table 0)
    E = max(e, −125) where 2^(e−1) ≤ a < 2^e                      (the block's binary exponent)
    y_i = x_i·2^(24−E)  (float64, exact: |y_i| < 2^24);  q_i = trunc(y_i)  (int64, toward zero)
    S1 = Σ q_i, S2 = Σ q_i²                                        (int64: exact, in any order)
    μ = S1 / m;  σ = sqrt(max(float64(S2) / m − μ·μ, 0))           (float64, each operation rounded once)
    edges t_j = μ + σ·k·(2j − NB)/NB,  j = 1 … NB − 1              (equal-width bins over μ ± kσ, the outer
                                                                    bins open-ended; k·(2j − NB)/NB is exact)
    code_i = #{j : y_i ≥ t_j}                                      (0 … NB − 1)
    centroid_c = (Σ_{code_i = c} q_i) / n_c                         (float64; n_c entries in bin c)
                 an empty bin (n_c = 0): its midpoint μ + σ·k·(2c + 1 − NB)/NB clamped to [min q, max q]
    table_c = float32(centroid_c·2^(E−24))                          (the only rounding of a decoded value)
    decoded x_i = table[code_i]

Every sum is an integer sum, so the statistics do not depend on the order of summation: the Triton kernels
(triton/quant.py) compute the same bits, and so does compress/reference.py in Python integers and floats.
The truncation to q_i moves each entry by less than 2^(E−24) ≤ a·2^-23 — below float32's resolution of the
largest entry. A constant block (σ = 0) is exact: every q_i is the same integer (a float32 value has 24
significant bits), so its centroid is that value. μ and σ only place the edges and are not sent.
"""

from __future__ import annotations

import torch

from .spec import MIN_SCALE

__all__ = ["edge", "midpoint", "encode_stat_blocks"]

#: The block's fixed point: |q_i| < 2^FIXED_BITS (S2 < 2^(2·24 + 10) fits int64 for blocks up to 1024).
FIXED_BITS = 24
_BIG = 1 << 62


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as float64, exactly, for int64 tensors k in float64's normal exponent range."""
    return ((k + 1023) << 52).view(torch.float64)


def edge(ks: int, bins: int, j: int) -> float:
    """The j-th bin edge in σ units, k·(2j − bins)/bins with k = ks/16 (exact: a small integer over a power of
    two)."""
    return ks * (2 * j - bins) / (16 * bins)


def midpoint(ks: int, bins: int, c: int) -> float:
    """Bin c's midpoint in σ units, k·(2c + 1 − bins)/bins (exact)."""
    return ks * (2 * c + 1 - bins) / (16 * bins)


def encode_stat_blocks(xb: torch.Tensor, n: int, spec):
    """(codes int32 [nb·block], table float32 [nb·bins], decoded values in xb's dtype [nb·block]) of the finite
    blocks xb [nb, block] (zero-padded past the tensor's n entries) in the statistical format of `spec` (the
    module docstring). Raises ValueError where a centroid exceeds float32's range (float64 input only)."""
    nb, B = xb.shape
    bins, ks = spec.fmt.bins, round(spec.sigmas * 16)
    dev = xb.device
    x = xb.to(torch.float64)  # exact
    valid = (torch.arange(nb * B, device=dev) < n).view(nb, B)
    a = x.abs().amax(1)
    live = a >= MIN_SCALE
    e = torch.frexp(a)[1].clamp(min=-125).to(torch.int64)
    y = x * _pow2(FIXED_BITS - e)[:, None]  # exact
    q = y.to(torch.int64) * valid  # toward zero; padding contributes nothing
    m = valid.sum(1).to(torch.float64)
    mu = q.sum(1).to(torch.float64) / m
    var = (q * q).sum(1).to(torch.float64) / m - mu * mu
    sd = torch.sqrt(torch.clamp(var, min=0.0))
    codes = torch.zeros(nb, B, dtype=torch.int64, device=dev)
    for j in range(1, bins):
        codes += y >= (mu + sd * edge(ks, bins, j))[:, None]
    codes *= valid & live[:, None]
    qmin = torch.where(valid, q, _BIG).amin(1).to(torch.float64)
    qmax = torch.where(valid, q, -_BIG).amax(1).to(torch.float64)
    down = _pow2(e - FIXED_BITS)
    table = torch.empty(nb, bins, dtype=torch.float64, device=dev)
    for c in range(bins):
        inside = (codes == c) & valid
        count = inside.sum(1)
        mean = (q * inside).sum(1).to(torch.float64) / count.clamp(min=1).to(torch.float64)
        empty = torch.minimum(torch.maximum(mu + sd * midpoint(ks, bins, c), qmin), qmax)
        table[:, c] = torch.where(count > 0, mean, empty) * down  # exact: a power of two
    table = torch.where(live[:, None], table.to(torch.float32), 0.0)
    if not bool(torch.isfinite(table).all()):
        raise ValueError("a block's centroid exceeds float32's range: its table cannot be sent")
    deq = torch.gather(table, 1, codes).to(xb.dtype)
    return codes.to(torch.int32).flatten(), table.flatten(), deq.flatten()
