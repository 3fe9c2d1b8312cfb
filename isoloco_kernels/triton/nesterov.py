"""Triton multi-tensor Nesterov outer update: one launch over a whole list of tensors.

For tensor t, in the compute dtype C: the Nesterov step of reference.nesterov_ref with g = u in
place of the gradient (see nesterov.py).

Layout: the host writes one int64 row per tensor — addresses of p, buf and update, numel, and its
first block — after lr and μ (as float64 bit patterns), and copies the table to the device in one go
(from pinned memory on CUDA). The addresses become typed pointers in the kernel (int → pointer
casts), so any number of tensors share one launch; dtypes are constexpr, one launch per (param, buf,
update) dtype triple. Program c handles BLOCK elements of one tensor;
`block_tensor[c]` says which (cached per list of sizes). Full blocks run unmasked and, when every
address is 16-byte aligned (the usual case), with that alignment declared, so loads and stores
vectorize although the pointers come from a table. Works under TRITON_INTERPRET=1 on CPU tensors.

Requirements (dispatch/table.py offers this backend only such tensors; the others go to torch): params
and bufs contiguous; updates are made contiguous here.

This module has no package-relative imports, so a test may load a second copy of it with the
Triton interpreter switched on.
"""

from __future__ import annotations

import contextlib
import struct
from collections import OrderedDict

import torch
import triton
import triton.language as tl

BLOCK = 4096
NUM_WARPS = 8

_TL = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}


@triton.jit
def _nesterov_block(
    p_ptr,
    b_ptr,
    u_ptr,
    offs,
    n,
    lr,
    mu,
    P_DTYPE: tl.constexpr,
    B_DTYPE: tl.constexpr,
    C_DTYPE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """BLOCK elements of one tensor; MASKED only for a tensor's last, partial block."""
    if MASKED:
        mask = offs < n
        g = tl.load(u_ptr + offs, mask=mask).to(C_DTYPE)
        b = tl.load(b_ptr + offs, mask=mask).to(C_DTYPE)
        p = tl.load(p_ptr + offs, mask=mask).to(C_DTYPE)
    else:
        g = tl.load(u_ptr + offs).to(C_DTYPE)
        b = tl.load(b_ptr + offs).to(C_DTYPE)
        p = tl.load(p_ptr + offs).to(C_DTYPE)
    b = mu * b + g
    p = p - lr * (g + mu * b)
    if MASKED:
        tl.store(b_ptr + offs, b.to(B_DTYPE), mask=mask)
        tl.store(p_ptr + offs, p.to(P_DTYPE), mask=mask)
    else:
        tl.store(b_ptr + offs, b.to(B_DTYPE))
        tl.store(p_ptr + offs, p.to(P_DTYPE))


@triton.jit
def _nesterov_outer_kernel(
    table_ptr,  # int64 [2 + 5T]: lr, μ (float64 bits), then per tensor: p, buf, update
    #             addresses, numel, first block
    block_tensor_ptr,  # int32 [nblocks]: the tensor each program works on
    P_DTYPE: tl.constexpr,
    B_DTYPE: tl.constexpr,
    U_DTYPE: tl.constexpr,
    C_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes: vector loads/stores
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    t = tl.load(block_tensor_ptr + c).to(tl.int64)
    hyper = table_ptr.to(tl.pointer_type(tl.float64))
    lr = tl.load(hyper).to(C_DTYPE)
    mu = tl.load(hyper + 1).to(C_DTYPE)
    row = table_ptr + 2 + t * 5
    p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DTYPE))
    b_ptr = tl.load(row + 1).to(tl.pointer_type(B_DTYPE))
    u_ptr = tl.load(row + 2).to(tl.pointer_type(U_DTYPE))
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        b_ptr = tl.multiple_of(b_ptr, 16)
        u_ptr = tl.multiple_of(u_ptr, 16)
    n = tl.load(row + 3)
    start = (c - tl.load(row + 4)) * BLOCK
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    # A loaded n says nothing about alignment, so a masked access could not be vectorized:
    # full blocks go unmasked, and only each tensor's last block pays for the mask.
    if start + BLOCK <= n:
        _nesterov_block(p_ptr, b_ptr, u_ptr, offs, n, lr, mu, P_DTYPE, B_DTYPE, C_DTYPE, False)
    else:
        _nesterov_block(p_ptr, b_ptr, u_ptr, offs, n, lr, mu, P_DTYPE, B_DTYPE, C_DTYPE, True)


# Block → tensor maps depend only on the sizes: keep the last few (an optimizer reuses one).
_BLOCK_MAPS: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_BLOCK_MAPS_MAX = 16


def _block_map(blocks: list[int], device: torch.device) -> torch.Tensor:
    key = (device, tuple(blocks))
    hit = _BLOCK_MAPS.get(key)
    if hit is not None:
        _BLOCK_MAPS.move_to_end(key)
        return hit
    counts = torch.tensor(blocks, dtype=torch.int64)
    bmap = torch.repeat_interleave(torch.arange(len(blocks), dtype=torch.int32), counts).to(device)
    _BLOCK_MAPS[key] = bmap
    if len(_BLOCK_MAPS) > _BLOCK_MAPS_MAX:
        _BLOCK_MAPS.popitem(last=False)
    return bmap


def _launch(params, bufs, updates, lr, momentum, block, num_warps) -> None:
    p0, b0, u0 = params[0], bufs[0], updates[0]
    cdt = torch.float64 if torch.float64 in (p0.dtype, b0.dtype) else torch.float32
    # lr and μ travel in the table as float64 bit patterns: exact for float64 params, and one
    # host-to-device copy per launch carries everything.
    rows, blocks, first = list(struct.unpack("<2q", struct.pack("<2d", lr, momentum))), [], 0
    for p, b, u in zip(params, bufs, updates):
        nb = triton.cdiv(p.numel(), block)
        rows += (p.data_ptr(), b.data_ptr(), u.data_ptr(), p.numel(), first)
        blocks.append(nb)
        first += nb
    aligned = all(a % 16 == 0 for r in range(2, len(rows), 5) for a in rows[r : r + 3])
    device = p0.device
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        # From pinned memory the copy is a true async DMA on the current stream (pageable memory
        # is staged by the driver); the caching host allocator keeps the block until it is done.
        table = table.pin_memory()
    table = table.to(device, non_blocking=True)
    bmap = _block_map(blocks, device)
    # Triton launches on the current CUDA device and stream: make them the tensors' own
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        _launch_kernel(table, bmap, p0, b0, u0, cdt, aligned, first, block, num_warps)


def _launch_kernel(table, bmap, p0, b0, u0, cdt, aligned, first, block, num_warps) -> None:
    _nesterov_outer_kernel[(first,)](
        table,
        bmap,
        P_DTYPE=_TL[p0.dtype],
        B_DTYPE=_TL[b0.dtype],
        U_DTYPE=_TL[u0.dtype],
        C_DTYPE=_TL[cdt],
        ALIGNED=aligned,
        BLOCK=block,
        num_warps=num_warps,
    )


def nesterov_outer_triton(
    params,
    bufs,
    updates,
    lr: float,
    momentum: float,
    *,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """The update over every tensor: one kernel launch per device and (param, buf, update)
    dtype triple, each under its device (a list may span GPUs).

    params and bufs must be contiguous (checked); updates need not be (copied if not). Empty
    tensors are skipped. `block` (a power of two) is the elements per program.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (p, b, u) in enumerate(zip(params, bufs, updates)):
        if not (p.is_contiguous() and b.is_contiguous()):
            raise ValueError(f"nesterov_outer_triton: param and buf {i} must be contiguous")
        if p.numel():
            if not (p.device == b.device == u.device):
                raise ValueError(f"nesterov_outer_triton: param, buf and update {i} are on different devices")
            groups.setdefault((p.device, p.dtype, b.dtype, u.dtype), []).append(i)
    for idx in groups.values():
        _launch(
            [params[i] for i in idx],
            [bufs[i] for i in idx],
            # keep the contiguous copies alive until the launch has been queued
            [updates[i].contiguous() for i in idx],
            float(lr),
            float(momentum),
            block,
            num_warps,
        )
