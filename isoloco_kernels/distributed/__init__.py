"""IsoLoCo over torch.distributed.

- `agree.py`: agree before writing, the one failure protocol of every collective entry point
  (`Agreement`: attempt / settle);
- `plan.py`: who owns which tensor (`plan_shards`, `ShardPlan`); how a DTensor matrix is split
  over a 1-D mesh (`ShardLayout`);
- `pipeline.py`: chunked, pipelined collectives (the sharded step's reduce-scatter, all-gather,
  reduce to and broadcast from an owner) and their buffers (`comm_buffer`);
- `collectives.py`: `average_` (DiLoCo's all-reduce-mean) and the DTensor routes' all-gather and
  owner all-to-alls of shards;
- `sharded.py`: `ShardedIsoLoCo`, the outer step with each tensor stepped by one rank;
- `merge.py`: `sharded_iso_merge_`, Iso-C of already-averaged buckets with the work split;
- `process_group.py`: `IsoLoCo.step` over a process group (`IsoLoCo(process_group=...)`);
- `dtensor.py`: `IsoLoCo.step` on DTensor params (FSDP2, tensor parallel): checks and the router;
  `routes.py` and `gram_route.py`: its routes;
- `merge_route.py`: the merges' owner all-to-all (`ShardedIsoLoCo(merge=...)`); `compressed.py`: the
  compressed owner route (`ShardedIsoLoCo(compress=...)`) and its one-process simulation;
- `checkpoint.py`: per-rank and consolidated state dicts; `bits.py`: exact fingerprints replicas compare.

It stands on outer/ (the outer-step core), merges/, flatten/ and compress/; optim/ uses its public pieces,
never the other way round.
"""

from .agree import DistributedStepError
from .collectives import average_
from .merge import sharded_iso_merge_
from .plan import ShardPlan, plan_shards
from .sharded import ShardedIsoLoCo

__all__ = ["DistributedStepError", "ShardPlan", "ShardedIsoLoCo", "average_", "plan_shards", "sharded_iso_merge_"]
