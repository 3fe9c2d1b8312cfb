"""One worker per process: the training loop under torchrun.

    torchrun --nproc_per_node=K -m isoloco_kernels.train --mode diloco,isoloco [--outer sharded] ...

The single-process loop simulates K workers one after another; under torchrun each of the K ranks
is one of those workers. Rank r trains exactly worker r of the simulation (its data shard, its
AdamW state, its seed), every rank holds the same global weights, and the only change is the
`Comm` object: pseudo-gradients are averaged with the bucketed all-reduce-mean of
`isoloco_kernels.distributed.average_` (~25 MB buckets, two in flight). The outer step then runs

    replicated  on every rank (torch.optim.SGD for diloco, IsoLoCo for isoloco/isoloco-sgd), or
    sharded     with `ShardedIsoLoCo`: reduce-scatter of the local Δ, each tensor flattened and
                stepped (Nesterov, momentum kept) by its one owner, all-gather of the new weights.
                For diloco (and avg) it runs with iso off, which is the same SGD step.

Measuring divergence (on unless --no-divergence) costs one Δ-sized all-reduce per round (the sum of
the workers' unit-norm Δ_k); with --outer sharded, measuring or saving pseudo-gradients costs one
more, to form the mean Δ that the sharded step never assembles.

ddp runs too: each rank takes its worker's b sequences of the K×b batch and the gradients are
all-reduced before the AdamW step. Either way the held-out losses equal the simulation's to float
rounding (the sums are taken in another order). The process group comes from the torchrun
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): gloo on the CPU, NCCL on CUDA with
rank r on cuda:LOCAL_RANK. Every rank evaluates the same global model; rank 0 alone prints, shows
progress and writes the JSON and PNG.

A non-finite loss is seen by one rank while the others wait in a collective, so under torchrun a
divergence ends the run: the rank that saw it raises, and torchrun stops the others.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from .config import SGD_MODES, TrainConfig
from .loop import Comm
from .optimizers import outer_optimizer

OUTER_PLACEMENTS = ("replicated", "sharded")
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun(environ=None) -> bool:
    """True when the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) is set."""
    env = os.environ if environ is None else environ
    return all(k in env for k in _TORCHRUN_ENV)


class DistComm(Comm):
    """Comm for one worker per rank: this rank's worker is `rank`; means are all-reduced.

    outer="replicated": average_ the summed Δ, then every rank steps the outer optimizer.
    outer="sharded": Δ stays local; `ShardedIsoLoCo` reduce-scatters, steps and all-gathers.
    """

    def __init__(self, workers: int, rank: int, outer: str = "replicated", group=None):
        from ..distributed.collectives import CHUNK_BYTES

        if outer not in OUTER_PLACEMENTS:
            raise ValueError(f"outer must be one of {OUTER_PLACEMENTS}, got {outer!r}")
        super().__init__(workers)
        self.local_workers = [rank]
        self.rank, self.outer, self.group, self.chunk_bytes = rank, outer, group, CHUNK_BYTES

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        from ..distributed import average_

        average_(tensors, self.group, chunk_bytes=self.chunk_bytes)

    def outer_optimizer(self, mode: str, params, cfg: TrainConfig) -> torch.optim.Optimizer:
        if cfg.merge != "iso_c" and mode not in SGD_MODES and self.outer == "replicated":
            raise ValueError(
                f"merge {cfg.merge!r} needs every worker's own delta: use the sharded outer step "
                "(the replicated one sees only the average)"
            )
        if self.outer == "replicated":
            return outer_optimizer(mode, params, cfg)
        from ..distributed import ShardedIsoLoCo

        lr, momentum = cfg.outer(mode)
        return ShardedIsoLoCo(
            params,
            lr=lr,
            momentum=momentum,
            iso=mode not in SGD_MODES,
            method=cfg.iso_method,
            process_group=self.group,
            chunk_bytes=self.chunk_bytes,
            merge=cfg.merge if mode not in SGD_MODES else "iso_c",
            compress=cfg.compress,  # None: the uncompressed reduce-scatter route
        )

    def pseudo_gradients_(self, delta: Sequence[torch.Tensor]) -> None:
        if self.outer == "replicated":
            self.average_(delta)
        # sharded: ShardedIsoLoCo.step averages the local Δ in its reduce-scatter

    def mean_pseudo_gradients(self, delta: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        if self.outer == "replicated":
            return delta  # already the mean
        mean = [d.clone() for d in delta]  # sharded: Δ is local; one extra all-reduce to measure
        self.average_(mean)
        return mean


class Launch:
    """This process's place in a torchrun launch: rank, world size, device, outer placement."""

    def __init__(self, rank: int, world_size: int, local_rank: int):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.outer = "replicated"
        self.backend: str | None = None

    @classmethod
    def from_env(cls, environ=None) -> "Launch":
        env = os.environ if environ is None else environ
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check(self, cfgs: Sequence[TrainConfig], sweep: str | None, device: str, outer: str) -> None:
        """Raise ValueError naming the setting a torchrun launch cannot run; before any training."""
        if outer not in OUTER_PLACEMENTS:
            raise ValueError(f"--outer must be one of {OUTER_PLACEMENTS}, got {outer!r}")
        if sweep == "workers":
            raise ValueError(
                f"--sweep workers cannot run under torchrun: the world size ({self.world_size}) is the "
                "number of workers; launch once per K instead"
            )
        for c in cfgs:
            if c.workers != self.world_size:
                raise ValueError(
                    f"--workers {c.workers} does not match the torchrun world size {self.world_size} "
                    "(one worker per rank); omit --workers or pass the world size"
                )
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device {device!r} under torchrun: pass cpu or cuda (rank r uses cuda:LOCAL_RANK)")
        for c in cfgs:  # what outer_optimizer would refuse at the first outer step, after earlier modes trained
            if outer == "replicated" and c.merge != "iso_c":
                raise ValueError(
                    f"--merge {c.merge} needs every worker's own delta: add --outer sharded (the replicated outer "
                    "step sees only the average)"
                )
        self.outer = outer

    def start(self, device: str) -> None:
        """Join the process group from the torchrun environment: NCCL on CUDA, gloo on the CPU."""
        import torch.distributed as dist

        if device == "cuda":
            if self.local_rank >= torch.cuda.device_count():
                raise RuntimeError(
                    f"rank {self.rank}: LOCAL_RANK {self.local_rank} but only {torch.cuda.device_count()} "
                    "CUDA devices are visible; use --nproc_per_node ≤ the GPU count"
                )
            torch.cuda.set_device(self.local_rank)  # "cuda" below means cuda:LOCAL_RANK
            self.backend = "nccl"
        else:
            self.backend = "gloo"
        dist.init_process_group(self.backend)

    def comm(self, cfg: TrainConfig) -> DistComm:
        return DistComm(cfg.workers, self.rank, self.outer)

    def progress(self, make):
        """Rank 0 shows the run's progress (its own steps × world size); the other ranks none."""

        def make_scaled(label: str, total: int):
            if not self.is_main:
                return None, (lambda: None)
            cb, close = make(label, total)
            if cb is None:
                return None, close
            return (lambda done, loss: cb(done * self.world_size, loss)), close

        return make_scaled

    def check_run(self, run: dict) -> None:
        """A divergence under torchrun ends the run (another rank may be waiting in a collective)."""
        if "diverged" in run:
            raise RuntimeError(
                f"rank {self.rank}: {run['mode']} diverged ({run['diverged']}); under torchrun this ends "
                "the run, torchrun stops the other ranks"
            )

    def describe(self) -> dict:
        return {"launcher": "torchrun", "world_size": self.world_size, "backend": self.backend, "outer": self.outer}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def torchrun_launch(parser=None) -> Launch | None:
    """The Launch of this process when started by torchrun, else None.

    With a parser, --workers defaults to the world size (one worker per rank).
    """
    if not launched_by_torchrun():
        return None
    launch = Launch.from_env()
    if parser is not None:
        parser.set_defaults(workers=launch.world_size)
    return launch


def check_outer(launch: Launch | None, cfgs, sweep: str | None, device: str, outer: str) -> None:
    """Validate the launch-related flags: --outer sharded needs torchrun; see Launch.check."""
    if launch is not None:
        launch.check(cfgs, sweep, device, outer)
    elif outer != "replicated":
        raise ValueError(
            f"--outer {outer} needs one process per worker: launch with torchrun "
            "(torchrun --nproc_per_node=K -m isoloco_kernels.train ...)"
        )
