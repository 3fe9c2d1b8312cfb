"""The training loop's launch under torchrun (train/dist.py): checked up front, before any training."""

from __future__ import annotations

import pytest


def test_a_torchrun_launch_refuses_a_merge_on_the_replicated_outer_step_before_training():
    """Under torchrun the replicated outer step sees only the average: --merge tsv is refused by the launch's
    up-front check (it used to train the modes before it, then fail at IsoLoCo's first outer step)."""
    from isoloco_kernels.train.config import TrainConfig
    from isoloco_kernels.train.dist import Launch

    launch = Launch(rank=0, world_size=2, local_rank=0)
    with pytest.raises(ValueError, match="--merge tsv needs every worker's own delta: add --outer sharded"):
        launch.check([TrainConfig(workers=2, merge="tsv")], None, "cpu", "replicated")
    launch.check([TrainConfig(workers=2, merge="tsv")], None, "cpu", "sharded")  # the sharded step merges
    launch.check([TrainConfig(workers=2)], None, "cpu", "replicated")
