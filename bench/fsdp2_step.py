"""The IsoLoCo outer step on FSDP2 (DTensor) params, one process, world size 1.

    python bench/fsdp2_step.py                        # CUDA + NCCL, llama-178m's parameters
    python bench/fsdp2_step.py --device cpu --set ref-tiny   # gloo on the CPU (a dry run)

The params of a bucket set (bench/shapes.py: every weight and norm of the decoder) are sharded with
`fully_shard` over a one-rank mesh; their grads are DTensor pseudo-gradients (as torchft writes
them). One timed round is `IsoLoCo.step()`; the grads are restored untimed between rounds. The
result is checked against IsoLoCo on plain tensors with the same grads (relative Frobenius error
over every param after one step). On CUDA the host syncs of one step are counted with
torch.cuda.set_sync_debug_mode (one warning per synchronizing call). Prints one line; --json
writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import host_syncs, sync  # noqa: E402
from bench.shapes import SETS, decoder_param_shapes  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Params(torch.nn.Module):
    def __init__(self, shapes, device):
        super().__init__()
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for _, s in shapes
        )


def _grads(shapes, device):
    gen = torch.Generator(device="cpu").manual_seed(1)
    return [(torch.randn(s, generator=gen) * 1e-3).to(device) for _, s in shapes]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="llama-178m", choices=sorted(SETS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--method", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from isoloco_kernels import IsoLoCo

    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device.type, (1,))
        shapes = decoder_param_shapes(SETS[args.set])
        model, ref = _Params(shapes, device), _Params(shapes, device)
        fully_shard(model, mesh=mesh)
        grads = _grads(shapes, device)

        def set_grads():
            for p, r, g in zip(model.parameters(), ref.parameters(), grads):
                p.grad = DTensor.from_local(g.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                r.grad = g.clone()

        opt = IsoLoCo(model.parameters(), lr=1.8, momentum=0.8, method=args.method)
        ref_opt = IsoLoCo(ref.parameters(), lr=1.8, momentum=0.8, method=args.method)
        set_grads()
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            pairs = [(p.full_tensor().double(), r.double()) for p, r in zip(model.parameters(), ref.parameters())]
            num = sum(float((a - b).norm()) ** 2 for a, b in pairs)
            den = sum(float(b.norm()) ** 2 for _, b in pairs)
        err = (num / den) ** 0.5

        times = []
        for _ in range(args.rounds):
            set_grads()
            sync(device)
            t = time.perf_counter()
            opt.step()
            sync(device)
            times.append(time.perf_counter() - t)
        set_grads()
        syncs = host_syncs(opt.step, device)
        out = {
            "kind": "fsdp2_step",
            "set": args.set,
            "device": device.type,
            "backend": backend,
            "world": 1,
            "method": args.method,
            "n_params": sum(p.numel() for p in ref.parameters()),
            "n_tensors": len(shapes),
            "median_s": statistics.median(times),
            "min_s": min(times),
            "err_vs_plain_isoloco": err,
            "host_syncs_per_step": syncs,
        }
    finally:
        dist.destroy_process_group()
    print(
        f"fsdp2 step ({backend}, world 1, {args.set}, {out['n_params'] / 1e6:.0f}M params, method "
        f"{args.method}): median {out['median_s'] * 1e3:.1f} ms, error vs plain IsoLoCo {err:.1e}, "
        f"host syncs per step {syncs if syncs is not None else 'n/a (CPU)'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
