"""`MergeLoCo(compress=...)`: the compressed owner route of `ShardedIsoLoCo(compress=...)` simulated in one
process, for K workers whose Δ_k arrive as [K, *shape] stacks — bit for bit what K ranks compute.

    worker k     c_k = Q(Δ_k + e_k), e_k ← β·(Δ_k + e_k − c_k)   each param's e kept as one [K, *shape] residual
    owner r      of the tensors `plan_shards(shapes, K)` gives rank r, exactly as ShardedIsoLoCo's rank r:
                 the mean (or stack) of the dequantized payloads, Iso-C (batched over r's tensors only) or
                 the merge, Nesterov, the update u (compressed, with the owner's residual, or θ' in full)
    every rank   θ ← θ + deq(u)  (one copy here: the replicas are identical)

With ef_beta set, spec.feedback says which residuals are kept: "workers" (the default: no update residual),
"both" (the workers' and the owner's) or "owner" (no worker residual): `Compression.leg`.

The arithmetic is distributed/sharded.py's own functions (ShardedIsoLoCo's compressed route) (encode_delta, owner_inputs, owner_step,
apply_update), called with the same payloads in the same order, so `MergeLoCo(compress=spec)` fed the K
stacks and `ShardedIsoLoCo(compress=spec)` on K ranks (rank k's grad = stack[k]) write equal params
(torch.equal) in float32, bfloat16 and float16; tests/test_compress_sharded.py checks it on 2 and 3 ranks.
All or nothing: everything is computed aside and written at the end, so a refused step (NaN/Inf in a Δ,
an update that overflows) changes no param, momentum, residual or step count.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._validate import check_all_finite, check_writable
from ..compress import allreduce_bytes, model_exchange_bytes
from ..distributed import sharded
from ..distributed.plan import plan_shards

__all__ = ["simulated_step", "worker_bytes"]


def simulated_step(opt, stacks: Sequence[Optional[torch.Tensor]]) -> None:
    """One compressed outer step of `MergeLoCo` (module docstring) on checked stacks, one per param."""
    where = "MergeLoCo.step"
    params = [p for p, _ in opt._params()]
    groups = [g for g in opt.param_groups for _ in g["params"]]
    missing = [i for i, d in enumerate(stacks) if d is None]
    if missing:
        raise ValueError(
            f"{where}: with compress every param needs a stack (each worker sends every tensor); none for "
            f"params {missing[:8]}"
        )
    K = stacks[0].shape[0] if stacks else 0
    held = opt._residuals
    if held and next(iter(held.values())).shape[0] != K:
        raise ValueError(
            f"{where}: the error-feedback residuals are of {next(iter(held.values())).shape[0]} workers, the stacks "
            f"of {K}: K must stay the same (or load a state of K workers)"
        )
    # what the step writes (every param, each held momentum buffer), checked together before anything is
    # computed, as every other step does: no two sharing memory, no expanded view, inference or meta tensor
    held_bufs = [
        (i, opt.state[p]["momentum_buffer"]) for i, p in enumerate(params) if "momentum_buffer" in opt.state[p]
    ]
    check_writable(
        [p.detach() for p in params] + [b for _, b in held_bufs],
        [f"{where}: param {i} (shape {tuple(p.shape)})" for i, p in enumerate(params)]
        + [f"{where}: param {i}'s momentum_buffer" for i, _ in held_bufs],
    )
    specs, step = opt._specs, opt.merged_steps  # per param (None: kept in full precision), set with its group
    payloads, residuals = {}, {}
    with torch.no_grad():
        for i, p in enumerate(params):
            rows = []
            payloads[i] = []
            for k in range(K):
                packed, r = sharded.encode_delta(
                    specs[i],
                    stacks[i][k].detach().to(p.dtype),
                    held[i][k] if i in held else None,
                    step=step,
                    index=i,
                    worker=k,
                    name=f"worker {k}'s Δ of param {i} (shape {tuple(p.shape)})",
                )
                payloads[i].append(packed)
                rows.append(r)
            if specs[i] is not None and specs[i].leg("workers").ef_beta is not None:  # the workers' leg's residuals
                residuals[i] = torch.stack(rows)
        plan = plan_shards(
            [p.shape for p in params],
            max(K, 1),
            dtypes=[p.dtype for p in params],
            iso=[bool(g["iso"]) and p.ndim == 2 for g, p in zip(groups, params)],
            solo_above=None,
        )
        bufs, updates, owned = {}, {}, {}
        for r in range(plan.world_size):  # each rank's owner step on its own tensors, as ShardedIsoLoCo's
            mine = plan.owned(r)
            inputs = sharded.owner_inputs(opt, params, {i: payloads[i] for i in mine}, specs)
            _, b, e, u = sharded.owner_step(opt, params, groups, inputs, specs)
            bufs.update(b)
            owned.update(e)
            updates.update(u)
        new = [sharded.apply_update(p, updates[i]) for i, p in enumerate(params)]
        check_all_finite(new, [f"{where}: param {i} after the step" for i in range(len(new))])
        sharded.write(opt, params, new, bufs, residuals, owned)
    opt.merged_steps += 1


def worker_bytes(spec, params: Sequence[torch.Tensor], workers: int, names=None) -> dict[str, float]:
    """Bytes one worker sends per outer round on the compressed owner route (`compress.model_exchange_bytes`:
    both legs, scales included, a param the skip rule keeps (by shape, or by `names`) in its dtype) and on an
    fp32 ring all-reduce of the same tensors."""
    shapes, dtypes = [p.shape for p in params], [p.dtype for p in params]
    return {
        "compressed": model_exchange_bytes(spec, shapes, workers, dtypes, names) if spec else None,
        "allreduce_fp32": sum(allreduce_bytes(p.numel(), workers, 4) for p in params),
    }
