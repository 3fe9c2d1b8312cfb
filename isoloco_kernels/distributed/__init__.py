"""IsoLoCo over torch.distributed.

- `agree.py`: agree before writing, the one failure protocol of every collective entry point
  (`Agreement`: attempt / settle);
- `plan.py`: who owns which tensor (`plan_shards`, `ShardPlan`); how a DTensor matrix is split
  over a 1-D mesh (`ShardLayout`);
- `pipeline.py`: chunked, pipelined collectives (`sharded_iso_merge_`'s all-gather and broadcast, `average_`'s
  chunks) and every collective buffer (`comm_buffer`);
- `collectives.py`: `average_` (DiLoCo's all-reduce-mean) and the DTensor routes' all-gather and
  owner all-to-alls of shards;
- `sharded.py`: `ShardedIsoLoCo`, the outer step with each tensor stepped by one rank: its one step with
  one vote, its exchanges (full precision, every worker's Δ for the merges, compressed) and its checkpoints;
- `merge.py`: `sharded_iso_merge_`, Iso-C of already-averaged buckets with the work split;
- `process_group.py`: `IsoLoCo.step` over a process group (`IsoLoCo(process_group=...)`);
- `dtensor.py`: `IsoLoCo.step` on DTensor params (FSDP2, tensor parallel): checks and the router;
  `routes.py` and `gram_route.py`: its routes;
- `checkpoint.py`: what IsoLoCo and MergeLoCo refuse of a per-rank state; `bits.py`: the fingerprints and
  checksums replicas compare.

It stands on outer/ (the outer-step core), merges/, flatten/ and compress/; optim/ uses its public pieces,
never the other way round.
"""

from .agree import DistributedStepError
from .collectives import average_
from .merge import sharded_iso_merge_
from .plan import ShardPlan, plan_shards
from .sharded import ShardedIsoLoCo

__all__ = ["DistributedStepError", "ShardPlan", "ShardedIsoLoCo", "average_", "plan_shards", "sharded_iso_merge_"]
