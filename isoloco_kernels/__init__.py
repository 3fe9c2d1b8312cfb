"""isoloco_kernels: fast Iso-C merging and the IsoLoCo outer optimizer for DiLoCo-style training."""
from .ops import backends, iso_flatten, iso_merge_
from .optim import IsoLoCo

__version__ = "0.1.0"

__all__ = ["IsoLoCo", "backends", "iso_flatten", "iso_merge_", "__version__"]
