"""The sharded outer step of a merge that needs every worker's Δ (`ShardedIsoLoCo(merge=...)`), and
the checks of a `ShardedIsoLoCo` state dict (its rank and shard plan).

Iso-C and the mean need only the average, which a reduce-scatter delivers (sharded.py). TSV-M,
Iso-CTS, TIES and DARE need the K workers' own deltas of each matrix — on its owner only:

    all-to-all   each rank sends the owner of every tensor its own Δ of it; an owner receives the
                 world's K = world copies of exactly the tensors it owns ([K, segment] per dtype)
    gather       a solo tensor (one large enough to travel alone) goes to its owner as [K, numel]
    owner        merges.merge of its stacks, then the Nesterov step (sharded.py), all-gather θ

Bytes per rank: the all-to-all sends (K − 1)/K of this rank's Δ (the part it owns stays), the
all-gather the same again: the bytes of one all-reduce (2·(K − 1)/K of the params), against
(K − 1) copies of everything for an all-gather of every worker's Δ (the official code's way).
Every buffer is made before the ranks first agree (`merge_buffers`); the local work between the
collectives runs under the step's `attempt`, so a failure on one rank reaches every rank.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .plan import ShardPlan

__all__ = ["check_sharded_state", "exchange_workers", "merge_buffers", "merged_updates", "wire_bytes"]


def merge_buffers(plan: ShardPlan, rank: int, device) -> dict:
    """(send, recv, own) per sharded dtype and the owner's [K, numel] gather list per solo tensor."""
    out: dict = {}
    world = plan.world_size
    for dt in plan.sharded_dtypes:
        _, seg = plan.layout(dt)
        send = torch.zeros(world * seg, dtype=dt, device=device)  # padding travels as zeros
        recv = torch.empty(world * seg, dtype=dt, device=device)
        out[("a2a", dt)] = (send, recv, torch.zeros(seg, dtype=dt, device=device))
    for i in sorted(plan.solo):
        if plan.owners[i] == rank:
            out[("solo", i)] = [torch.empty(plan.numel(i), dtype=plan.dtypes[i], device=device) for _ in range(world)]
    return out


def exchange_workers(
    plan: ShardPlan, flat_of: Callable[[int], torch.Tensor], rank: int, group, bufs: dict, attempt, device
) -> tuple[dict, dict[int, torch.Tensor]]:
    """Every worker's Δ of the tensors this rank owns: (my all-gather segment per dtype, tensor
    index → [K, *shape] stack). flat_of(i): this rank's flat Δ of tensor i (None where its local
    work failed: the rank still runs every collective, and the step fails at its next agreement)."""
    world = plan.world_size
    segments, stacks = {}, {}
    for dt in plan.sharded_dtypes:
        per_rank, seg = plan.layout(dt)
        send, recv, own = bufs[("a2a", dt)]

        def pack(per_rank=per_rank, seg=seg, send=send):
            for r in range(world):
                for i, off in per_rank[r]:
                    n = plan.numel(i)
                    send[r * seg + off : r * seg + off + n].copy_(flat_of(i))

        attempt(pack)
        dist.all_to_all_single(recv, send, group=group)
        got = recv.view(world, seg)
        for i, off in per_rank[rank]:
            stacks[i] = got[:, off : off + plan.numel(i)].reshape(world, *plan.shapes[i])
        segments[dt] = own
    for i in sorted(plan.solo):
        owner = plan.owners[i]
        dst = dist.get_global_rank(group, owner) if group is not None else owner
        src = attempt(lambda i=i: flat_of(i).contiguous())
        if src is None:  # this rank failed locally: still take part, with zeros
            src = torch.zeros(plan.numel(i), dtype=plan.dtypes[i], device=device)
        parts = bufs.get(("solo", i)) if rank == owner else None
        dist.gather(src, parts, dst=dst, group=group)
        if rank == owner:
            stacks[i] = torch.stack(parts).reshape(world, *plan.shapes[i])
    return segments, stacks


def wire_bytes(plan: ShardPlan) -> dict[str, int]:
    """Bytes one rank sends in a step, per route, padding included (the ring algorithms' counts):
    'merge' (all-to-all + all-gather + solo gather/broadcast), 'allreduce' (2·(K − 1)/K of the
    params), 'allgather_deltas' (every worker's Δ to every rank: (K − 1) copies)."""
    world = plan.world_size
    size = {dt: torch.empty((), dtype=dt).element_size() for dt in set(plan.dtypes)}
    seg = sum(plan.layout(dt)[1] * size[dt] for dt in plan.sharded_dtypes)
    solo = sum(plan.numel(i) * size[plan.dtypes[i]] for i in plan.solo)
    total = sum(plan.numel(i) * size[plan.dtypes[i]] for i in range(len(plan.shapes)))
    return {
        "merge": 2 * (world - 1) * seg + 2 * solo * (world - 1) // world,
        "allreduce": 2 * total * (world - 1) // world,
        "allgather_deltas": total * (world - 1),
    }


def merged_updates(opt, stacks: dict[int, torch.Tensor], merge_groups) -> dict[int, torch.Tensor]:
    """A `ShardedIsoLoCo`'s merge of the [K, *shape] stacks of its own tensors (`merges.merge_groups`,
    as `MergeLoCo.set_deltas` runs it: the same stack ids and DARE seed, so the same result)."""
    merged = {i for i in stacks if opt.param_groups[opt._group_of[i]]["iso"]}
    out = merge_groups(stacks, merged, opt.merge, opt.merge_options, opt.merged_steps, opt.method)
    return {i: m.to(opt._params[i].dtype) for i, m in out.items()}


def check_sharded_state(opt, state_dict, where: str) -> dict:
    """A `ShardedIsoLoCo` state dict checked against this optimizer's rank and shard plan; returns
    it without its 'sharding' entry (what `outer.load_sgd_state` loads)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"{where}: expected a dict, got {type(state_dict).__name__}")
    info = state_dict.get("sharding")
    if info is None:
        raise ValueError(
            f"{where}: the state has no 'sharding' entry (it was not saved by "
            "ShardedIsoLoCo.state_dict()); per-rank momentum cannot be matched to this plan"
        )
    if info["world_size"] != opt.world_size or info["fingerprint"] != opt.plan.fingerprint:
        raise ValueError(
            f"{where}: the state was saved under a different shard plan "
            f"(world size {info['world_size']}, plan {info['fingerprint']:#x}); this optimizer has world "
            f"size {opt.world_size}, plan {opt.plan.fingerprint:#x}; it needs the same params (shapes, "
            "dtypes, order) and world size"
        )
    if info["rank"] != opt.rank:
        raise ValueError(
            f"{where}: the state was saved by rank {info['rank']}, this is rank {opt.rank}; load each rank's own state"
        )
    rest = {k: v for k, v in state_dict.items() if k != "sharding"}
    extra = sorted(set(rest.get("state", {})) - set(opt.mine))
    if extra:
        raise ValueError(f"{where}: the state holds momentum for params {extra[:8]} that rank {opt.rank} does not own")
    return rest
