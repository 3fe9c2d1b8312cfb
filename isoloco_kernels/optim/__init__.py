"""The outer optimizers of one process (or one averaged group): IsoLoCo (isoloco.py) and MergeLoCo with the paper's
merges (mergeloco.py). They stand on outer/ and use distributed/'s public pieces; distributed/ never imports them."""

from .isoloco import IsoLoCo
from .mergeloco import MergeLoCo

__all__ = ["IsoLoCo", "MergeLoCo"]
