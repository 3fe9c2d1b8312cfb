"""torchft's DiLoCo over an FSDP2 model with IsoLoCo as the outer optimizer: a lighthouse and two
replica groups on localhost (gloo on CPU).

The one line a torchft user changes is the outer optimizer:

    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    outer = IsoLoCo(model.parameters(), lr=1.8, momentum=0.8, nesterov=True)  # IsoLoCo's released config

Each replica group shards its model with `fully_shard` (the params are DTensors) and wraps its
loop in `torchft.local_sgd.DiLoCo`; the lighthouse forms the quorum of the two groups and the
pseudo-gradients are averaged across them. The same DiLoCo run (same init, same data) is made three
times: with SGD, with IsoLoCo(iso=False) at SGD's settings (which must land on SGD's weights) and
with IsoLoCo. Prints the held-out loss of each and asserts the equality and finite losses.

A fourth IsoLoCo run has a ragged round: replica group 1 sits out outer round 1 (`SitOut`). It stays in the
quorum but, as a spare of torchft's FIXED_WITH_SPARES mode for that one round, contributes zeros (weight 0),
and torchft's average divides by the groups left (`Manager.num_participants()`): the outer step of both
groups takes group 0's pseudo-gradient alone, and the replicas stay replicas. Its manager's
`min_replica_size=1` is torchft's quorum (`ShardedIsoLoCo(min_workers=)`'s counterpart): a round with one
group still commits. Prints the participants that reached the merge in each round, [2, 1, 2, …], and
asserts them.

    python examples/torchft_diloco_fsdp.py [--rounds 4] [--inner 10] [--shards 1]

--shards 2 shards each replica group over two ranks (4 processes in all).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from isoloco_kernels import IsoLoCo

OUTER = {
    "SGD": partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
    "IsoLoCo(iso=False)": partial(IsoLoCo, lr=0.7, momentum=0.9, nesterov=True, iso=False),
    "IsoLoCo": partial(IsoLoCo, lr=1.8, momentum=0.8, nesterov=True),
}
DIM, HIDDEN, CLASSES, BATCH = 16, 32, 8, 32
#: The ragged run (torchft only, with --rounds 2 or more): IsoLoCo with replica group 1 sitting out outer round 1.
RAGGED = "IsoLoCo, one group sits out a round"
SIT_OUT = (1, 1)  # (replica group, outer round)


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every replica group starts from the same weights
    return nn.Sequential(
        nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)
    )


def teacher_batch(gen: torch.Generator, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random teacher network labels Gaussian inputs: a task a tiny model can learn."""
    w = torch.Generator().manual_seed(1234)
    t1, t2 = torch.randn(DIM, HIDDEN, generator=w), torch.randn(HIDDEN, CLASSES, generator=w)
    x = torch.randn(n, DIM, generator=gen)
    return x, (torch.tanh(x @ t1) @ t2).argmax(-1)


def sit_out_manager():
    """torchft's Manager with one replica group sitting out one outer round (the class is made here: torchft is
    imported only where it runs)."""
    from torchft.manager import Manager

    class SitOut(Manager):
        """Replica group `SIT_OUT[0]` sits out outer round `SIT_OUT[1]`: for that round it is a spare (torchft's
        FIXED_WITH_SPARES rule: it sends zeros) and every group's average divides by the groups left. Records,
        per outer round, the count that reached the merge (`participants`) and a digest of each tensor this
        group handed to the average and of what came back (`exchanged`)."""

        def __init__(self, *args, group: int, **kwargs):
            super().__init__(*args, **kwargs)
            self.group, self.participants, self.exchanged, self._sent = group, [], [], []

        def allreduce(self, tensor, *args, **kwargs):
            self._sent.append((digest(tensor), tensor))  # this group's own pseudo-gradient, before the average
            return super().allreduce(tensor, *args, **kwargs)

        def _round_out(self) -> bool:  # the same answer on every group: the committed step count
            return self.current_step() == SIT_OUT[1]

        def num_participants(self) -> int:
            n = super().num_participants()
            return n - 1 if self._round_out() else n

        def is_participating(self) -> bool:
            return super().is_participating() and not (self._round_out() and self.group == SIT_OUT[0])

        def should_commit(self, timeout=None) -> bool:  # DiLoCo waited for the averages: what the merge gets
            self.participants.append(self.num_participants())  # the divisor the round's average used
            self.exchanged.append([(sent, digest(t)) for sent, t in self._sent])
            self._sent = []
            return super().should_commit(timeout)

    return SitOut


def digest(t: torch.Tensor) -> str:
    """A tensor's exact bits, as a short hash."""
    import hashlib

    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def build_torchft(
    name: str, model: nn.Module, inner, state_fns, replica: int, rank: int, shards: int, lighthouse: str, args
):
    """torchft's Manager and DiLoCo as a torchft user writes them, with the outer optimizer `name` (the ragged
    run: IsoLoCo, with a manager whose group `SIT_OUT[0]` sits out one round)."""
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    ragged = name == RAGGED
    outer = OUTER["IsoLoCo" if ragged else name](model.parameters())  # <- the line that changes
    t = timedelta(seconds=60)
    kind, extra = (sit_out_manager(), {"group": replica}) if ragged else (Manager, {})
    manager = kind(
        pg=ProcessGroupGloo(timeout=t),
        min_replica_size=1 if ragged else 2,
        use_async_quorum=False,
        load_state_dict=state_fns[0],
        state_dict=state_fns[1],
        replica_id=f"{name}:group{replica}",
        lighthouse_addr=lighthouse,
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        rank=rank,
        world_size=shards,
        timeout=t,
        quorum_timeout=t,
        connect_timeout=t,
        init_sync=False,  # both groups start from the same seed: no transfer of the initial weights
        **extra,
    )
    diloco = DiLoCo(
        manager, [model], inner, outer, sync_every=args.inner, backup_device=torch.device("cpu"), pin_memory=False
    )
    return diloco, manager


def run_one(build, name: str, lighthouse: str, replica: int, rank: int, shards: int, args) -> dict:
    """One DiLoCo run of this replica group's rank with the outer optimizer `name`; `build` makes
    the manager and the DiLoCo wrapper."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (shards,))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    diloco, manager = build(name, model, inner, (load_state_dict, state_dict), replica, rank, shards, lighthouse, args)
    gen = torch.Generator().manual_seed(100 + replica)  # each replica group its own data
    train_losses = []
    try:
        with diloco:
            for _ in range(args.rounds * args.inner):
                x, y = teacher_batch(gen)
                loss = nn.functional.cross_entropy(model(x), y)
                inner.zero_grad()
                loss.backward()
                inner.step()  # every `inner` steps DiLoCo averages and takes the outer step
                train_losses.append(loss.item())
        with torch.no_grad():
            x, y = teacher_batch(torch.Generator().manual_seed(7), 512)
            held_out = nn.functional.cross_entropy(model(x), y).item()
        # plain lists: tensors sent through a queue would share memory with a process that exits
        weights = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    finally:
        manager.shutdown(wait=False)
    out = {"held_out": held_out, "train": train_losses, "weights": weights, "steps": manager.current_step()}
    out["participants"] = getattr(manager, "participants", None)
    out["exchanged"] = getattr(manager, "exchanged", None)
    return out


def runs(build, args) -> list[str]:
    """The runs of this invocation: the three outer optimizers, and with torchft's own build and two rounds or
    more the ragged one."""
    return list(OUTER) + ([RAGGED] if build is build_torchft and args.rounds > SIT_OUT[1] else [])


def worker(build, replica: int, rank: int, shards: int, port: int, lighthouse: str, args, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=shards)
        result = {name: run_one(build, name, lighthouse, replica, rank, shards, args) for name in runs(build, args)}
        out.put((replica, rank, result))
    except BaseException as e:  # the parent reports it instead of waiting for a result forever
        out.put((replica, rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main(argv=None, build=build_torchft, doc: str = __doc__) -> dict:
    """Run the three DiLoCo runs (`build` makes each one's manager and DiLoCo) and check them."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="outer steps")
    p.add_argument("--inner", type=int, default=10, help="inner steps per outer step (sync_every)")
    p.add_argument("--shards", type=int, default=1, help="FSDP2 ranks per replica group")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for the replica groups")
    args = p.parse_args(argv)
    from torchft.coordination import LighthouseServer

    # One lighthouse for the three runs: each run's quorum gets a new id, so its collectives
    # rendezvous under keys of their own. A finished run's replicas drop out after 1 s of silence.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, heartbeat_timeout_ms=1000)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = []
    for replica in range(2):
        port = free_port()
        for rank in range(args.shards):
            procs.append(
                ctx.Process(
                    target=worker, args=(build, replica, rank, args.shards, port, lighthouse.address(), args, out)
                )
            )
    try:
        results = run_processes(procs, out, args.timeout, lambda k: f"replica group {k[0]} rank {k[1]}")
    finally:
        lighthouse.shutdown()
    return check(results, args)


def run_processes(procs, out, timeout: float, who) -> dict:
    """Start `procs` and take one (*key, result) from `out` per process; a str result is that process's
    failure, raised naming who(key). Every process is joined (or killed) before this returns."""
    for pr in procs:
        pr.start()
    results = {}
    try:
        for _ in procs:
            *key, res = out.get(timeout=timeout)
            key = key[0] if len(key) == 1 else tuple(key)
            if isinstance(res, str):
                raise RuntimeError(f"{who(key)} failed: {res}")
            results[key] = res
    finally:
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()
    return results


def report_sgd_match(off: list, sgd: list) -> None:
    """IsoLoCo(iso=False)'s weights against SGD's: equal, or a rounding apart per outer step where
    SGD's loop and IsoLoCo's fused update round differently, carried through the inner steps."""
    for a, b in zip(off, sgd):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(off, sgd))
    print(f"IsoLoCo(iso=False) vs SGD: largest relative weight difference {rel:.1e}")


def check(results: dict, args) -> dict:
    """The DiLoCo invariants and the drop-in claim; returns the held-out loss per outer optimizer."""
    first = results[(0, 0)]
    for key, res in results.items():
        for name in first:
            assert res[name]["steps"] == args.rounds, (key, name, res[name]["steps"])
            assert all(math.isfinite(v) for v in res[name]["train"]) and math.isfinite(res[name]["held_out"])
            # after an outer step every replica group holds the same global weights
            assert res[name]["weights"] == first[name]["weights"], (key, name)
    sgd, off = ([torch.tensor(w) for w in first[name]["weights"].values()] for name in ("SGD", "IsoLoCo(iso=False)"))
    report_sgd_match(off, sgd)
    losses = {name: first[name]["held_out"] for name in OUTER}
    for name, v in losses.items():
        print(f"{name:>20}: held-out loss {v:.4f} (initial train loss {first[name]['train'][0]:.4f})")
    if RAGGED in first:  # every group saw the same count reach the merge: 2, but 1 in the round group 1 sat out
        want = [1 if r == SIT_OUT[1] else 2 for r in range(args.rounds)]
        for key, res in results.items():
            assert res[RAGGED]["participants"] == want, (key, res[RAGGED]["participants"], want)
            # in that round every group's average is group 0's own pseudo-gradient, bit for bit: group 1 weighed 0
            kept = results[(0, key[1])][RAGGED]["exchanged"][SIT_OUT[1]]
            got = res[RAGGED]["exchanged"][SIT_OUT[1]]
            assert [back for _, back in got] == [sent for sent, _ in kept], key
        assert first[RAGGED]["weights"] != first["IsoLoCo"]["weights"]  # the round without group 1 moved elsewhere
        print(
            f"{RAGGED} (group {SIT_OUT[0]} sends zeros in round {SIT_OUT[1]}): participants per round "
            f"{first[RAGGED]['participants']}, held-out loss {first[RAGGED]['held_out']:.4f}"
        )
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
