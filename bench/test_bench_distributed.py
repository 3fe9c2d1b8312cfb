"""The IsoLoCo outer step over a process group: replicated vs sharded, vs world size.

    pytest bench/test_bench_distributed.py --benchmark-only [--bench-full]

The quick run (no --bench-full) times ref-tiny at 1 and 2 ranks; --bench-full adds llama-tiny and 4 ranks.

Each world size (1, 2; 4 with --bench-full) is one group of gloo processes on 127.0.0.1, spawned once per module and
driven over pipes. Per case the workers build the model-shaped params of a set from bench/shapes.py
(every weight and norm of the decoder) with fixed random pseudo-gradients that differ per rank, and
a timed round is one outer step on every rank:

    replicated   average_(p.grad) (bucketed all-reduce) then IsoLoCo.step() on every rank
                 (DiLoCo's layout: every rank flattens every matrix)
    sharded      ShardedIsoLoCo.step(): reduce-scatter, Iso-C + Nesterov of owned params, all-gather
    int8 / int4 / int2
                 ShardedIsoLoCo(compress="<format>:128:0.95").step(): each rank's Δ (+ its residual) quantized
                 and packed, an all-to-all of the packed chunks, the owners' fp32 sum, Iso-C + Nesterov, the
                 update packed in the same format, an all-gather (docs/compression.md "The route")

The time is the parent's round trip: command out, every rank's step, every rank's reply; the
round trip of an empty command (extra_info "ipc_overhead_s") is measured the same way. Restoring the
pseudo-gradients between rounds is untimed. Workers run with one torch thread each, so on a machine
with fewer cores than ranks the ranks share cores and the times say little about scaling; the bytes
do not depend on the machine.

Bytes (extra_info, per rank per step): "payload" counts the tensors handed to each collective
(all_reduce: the tensor; reduce-scatter: the input; all-gather: the output), "ring_wire" what a ring
algorithm sends from each rank for them: 2(W−1)/W of an all-reduce's payload, (W−1)/W of a
reduce-scatter's or all-gather's; a gather's or broadcast's tensor and an even all-to-all's input count (W−1)/W,
an all-to-all with split sizes (the compressed legs) every split but the rank's own: what leaves the rank. "vs_fp32_allreduce" is ring_wire over an fp32 all-reduce's ring bytes for the same params
(the targets at the spec's defaults: ≤ 0.27 at 8 bits, ≤ 0.14 at 4, ≤ 0.08 at 2).

Roofline (harness.roofline, the ceilings the parent measured in the same run): each rank's bytes are
the payload it hands to the collectives plus its step's compulsory traffic, Nesterov over the params
it keeps momentum for (read p, buf, u; write p, buf: 20 B per float32 element) and the read and write
of every matrix it flattens (8 B per element); its flops, the flatten work of those matrices (the
registry's models, harness.flatten_work). The case's bound is the slowest rank's. At one rank no
collective moves a byte and the bound is the step's own. "collective_GBps" is the payload over the
median alone. The ranks run with one thread each against ceilings measured with all of them.
"""

from __future__ import annotations

import multiprocessing as std_mp
import os
import socket
import time

import pytest
import torch

from bench import harness
from bench.shapes import SETS, bucket_shapes, decoder_param_shapes

WORLDS = (1, 2, pytest.param(4, marks=pytest.mark.bench_full))
CPU_SETS = (
    "ref-tiny",
    pytest.param("llama-tiny", marks=pytest.mark.bench_full),
    "dry-tiny",
)  # dry-tiny: --bench-dry-run
MODES = ("replicated", "sharded", "int8", "int4", "int2")
COMPRESSED = {"int8", "int4", "int2"}  # ShardedIsoLoCo(compress=f"{mode}:128:0.95")
REPLY_TIMEOUT_S = 600


# ----------------------------------------------------------------------------------------------
# Workers


class _Counter:
    """Wraps the collectives the outer step uses and adds up their payload and ring bytes."""

    def __init__(self, world: int):
        import torch.distributed as dist

        from isoloco_kernels.distributed import collectives as C
        from isoloco_kernels.distributed import pipeline as P

        self.world, self.payload, self.ring = world, 0, 0
        w = world

        def count(payload: int, ring_factor: float) -> None:
            self.payload += payload
            self.ring += int(payload * ring_factor)

        def nbytes(t):
            return t.numel() * t.element_size()

        ar, rs, ag = dist.all_reduce, P.reduce_scatter_single, P.all_gather_single

        def all_reduce(t, *a, **k):
            count(nbytes(t), 2 * (w - 1) / w)
            return ar(t, *a, **k)

        def reduce_scatter(out, inp, *a, **k):
            count(nbytes(inp), (w - 1) / w)
            return rs(out, inp, *a, **k)

        def all_gather(out, inp, *a, **k):
            count(nbytes(out), (w - 1) / w)
            return ag(out, inp, *a, **k)

        a2a, gather, bcast = dist.all_to_all_single, dist.gather, dist.broadcast

        def all_to_all(out, inp, *a, **k):  # every worker's Δ to its owner; the compressed route's exact splits
            splits = k.get("input_split_sizes", a[1] if len(a) > 1 else None)
            if splits is None:
                count(nbytes(inp), (w - 1) / w)
            else:  # what leaves this rank: every split but its own, in rows of dim 0
                row = nbytes(inp) // max(1, inp.shape[0]) if inp.dim() else nbytes(inp)
                self.payload += nbytes(inp)
                self.ring += (sum(splits) - splits[dist.get_rank()]) * row
            return a2a(out, inp, *a, **k)

        def solo(real):  # a solo tensor's gather to its owner or broadcast from it
            def call(t, *a, **k):
                count(nbytes(t), (w - 1) / w)
                return real(t, *a, **k)

            return call

        dist.all_reduce, P.reduce_scatter_single, P.all_gather_single = all_reduce, reduce_scatter, all_gather
        C.all_gather_single = all_gather  # the DTensor gather route's
        dist.all_to_all_single, dist.gather, dist.broadcast = all_to_all, solo(gather), solo(bcast)

    def reset(self):
        self.payload = self.ring = 0


def _worker(rank: int, world: int, port: int, conn) -> None:
    import torch.distributed as dist

    from isoloco_kernels import IsoLoCo
    from isoloco_kernels import distributed as D
    from tests.spawn import init_gloo

    init_gloo(rank, world, port, REPLY_TIMEOUT_S)
    counter = _Counter(world)
    state = {}
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "quit":
                break
            if cmd == "noop":
                dist.barrier()
                conn.send(("ok",))
            elif cmd == "setup":
                set_name, mode = args
                shapes = [s for _, s in decoder_param_shapes(SETS[set_name])]
                gen = torch.Generator().manual_seed(0)
                params = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
                gen = torch.Generator().manual_seed(1 + rank)
                grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
                if mode == "replicated":
                    opt = IsoLoCo(params)
                else:
                    opt = D.ShardedIsoLoCo(params, compress=f"{mode}:128:0.95" if mode in COMPRESSED else None)
                state.update(params=params, grads=grads, opt=opt, mode=mode)
                _restore(state)
                _step(state)  # warm-up (allocates buffers and momentum)
                _restore(state)
                counter.reset()
                _step(state)
                n = sum(p.numel() for p in params)
                info = {
                    "payload_bytes": counter.payload,
                    "ring_wire_bytes": counter.ring,
                    "n_params": n,
                    "vs_fp32_allreduce": counter.ring / (2 * (world - 1) / world * 4 * n) if world > 1 else None,
                }
                if mode != "replicated":
                    loads = opt.plan.loads()
                    info.update(
                        flatten_cost_max_over_mean=max(loads) * world / sum(loads),
                        solo_tensors=len(opt.plan.solo),
                        momentum_elements=sum(params[i].numel() for i in opt.mine),
                    )
                else:
                    info["momentum_elements"] = info["n_params"]
                info.update(_step_work(params, opt, mode, info["momentum_elements"]))
                _restore(state)
                conn.send(("ok", info))
            elif cmd == "restore":
                _restore(state)
                dist.barrier()
                conn.send(("ok",))
            elif cmd == "step":
                _step(state)
                conn.send(("ok",))
        except Exception as e:  # report, keep serving (the parent fails the case)
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
    dist.destroy_process_group()


def _step_work(params, opt, mode: str, momentum_elements: int) -> dict:
    """This rank's flatten flops and its step's compulsory bytes besides the collectives (module docstring)."""
    mine = range(len(params)) if mode == "replicated" else opt.mine
    shapes = bucket_shapes(tuple(params[i].shape) for i in mine if params[i].ndim == 2)
    flops = harness.flatten_work(harness.resolved_methods(opt.method, shapes, "cpu"), shapes, "fp32")
    flattened = sum(b * m * n for b, m, n in shapes)
    step = 20.0 * momentum_elements + 8.0 * flattened
    if mode in COMPRESSED:  # quantize Δ + e (read both, write e: 12 B), unpack + add every rank's chunk of the owned
        # tensors and quantize their update (8·W + 12 B), apply the gathered update to every param (read, write: 8 B)
        world = opt.world_size
        step += 12.0 * sum(p.numel() for p in params) + (8.0 * world + 12.0) * momentum_elements
        step += 8.0 * sum(p.numel() for p in params)
    return {"flops": flops, "step_bytes": step}


def _restore(state) -> None:
    for p, g in zip(state["params"], state["grads"]):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)


def _step(state) -> None:
    from isoloco_kernels.distributed import average_

    if state["mode"] == "replicated":
        average_([p.grad for p in state["params"]])
    state["opt"].step()


# ----------------------------------------------------------------------------------------------
# The group, driven from the parent


class _Group:
    def __init__(self, world: int):
        ctx = std_mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world, port, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def call(self, *cmd):
        for c in self.conns:
            c.send(cmd)
        replies = []
        for r, c in enumerate(self.conns):
            if not c.poll(REPLY_TIMEOUT_S):
                raise TimeoutError(f"rank {r} did not answer {cmd[0]!r} within {REPLY_TIMEOUT_S} s")
            replies.append(c.recv())
        errors = [r[1] for r in replies if r[0] == "error"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return replies

    def close(self):
        for c in self.conns:
            try:
                c.send(("quit",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


_GROUPS: dict[int, _Group] = {}


@pytest.fixture(scope="module")
def groups():
    yield _GROUPS
    for g in _GROUPS.values():
        g.close()
    _GROUPS.clear()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("set_name", CPU_SETS)
def test_outer_step(benchmark, groups, set_name, world, mode, ceilings, bench_dry):
    if world == 1 and mode != "replicated":
        pytest.skip("one rank: nothing is sent, and sharded and replicated are the same computation")
    if world not in groups:
        groups[world] = _Group(world)
    g = groups[world]
    infos = [reply[1] for reply in g.call("setup", set_name, mode)]
    ceil = ceilings(torch.device("cpu"))
    bounds = [harness.roofline(i["flops"], i["payload_bytes"] + i["step_bytes"], ceil) for i in infos]
    slowest = max(range(world), key=lambda r: bounds[r]["roofline_s"])
    info = infos[0]
    t0 = time.perf_counter()
    for _ in range(5):
        g.call("noop")
    ipc = (time.perf_counter() - t0) / 5
    benchmark.extra_info.update(
        info,
        world=world,
        mode=mode,
        set=set_name,
        ipc_overhead_s=ipc,
        torch_threads_per_rank=1,
        cpu_count=os.cpu_count(),
    )

    def restore() -> None:  # untimed: pseudo-gradients back (the replicated step averaged them in place)
        g.call("restore")

    benchmark.pedantic(lambda: g.call("step"), setup=restore, rounds=1 if bench_dry else 5, iterations=1)
    median = harness.median(benchmark)
    worst = infos[slowest]
    flops, nbytes = worst["flops"], worst["payload_bytes"] + worst["step_bytes"]
    benchmark.extra_info.update(
        kind="distributed",
        impl=mode,
        device="cpu",
        dtype="fp32",
        flops=flops,
        bytes=nbytes,
        step_bytes=worst["step_bytes"],
        bound_rank=slowest,
        collective_GBps=worst["payload_bytes"] / median / 1e9 if median else None,
        **bounds[slowest],
        **harness.rates(median, flops, nbytes, bounds[slowest]),
    )
