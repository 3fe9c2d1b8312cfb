"""Triton TIES / DARE merge of one worker stack: prune, (elect,) merge in one kernel over the K deltas.

For a stack x = [K, N] (each worker's delta flattened; merges/reference.py `sparse_ref`, dim "all"),
program c takes BLOCK entries and, per worker k (K is constexpr: the loop unrolls):

    t_k = x_k · keep_k · inv_scale       keep_k: |x_k| ≥ thr[k]        (magnitude, TIES's trim)
                                                 mix32(key[k] ^ i) ≥ cut  (random, DARE's drops)
    mean:      out = Σ_k t_k / K
    disjoint:  γ = sign(Σ_k t_k); out = Σ_k [sign t_k = γ] t_k / max(1, Σ_k [sign t_k = γ])
    out ← out · post                     post: the stack's power-of-two scale × 1/(1 − p) if rescaled

in the compute dtype (float32; float64 for float64 input), written to a compute-dtype buffer (the
caller checks it fits the output dtype before anything is stored). The disjoint merge reads the K
deltas twice (the second pass mostly from cache); nothing K-sized is allocated. mix32 (triton/mix.py)
is merges/reference.py's 32-bit mixer, in uint32 arithmetic, so the drops are bit for bit the
reference's. Works under TRITON_INTERPRET=1 (set before the package is imported) on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mix import mix32

BLOCK = 1024


@triton.jit
def _pruned(x_ptr, thr_ptr, key_ptr, k, offs, mask, stride_k, cut, inv_scale, RANDOM: tl.constexpr, CD: tl.constexpr):
    x = tl.load(x_ptr + k * stride_k + offs, mask=mask, other=0).to(CD)
    if RANDOM:
        key = tl.load(key_ptr + k).to(tl.uint32)
        h = mix32(key ^ offs.to(tl.uint32)).to(tl.int64)
        keep = h >= cut
    else:
        keep = tl.abs(x) >= tl.load(thr_ptr + k).to(CD)
    return tl.where(keep, x * inv_scale, 0.0)


@triton.jit
def _sparse_merge_kernel(
    x_ptr,
    out_ptr,
    thr_ptr,
    key_ptr,
    n,
    stride_k,
    cut,
    inv_scale,
    post,
    K: tl.constexpr,
    RANDOM: tl.constexpr,
    DISJOINT: tl.constexpr,
    CD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    total = tl.zeros([BLOCK], CD)
    for k in tl.static_range(K):
        total += _pruned(x_ptr, thr_ptr, key_ptr, k, offs, mask, stride_k, cut, inv_scale, RANDOM, CD)
    if DISJOINT:
        elect = tl.where(total > 0, 1, tl.where(total < 0, -1, 0))
        acc = tl.zeros([BLOCK], CD)
        cnt = tl.zeros([BLOCK], CD)
        for k in tl.static_range(K):
            t = _pruned(x_ptr, thr_ptr, key_ptr, k, offs, mask, stride_k, cut, inv_scale, RANDOM, CD)
            sign = tl.where(t > 0, 1, tl.where(t < 0, -1, 0))
            agree = (sign == elect) & (sign != 0)
            acc += tl.where(agree, t, 0.0)
            cnt += tl.where(agree, 1.0, 0.0)
        out = acc / tl.maximum(cnt, 1.0)
    else:
        out = total / K
    tl.store(out_ptr + offs, out * post, mask=mask)


_CD = {torch.float32: tl.float32, torch.float64: tl.float64}


def sparse_merge_triton(
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    thresholds: torch.Tensor | None,
    keys: torch.Tensor | None,
    cut: int,
    inv_scale: float,
    post: float,
    disjoint: bool,
) -> None:
    """out[N] (compute dtype, contiguous) ← the merge of x = [K, N] (rows contiguous). thresholds
    [K] (magnitude) or keys [K] int64 (random, with cut = ⌈p·2³²⌉) select the pruning."""
    K, n = x.shape
    random = keys is not None
    dummy = torch.zeros(K, dtype=torch.int64 if random else out.dtype, device=x.device)
    grid = (triton.cdiv(n, BLOCK),)
    _sparse_merge_kernel[grid](
        x,
        out,
        dummy if random else thresholds,
        keys if random else dummy,
        n,
        x.stride(0),
        cut,
        inv_scale,
        post,
        K=K,
        RANDOM=random,
        DISJOINT=disjoint,
        CD=_CD[out.dtype],
        BLOCK=BLOCK,
    )
