"""isoloco_kernels: fast Iso-C merging and the IsoLoCo outer optimizer for DiLoCo-style training."""

from .distributed import ShardedIsoLoCo, average_, sharded_iso_merge_
from .ops import backends, iso_flatten, iso_merge_
from .optim import IsoLoCo

__version__ = "0.1.0"

__all__ = [
    "IsoLoCo",
    "ShardedIsoLoCo",
    "average_",
    "backends",
    "iso_flatten",
    "iso_merge_",
    "sharded_iso_merge_",
    "__version__",
]
