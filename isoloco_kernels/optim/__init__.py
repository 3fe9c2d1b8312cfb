"""The outer optimizers of one process (or one averaged group): IsoLoCo (isoloco.py) and MergeLoCo with the paper's
merges (mergeloco.py; compressed.py: its compressed exchange, simulated as the ranks run it). They stand on outer/ and
use distributed/'s public pieces; distributed/ never imports them."""

from .isoloco import IsoLoCo
from .mergeloco import MergeLoCo

__all__ = ["IsoLoCo", "MergeLoCo"]
