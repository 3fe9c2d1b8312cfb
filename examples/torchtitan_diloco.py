"""torchtitan's DiLoCo setup with IsoLoCo as the outer optimizer, on CPU with gloo: torchtitan's own
`TorchFTManager` and `maybe_semi_sync_training` (torchtitan/experiments/torchft/manager.py) over an
FSDP2 model, a torchft lighthouse and two replica groups on localhost.

torchtitan builds the outer optimizer in one place, `maybe_semi_sync_training`:

    outer_optimizer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)

The change is that line (with `from isoloco_kernels import IsoLoCo` at the top of the file):

    outer_optimizer = IsoLoCo(params, lr=1.8, momentum=0.8, nesterov=True)

or, to choose it per run, an outer-optimizer factory: give `maybe_semi_sync_training` an argument
`outer_optimizer_fn=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)` and build
`outer_optimizer = outer_optimizer_fn(params)`; the trainer passes `partial(IsoLoCo, lr=1.8,
momentum=0.8, nesterov=True)`.

This script leaves the installed torchtitan as it is and makes the same change while
`maybe_semi_sync_training` runs (`outer_optimizer_as`). torchtitan's full trainer is not run (it
needs a CUDA device and a tokenizer download); its DiLoCo construction and its torchft manager are
the real ones, the model and the loop are the tiny ones of torchft_diloco_fsdp.py. Three runs, same
init and data: torchtitan's SGD as it ships; IsoLoCo(iso=False) taking torchtitan's SGD arguments
unchanged (must land on SGD's weights); IsoLoCo at its released config.

    python examples/torchtitan_diloco.py [--rounds 4] [--inner 10] [--shards 1]
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager, nullcontext
from functools import partial
from unittest import mock

import torch

from isoloco_kernels import IsoLoCo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchft_diloco_fsdp as harness  # noqa: E402  (the model, the loop and the checks)

# What replaces torchtitan's `torch.optim.SGD` in each run (None: torchtitan as it ships).
REPLACE = {
    "SGD": None,
    # called with torchtitan's own arguments: lr=0.7, momentum=0.9, nesterov=True
    "IsoLoCo(iso=False)": partial(IsoLoCo, iso=False),
    "IsoLoCo": lambda params, **_sgd_args: IsoLoCo(params, lr=1.8, momentum=0.8, nesterov=True),
}
assert set(REPLACE) == set(harness.OUTER)


@contextmanager
def outer_optimizer_as(factory):
    """While active, the `torch.optim.SGD(params, ...)` that torchtitan's DiLoCo setup calls makes
    `factory(params, ...)` instead (same arguments); None changes nothing."""
    with nullcontext() if factory is None else mock.patch.object(torch.optim, "SGD", factory):
        yield


def build_torchtitan(name, model, inner, state_fns, replica, rank, shards, lighthouse, args):
    """torchtitan's TorchFTManager and DiLoCo for this replica group, configured as its
    `--fault_tolerance.*` options would be."""
    from torchtitan.experiments.torchft.config import FaultTolerance
    from torchtitan.experiments.torchft.manager import TorchFTManager, maybe_semi_sync_training

    os.environ.update(TORCHFT_LIGHTHOUSE=lighthouse, RANK=str(rank), WORLD_SIZE=str(shards))
    ft_config = FaultTolerance(
        enable=True,
        replica_id=replica,
        group_size=2,
        min_replica_size=2,
        semi_sync_method="diloco",
        sync_steps=args.inner,
        process_group_timeout_ms=60_000,
    )
    ft = TorchFTManager(ft_config)
    ft.manager.set_state_dict_fns(*state_fns)  # what torchtitan's checkpointer registers
    with outer_optimizer_as(REPLACE[name]):
        diloco = maybe_semi_sync_training(ft_config, ft, model, n_layers=len(model), optimizer=inner)
    outer = diloco._fragments[0]._outer_optimizer
    assert type(outer).__name__ == name.split("(")[0], (name, type(outer))
    return diloco, ft.manager


if __name__ == "__main__":
    harness.main(sys.argv[1:], build=build_torchtitan, doc=__doc__)
