"""isoloco_kernels: fast Iso-C merging and the IsoLoCo outer optimizer for DiLoCo-style training."""

from ._validate import ResultOverflowError
from .api import backends, iso_flatten, iso_merge_
from .compress import Compression
from .distributed import DistributedStepError, ShardedIsoLoCo, average_, sharded_iso_merge_
from .flatten.gram import GramFallbackWarning
from .flatten.iteration_stats import FlattenFallbackWarning
from .merges import merge, merge_
from .optim import IsoLoCo, MergeLoCo

__version__ = "0.1.0"

__all__ = [
    "Compression",
    "DistributedStepError",
    "FlattenFallbackWarning",
    "GramFallbackWarning",
    "IsoLoCo",
    "MergeLoCo",
    "ResultOverflowError",
    "ShardedIsoLoCo",
    "average_",
    "backends",
    "iso_flatten",
    "iso_merge_",
    "merge",
    "merge_",
    "sharded_iso_merge_",
    "__version__",
]
