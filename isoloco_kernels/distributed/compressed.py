"""`ShardedIsoLoCo(compress=Compression(...))`: the owner route with compressed pseudo-gradients,
and the arithmetic that the one-process simulation (optim/compressed.py) shares with it, so the two agree bit
for bit. docs/compression.md has the contract.

    every rank   c_k = Q(Δ_k + e_k),  e_k ← β·(Δ_k + e_k − c_k)     each tensor whole (compress/); e_k kept
                                                                    by the worker, in the residual dtype
    all-to-all   each owner receives every rank's payload of the tensors it owns (bytes; a solo tensor: a
                 gather): a reduce-scatter cannot sum packed integers
    owner        A = Σ_k deq(c_k) in float32 (ranks in order), mean = A / K rounded once to θ's dtype;
                 M = iso(mean) (2-D, iso groups) or the mean, or another merge of the K dequantized Δ_k
                 buf ← μ·buf + M;  s = −lr·(M + μ·buf)      float32 (float64 for float64 θ); μ = 0: s = −lr·M
                 update="compressed": u = Q(s + e_u), e_u ← β·(s + e_u − u), e_u kept by the owner in
                 float32 (or the spec's residual dtype); "full": u = θ + s rounded once to θ's dtype
    all-gather   every rank, the owner included, receives u (solo: a broadcast) and applies the same bytes:
                 θ ← θ + deq(u), summed in float32 and rounded once to θ's dtype ("full": θ ← u)

What goes back is the step's change s (the Nesterov step −lr·(M + μ·buf)), never θ in low precision; with
update="full" the owner's new θ in its own dtype (what s in θ's dtype would cost). The momentum stays on the
owner in full precision. Stochastic rounding draws stream k + 1 for worker k's Δ and stream 0 for the
owner's update (`stream_spec`), each seeded by (seed, step = the optimizer's step count, tensor = the param
index, element). The spec's `feedback` ("workers", the default; "both"; "owner") says which legs keep a
residual (the route above with e_k and e_u is "both"; "workers" sends u = Q(s), "owner" c_k = Q(Δ_k)): a leg
without one compresses with `spec.leg(...)`, the spec without error feedback, and keeps nothing. All or
nothing: every buffer is made and every Δ compressed (NaN/Inf refused) before the ranks first agree; the
new params, momentum and residuals are computed aside and written only after the last agreement, so a
refused step changes nothing on any rank.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from .._validate import ResultOverflowError, check_all_finite, compute_dtype
from ..compress import Compression, Packed, bytes_of, compress, decompress_add_, parse
from ..compress.codec import mix32
from ..merges import merge_groups
from ..outer import core as outer
from .agree import Agreement, all_gather_single, comm_device
from .plan import ShardPlan

__all__ = [
    "apply_update",
    "attach",
    "encode_delta",
    "layout",
    "owner_inputs",
    "owner_step",
    "sharded_step",
    "stream_spec",
    "update_sizes",
    "wire_bytes",
]

#: The stochastic-rounding stream of the owner's update; worker k's Δ draws stream k + 1.
UPDATE_STREAM = 0


def attach(opt, compress, where: str) -> None:
    """Set opt.compress (a Compression, a spec string for `compress.parse`, or None) and its empty
    residuals: opt._residuals (this worker's, per param index) and opt._update_residuals (the owner's)."""
    if isinstance(compress, str):
        try:
            compress = parse(compress)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if compress is not None and not isinstance(compress, Compression):
        raise TypeError(
            f"{where}: compress must be a Compression, a spec string such as 'int4:128:0.95', or None; "
            f"got {type(compress).__name__}"
        )
    opt.compress, opt._residuals, opt._update_residuals = compress, {}, {}


def stream_spec(spec: Compression, stream: int) -> Compression:
    """The spec whose seed draws stream `stream`'s rounding bits (nearest rounding draws none)."""
    return dataclasses.replace(spec, seed=mix32(spec.seed ^ mix32(stream)))


def encode_delta(spec, delta, residual, *, step: int, index: int, worker: int, name: str):
    """(payload, new residual) of worker `worker`'s Δ of param `index` (compress.compress, stream worker + 1), with
    the worker leg's spec (`spec.leg("workers")`: the new residual is None where that leg has no feedback)."""
    leg = spec.leg("workers")
    return compress(delta, residual, stream_spec(leg, worker + 1), step=step, tensor_id=index, name=name)


def owner_inputs(opt, params, payloads: dict[int, list]) -> dict[int, torch.Tensor]:
    """What the owner merges, from every worker's payload (in worker order) of each of its tensors: the mean
    (merge "iso_c" or "mean": the sum in float32, float64 for float64 params, divided by K, rounded once to
    θ's dtype) or the [K, *shape] stack of each worker's dequantized Δ in θ's dtype (the other merges)."""
    stack = opt.merge not in ("iso_c", "mean")
    out = {}
    for i, packs in payloads.items():
        p = params[i]
        cd = compute_dtype(p.dtype)
        if stack:
            rows = [decompress_add_(torch.zeros(p.numel(), dtype=cd, device=p.device), pk) for pk in packs]
            out[i] = torch.stack(rows).to(p.dtype).view(len(packs), *p.shape)
        else:
            acc = torch.zeros(p.numel(), dtype=cd, device=p.device)
            for pk in packs:
                decompress_add_(acc, pk)
            out[i] = acc.div_(len(packs)).to(p.dtype).view(p.shape)
    # every payload decodes to finite values (compress refuses the rest), so a non-finite result is an overflow
    # of the workers' sum (or of its rounding to θ's dtype): said as such, not as an Inf input
    for i in sorted(out):
        if not bool(torch.isfinite(out[i]).all()):
            raise ResultOverflowError(
                f"the {'stack' if stack else 'mean'} of the workers' decompressed Δ of param {i} (shape "
                f"{tuple(params[i].shape)}) does not fit {params[i].dtype}: "
                f"{'a worker' if stack else 'their sum'} overflows near the dtype's largest values; nothing was changed",
                tensor=i,
            )
    return out


def owner_step(opt, params, groups, inputs: dict[int, torch.Tensor], buckets=None):
    """The owner's step on its tensors: M (Iso-C of the mean in iso groups, the mean, or the merge of the
    stacks), Nesterov from the held momentum, and the update u of each (module docstring). Reads opt's
    compress, merge, merge_options, method, merged_steps, state and _update_residuals; writes nothing.
    Returns (buckets for the next Iso-C, {i: new momentum or None (μ = 0: untouched)}, {i: new update
    residual} (empty where the update leg has no feedback: `spec.leg("owner")`), {i: u: a Packed, or θ' in
    θ's dtype for update="full"})."""
    spec, step = opt.compress.leg("owner"), opt.merged_steps
    idx = sorted(inputs)
    if opt.merge in ("iso_c", "mean"):
        m = dict(inputs)
        if opt.merge == "iso_c":
            iso = [i for i in idx if inputs[i].ndim == 2 and inputs[i].numel() and groups[i]["iso"]]
            names = [f"{type(opt).__name__}: param {i} (shape {tuple(params[i].shape)})" for i in iso]
            buckets, views = outer.bucket_flatten([inputs[i] for i in iso], opt.method, names, buckets)
            m.update(zip(iso, views))
    else:
        merged = {i for i in idx if groups[i]["iso"]}
        out = merge_groups(inputs, merged, opt.merge, opt.merge_options, step, opt.method)
        m = {i: t.to(params[i].dtype) for i, t in out.items()}
    bufs, residuals, updates, changes = {}, {}, {}, {}
    # The Nesterov op on scratch from θ = 0, one call per (lr, μ): change = −lr·(M + μ·buf'), buf' = μ·buf + M
    # (a new buffer starts at zero: buf' = M exactly; μ = 0, torch.optim.SGD's rule: the held buffer is not
    # touched). The scratch params are known to be 0; the op reads the buffers and the updates once.
    calls: dict[tuple[float, float], list[int]] = {}
    for i in idx:
        calls.setdefault((float(groups[i]["lr"]), float(groups[i]["momentum"])), []).append(i)
    for (lr, mu), ids in calls.items():
        gs = [m[i].to(compute_dtype(params[i].dtype)) for i in ids]
        held = [
            opt.state[params[i]].get("momentum_buffer") if params[i] in opt.state and mu != 0 else None for i in ids
        ]
        bs = [torch.zeros_like(g) if h is None else h.to(g.dtype, copy=True) for g, h in zip(gs, held)]
        cs = [torch.zeros_like(g) for g in gs]
        nan = float("nan")
        try:
            torch.ops.isoloco.nesterov_outer_(cs, bs, gs, lr, mu, [0.0] * len(ids) + [nan] * (2 * len(ids)))
        except ResultOverflowError as e:
            i = ids[e.tensor] if e.tensor is not None else ids[0]
            name = f"the update of param {i} (shape {tuple(params[i].shape)})"
            raise ResultOverflowError(f"{name}: {str(e).split(': ', 2)[-1]}", tensor=i) from None
        for i, b, c in zip(ids, bs, cs):
            bufs[i], changes[i] = (None if mu == 0 else b), c
    for i in idx:
        p, change = params[i], changes[i]
        name = f"the update of param {i} (shape {tuple(p.shape)})"
        if spec.update == "full":
            updates[i] = (p.detach().to(change.dtype) + change).to(p.dtype)
            check_all_finite([updates[i]], [name])
        else:
            e = opt._update_residuals.get(i)
            updates[i], e = compress(change, e, stream_spec(spec, UPDATE_STREAM), step=step, tensor_id=i, name=name)
            if e is not None:
                residuals[i] = e
    return buckets, bufs, residuals, updates


def apply_update(p: torch.Tensor, u) -> torch.Tensor:
    """θ' of param p from its update u, computed aside: θ + deq(u) summed in float32 (float64 for float64 θ)
    and rounded once to θ's dtype (`compress.decompress_add_`), or u itself (update="full": θ' already)."""
    if not isinstance(u, Packed):
        return u.view(p.shape)
    new = p.detach().reshape(-1).clone()
    return decompress_add_(new, u).view(p.shape)


def write(opt, params, new_params, bufs, residuals, update_residuals) -> None:
    """The step's writes, after the last agreement: θ', the momentum buffers, the residuals (of the legs with
    error feedback: a leg without one keeps none)."""
    for p, t in zip(params, new_params):
        p.copy_(t)
    for i, b in bufs.items():
        if b is None:
            continue
        held = opt.state[params[i]].get("momentum_buffer") if params[i] in opt.state else None
        if held is None:
            opt.state[params[i]]["momentum_buffer"] = b
        else:
            held.copy_(b)
    if opt.compress.ef_beta is not None:
        opt._residuals = {i: r for i, r in residuals.items() if r is not None}
        opt._update_residuals.update({i: r for i, r in update_residuals.items() if r is not None})


# -- the route over ranks -----------------------------------------------------------------------------------


def _aligned(n: int) -> int:
    return -(-n // 8) * 8  # each payload starts 8-aligned: its scales (or θ' in its dtype) are read in place


def layout(plan: ShardPlan, sizes) -> tuple[list[list[tuple[int, int]]], int]:
    """([per rank: (tensor index, byte offset)], padded segment bytes) of one leg's byte segments: each rank's
    tensors (solo ones aside) in index order, each payload of sizes[i] bytes at an 8-aligned offset."""
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(plan.world_size)]
    fill = [0] * plan.world_size
    for i, o in enumerate(plan.owners):
        if i not in plan.solo:
            per_rank[o].append((i, fill[o]))
            fill[o] += _aligned(sizes[i])
    return per_rank, max(fill, default=0)


def update_sizes(plan: ShardPlan, spec: Compression) -> tuple[list[int], list[int]]:
    """Bytes of each tensor's payload on the all-to-all leg and on the all-gather leg."""
    n = [plan.numel(i) for i in range(len(plan.shapes))]
    back = [
        bytes_of(spec, k) if spec.update == "compressed" else k * torch.empty((), dtype=dt).element_size()
        for k, dt in zip(n, plan.dtypes)
    ]
    return [bytes_of(spec, k) for k in n], back


def wire_bytes(plan: ShardPlan, spec: Compression) -> dict[str, float]:
    """Bytes one rank hands to the route's collectives per step, padding included: 'all_to_all' ((W − 1)
    segments) and 'all_gather' ((W − 1) segments, the ring's share), solo gathers and broadcasts averaged
    over the ranks ((W − 1)/W of each payload), and 'allreduce_fp32' (2·(W − 1)/W·4 bytes per entry)."""
    w = plan.world_size
    out, back = update_sizes(plan, spec)
    legs = {}
    for leg, sizes in (("all_to_all", out), ("all_gather", back)):
        legs[leg] = (w - 1) * layout(plan, sizes)[1] + sum(sizes[i] for i in plan.solo) * (w - 1) / w
    legs["allreduce_fp32"] = 2 * (w - 1) / w * 4 * sum(plan.numel(i) for i in range(len(plan.shapes)))
    return legs


class _Buffers:
    """Every buffer of one compressed step, made before the ranks first agree (uint8, on the comm device):
    the all-to-all's send / recv, the all-gather's own segment / result, a solo tensor's send buffer (every
    rank), its [K] gather list (its owner) and its broadcast buffer (every rank)."""

    def __init__(self, opt):
        plan, rank, w = opt.plan, opt.rank, opt.world_size
        dev = comm_device(opt.process_group) if w > 1 else opt._data_device
        self.sizes = s1, s2 = update_sizes(plan, opt.compress)
        (out, self.seg1), (back, seg2) = layout(plan, s1), layout(plan, s2)
        self.at1 = {i: (o, off) for o, entries in enumerate(out) for i, off in entries}
        self.at2 = {i: (o * seg2 + off, off) for o, entries in enumerate(back) for i, off in entries}
        self.send = torch.zeros(w * self.seg1, dtype=torch.uint8, device=dev)  # padding travels as zeros
        self.recv = torch.empty(w * self.seg1, dtype=torch.uint8, device=dev) if w > 1 else self.send
        self.own = torch.zeros(seg2, dtype=torch.uint8, device=dev)
        self.every = torch.empty(w * seg2, dtype=torch.uint8, device=dev) if w > 1 else self.own
        solo = sorted(plan.solo)
        self.solo_send = {i: torch.zeros(s1[i], dtype=torch.uint8, device=dev) for i in solo}
        mine = [i for i in solo if plan.owners[i] == rank]
        self.parts = {i: [torch.empty(s1[i], dtype=torch.uint8, device=dev) for _ in range(w)] for i in mine}
        self.solo_back = {i: torch.zeros(s2[i], dtype=torch.uint8, device=dev) for i in solo}

    def outgoing(self, i: int) -> torch.Tensor:
        """Where this rank's payload of tensor i goes on the all-to-all leg."""
        if i in self.solo_send:
            return self.solo_send[i]
        o, off = self.at1[i]
        return self.send.narrow(0, o * self.seg1 + off, self.sizes[0][i])

    def incoming(self, i: int, k: int) -> torch.Tensor:
        """Worker k's payload of tensor i (owned here), as received."""
        if i in self.parts:
            return self.parts[i][k]
        return self.recv.narrow(0, k * self.seg1 + self.at1[i][1], self.sizes[0][i])

    def update(self, i: int, mine: bool) -> torch.Tensor:
        """Tensor i's update payload: its slot in my own segment (mine=True), or the all-gathered copy."""
        if i in self.solo_back:
            return self.solo_back[i]
        start, off = self.at2[i]
        return self.own.narrow(0, off, self.sizes[1][i]) if mine else self.every.narrow(0, start, self.sizes[1][i])


def _payload(spec, p, buf: torch.Tensor):
    """A received update payload: a Packed (update="compressed") or θ' in p's dtype ("full")."""
    if spec.update == "compressed":
        return Packed.from_wire(buf, spec, p.numel())
    return buf.view(p.dtype)


def _wire(u) -> torch.Tensor:
    return u.wire() if isinstance(u, Packed) else u.detach().reshape(-1).view(torch.uint8)


def _global(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


def sharded_step(opt, closure):
    """`ShardedIsoLoCo.step` with a compression spec (module docstring); returns the closure's loss.

    check → buffers → compress → agree → all-to-all → owner step → all-gather → every θ' → agree → write."""
    ag = Agreement("ShardedIsoLoCo.step", opt.process_group)
    loss = None
    if closure is not None:  # a closure that raises on one rank must still reach the agreement
        with torch.enable_grad():
            loss = ag.attempt(closure)
    grads = ag.attempt(opt._check)  # every grad finite, before anything is compressed
    bufs = ag.attempt(_Buffers, opt)
    residuals = ag.attempt(_encode, opt, grads, bufs)
    ag.settle(settings=ag.attempt(opt._settings))
    plan, group, spec = opt.plan, opt.process_group, opt.compress
    if opt.world_size > 1:
        dist.all_to_all_single(bufs.recv, bufs.send, group=group)
    for i in sorted(plan.solo):
        dist.gather(bufs.solo_send[i], bufs.parts.get(i), dst=_global(group, plan.owners[i]), group=group)
    mine = opt.mine
    payloads = ag.attempt(
        lambda: {
            i: [Packed.from_wire(bufs.incoming(i, k), spec, plan.numel(i)) for k in range(opt.world_size)] for i in mine
        }
    )
    groups = [opt.param_groups[k] for k in opt._group_of]
    inputs = ag.attempt(owner_inputs, opt, opt._params, payloads)
    owned = ag.attempt(owner_step, opt, opt._params, groups, inputs, opt._buckets)
    ag.attempt(lambda: [bufs.update(i, True).copy_(_wire(owned[3][i])) for i in mine])
    if opt.world_size > 1:
        all_gather_single(bufs.every, bufs.own, group=group)
    for i in sorted(plan.solo):
        dist.broadcast(bufs.solo_back[i], src=_global(group, plan.owners[i]), group=group)
    new = ag.attempt(_apply_all, opt, bufs)
    ag.settle()
    opt._buckets = owned[0]
    write(opt, opt._params, new, owned[1], residuals, owned[2])
    opt.merged_steps += 1
    return loss


def _encode(opt, grads, bufs: _Buffers) -> dict[int, Optional[torch.Tensor]]:
    """This rank's payload of every tensor into the all-to-all's buffers; returns the new residuals."""
    new = {}
    for i, (p, g) in enumerate(zip(opt._params, grads)):
        name = f"param {i} (shape {tuple(p.shape)}) on rank {opt.rank}"
        packed, new[i] = encode_delta(
            opt.compress,
            g.detach().to(p.dtype),
            opt._residuals.get(i),
            step=opt.merged_steps,
            index=i,
            worker=opt.rank,
            name=name,
        )
        bufs.outgoing(i).copy_(packed.wire())
    return new


def _apply_all(opt, bufs: _Buffers) -> list[torch.Tensor]:
    """Every param's θ' from the all-gathered updates (the owner's own too), checked finite."""
    new = [apply_update(p, _payload(opt.compress, p, bufs.update(i, False))) for i, p in enumerate(opt._params)]
    check_all_finite(new, [f"param {i} after the step" for i in range(len(new))])
    return new


# -- the residuals in state dicts ----------------------------------------------------------------------------


def spec_fields(spec: Compression) -> dict:
    """A spec as plain values (its residual dtype as a string), as state dicts keep it (feedback included;
    `check_entry` reads a state saved before that field existed as feedback "both")."""
    out = dataclasses.asdict(spec)
    out["residual_dtype"] = None if spec.residual_dtype is None else str(spec.residual_dtype)
    return out


def state_entry(opt) -> dict:
    """The "compress" entry of a state dict: the spec's fields, this worker's residuals (param index →
    tensor; MergeLoCo: each param's [K, *shape]) and the owner's update residuals (param index → tensor)."""
    return {
        "spec": spec_fields(opt.compress),
        "residuals": dict(opt._residuals),
        "update_residuals": dict(opt._update_residuals),
    }


def _feedback_hint(spec: Compression, got, want: dict) -> str:
    """How to continue a state whose spec differs from this one in the feedback placement only ("" otherwise)."""
    if not isinstance(got, dict) or {k for k in want if got.get(k) != want[k]} != {"feedback"}:
        return ""
    fb = got["feedback"]
    try:
        text = dataclasses.replace(spec, feedback=fb).cli()
    except (TypeError, ValueError):
        return ""
    old = "; a state saved before Compression.feedback existed is 'both'" if fb == "both" else ""
    return (
        f" (its error feedback placement is feedback={fb!r}, this optimizer's {want['feedback']!r}: to continue it "
        f"pass feedback={fb!r} to Compression (as a string: {text!r}){old})"
    )


def check_entry(opt, state_dict, where: str, params, owned, stacked: bool = False):
    """The "compress" entry of `state_dict` checked against opt's spec and params: (residuals, update
    residuals) as copies on the params' devices, ready for `load_entry`; None when there is no entry (the
    residuals then restart from zero). `owned`: the params whose update residuals this optimizer keeps;
    `stacked`: the residuals are [K, *shape] (MergeLoCo's K workers, one K for all), else one worker's; a leg
    without error feedback (`spec.leg`) must hold none. Raises ValueError naming what differs (another spec,
    a residual of another shape or dtype, NaN/Inf), before anything is loaded."""
    entry = state_dict.get("compress") if isinstance(state_dict, dict) else None
    if entry is None:
        return None
    if opt.compress is None:
        raise ValueError(
            f"{where}: the state holds error-feedback residuals of compression {entry.get('spec')!r} but this "
            "optimizer has compress=None; build it with the same compress=, or drop the 'compress' entry"
        )
    want = spec_fields(opt.compress)
    got = entry.get("spec") if isinstance(entry, dict) else entry
    if isinstance(got, dict) and "feedback" not in got:  # saved before the field existed: both legs
        got = dict(got, feedback="both")
    if not isinstance(entry, dict) or got != want:
        raise ValueError(
            f"{where}: the state was saved with compression {got!r}; this optimizer has {want!r}: residuals of "
            "another format, block, β, rounding, update leg, seed or feedback placement cannot continue here"
            + _feedback_hint(opt.compress, got, want)
        )
    held = entry.get("residuals")
    first = next(iter(held.values()), None) if isinstance(held, dict) else None
    lead = (first.shape[0],) if stacked and isinstance(first, torch.Tensor) and first.ndim else ()
    out = []
    for key, leg, idx, shape_of, dtype_of in (
        ("residuals", "workers", range(len(params)), lambda p: lead + tuple(p.shape), None),
        ("update_residuals", "owner", owned, lambda p: tuple(p.shape), compute_dtype),
    ):
        got = entry.get(key)
        if opt.compress.leg(leg).ef_beta is None and got:  # feedback elsewhere: this leg keeps none
            raise ValueError(f"{where}: the 'compress' entry holds {key} but feedback={opt.compress.feedback!r}")
        if not isinstance(got, dict) or (got and set(got) != set(idx)):
            keys = sorted(got) if isinstance(got, dict) else got
            raise ValueError(f"{where}: the 'compress' entry's {key} must cover params {list(idx)}, got {keys}")
        for i, t in got.items():
            p = params[i]
            dt = opt.compress.residual_dtype or (dtype_of(p.dtype) if dtype_of else p.dtype)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape_of(p) or t.dtype != dt:
                what = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{where}: {key} of param {i} is {what}; expected {shape_of(p)} {dt}")
        check_all_finite([got[i] for i in sorted(got)], [f"{where}: {key} of param {i}" for i in sorted(got)])
        out.append({i: got[i].detach().to(params[i].device, copy=True) for i in sorted(got)})
    return tuple(out)


def load_entry(opt, checked) -> None:
    """Install what `check_entry` returned (None: no residuals, the next step starts them from zero)."""
    opt._residuals, opt._update_residuals = checked if checked is not None else ({}, {})
