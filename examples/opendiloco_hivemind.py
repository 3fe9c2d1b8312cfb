"""OpenDiLoCo's outer step with IsoLoCo: two hivemind peers on localhost average their
pseudo-gradients and step an outer optimizer built from a factory.

In OpenDiLoCo the outer optimizer is a factory handed to its `DiLoCoOptimizer`; the one line that
changes is that factory:

    outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    outer_optimizer=partial(IsoLoCo, lr=1.8, momentum=0.8, nesterov=True)  # IsoLoCo's released config

OpenDiLoCo's trainer is not on the package index, so this script runs the same arrangement on
hivemind itself: each peer keeps an offloaded copy of the weights that the outer optimizer owns,
writes the pseudo-gradient (offloaded − local) into that copy's `.grad`, averages the grads with
the other peer through a `hivemind.averaging.DecentralizedAverager` (the class OpenDiLoCo's grad
averager extends), steps the outer optimizer and copies the result into the model. Three models
train side by side on the same data and are averaged in one all-reduce per round: SGD,
IsoLoCo(iso=False) at SGD's settings (must land on SGD's weights) and IsoLoCo.

    python examples/opendiloco_hivemind.py [--rounds 4] [--inner 10]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchft_diloco_fsdp import OUTER, make_model, report_sgd_match, run_processes, teacher_batch  # noqa: E402


def peer(index: int, initial_peers: list[str], args, out) -> None:
    """One DiLoCo worker: inner AdamW steps, then the averaged outer step, `args.rounds` times."""
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    torch.set_num_threads(1)
    mp.set_start_method("fork", force=True)  # hivemind starts its DHT and averager processes by fork
    try:
        dht = hivemind.DHT(initial_peers=initial_peers, start=True)
        models = {name: make_model() for name in OUTER}
        inner = {name: torch.optim.AdamW(m.parameters(), lr=3e-3) for name, m in models.items()}
        offloaded = {
            name: [p.detach().clone().requires_grad_(True) for p in m.parameters()] for name, m in models.items()
        }
        outer = {name: OUTER[name](ps) for name, ps in offloaded.items()}  # the factory's one call
        for ps in offloaded.values():
            for p in ps:
                p.grad = torch.zeros_like(p)
        averager = DecentralizedAverager(
            [p.grad for name in OUTER for p in offloaded[name]],
            dht,
            start=True,
            prefix="isoloco_example",
            target_group_size=2,
            min_matchmaking_time=3.0,
            request_timeout=2.0,
        )
        gen = torch.Generator().manual_seed(100 + index)  # each peer its own data
        train = {name: [] for name in OUTER}
        for _ in range(args.rounds):
            for _ in range(args.inner):
                x, y = teacher_batch(gen)
                for name, m in models.items():
                    loss = nn.functional.cross_entropy(m(x), y)
                    inner[name].zero_grad()
                    loss.backward()
                    inner[name].step()
                    train[name].append(loss.item())
            with torch.no_grad(), averager.get_tensors() as grads:
                local = [p for name in OUTER for p in models[name].parameters()]
                for g, o, p in zip(grads, (o for name in OUTER for o in offloaded[name]), local):
                    g.copy_(o - p)  # global − local, the sign OpenDiLoCo and torchft use
            gathered = averager.step(timeout=120)
            if gathered is None or len(gathered) != 2:
                raise RuntimeError(f"peer {index}: the averaging round did not include both peers ({gathered})")
            with torch.no_grad(), averager.get_tensors() as grads:
                for g, o in zip(grads, (o for name in OUTER for o in offloaded[name])):
                    o.grad.copy_(g)
            for name in OUTER:
                outer[name].step()
                with torch.no_grad():
                    for p, o in zip(models[name].parameters(), offloaded[name]):
                        p.copy_(o)
        x, y = teacher_batch(torch.Generator().manual_seed(7), 512)
        with torch.no_grad():
            held_out = {name: nn.functional.cross_entropy(m(x), y).item() for name, m in models.items()}
        weights = {name: [p.detach().tolist() for p in m.parameters()] for name, m in models.items()}
        out.put((index, {"held_out": held_out, "train": train, "weights": weights}))
        averager.shutdown()
        dht.shutdown()
    except BaseException as e:  # the parent reports it instead of waiting for a result forever
        out.put((index, f"{type(e).__name__}: {e}"))
        raise


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="outer steps")
    p.add_argument("--inner", type=int, default=10, help="inner steps per outer step")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for the peers")
    args = p.parse_args(argv)
    import hivemind

    bootstrap = hivemind.DHT(start=True)  # the peers find each other through it, as OpenDiLoCo's do
    maddrs = [str(a) for a in bootstrap.get_visible_maddrs()]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=peer, args=(i, maddrs, args, out)) for i in range(2)]
    try:
        results = run_processes(procs, out, args.timeout, lambda i: f"peer {i}")
    finally:
        bootstrap.shutdown()
    return check(results)


def check(results: dict) -> dict:
    """Both peers hold the same weights; iso=False lands on SGD's; the losses are finite."""
    first = results[0]
    for res in results.values():
        for name in OUTER:
            assert all(math.isfinite(v) for v in res["train"][name]) and math.isfinite(res["held_out"][name])
            # hivemind adds (average − own) to each peer's tensor: the peers agree to a rounding
            for a, b in zip(res["weights"][name], first["weights"][name]):
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
    sgd, off = ([torch.tensor(w) for w in first["weights"][name]] for name in ("SGD", "IsoLoCo(iso=False)"))
    report_sgd_match(off, sgd)
    losses = first["held_out"]
    for name, v in losses.items():
        print(f"{name:>20}: held-out loss {v:.4f} (initial train loss {first['train'][name][0]:.4f})")
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
