"""IsoLoCo over torch.distributed.

- `agree.py`: agree before writing, the one failure protocol of every collective entry point;
- `plan.py`: who owns which tensor (`plan_shards`, `ShardPlan`);
- `collectives.py`: chunked, pipelined collectives and `average_` (DiLoCo's all-reduce-mean);
- `sharded.py`: `ShardedIsoLoCo`, the outer step with each tensor stepped by one rank;
- `merge.py`: `sharded_iso_merge_`, Iso-C of already-averaged buckets with the work split;
- `dtensor.py`: `IsoLoCo.step` on DTensor params (FSDP2, tensor parallel).
"""
from .agree import DistributedStepError
from .collectives import average_
from .merge import sharded_iso_merge_
from .plan import ShardPlan, plan_shards
from .sharded import ShardedIsoLoCo

__all__ = ["DistributedStepError", "ShardPlan", "ShardedIsoLoCo", "average_", "plan_shards", "sharded_iso_merge_"]
