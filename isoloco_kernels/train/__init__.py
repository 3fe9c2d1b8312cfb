"""The reference training loop: DDP vs DiLoCo vs IsoLoCo on a small byte-level language model.

Run `python -m isoloco_kernels.train --help`. The pieces are importable for other loops:
`ByteLM` (model.py), `load_corpus` (data.py), `TrainConfig`, `Setup`, `run_mode`, `Comm` (loop.py).
"""
from .data import Corpus, load_corpus
from .loop import MODES, OUTER_DEFAULTS, Comm, Setup, TrainConfig, run_mode
from .model import PRESETS, ByteLM, ModelConfig

__all__ = [
    "MODES", "OUTER_DEFAULTS", "PRESETS", "ByteLM", "Comm", "Corpus", "ModelConfig", "Setup",
    "TrainConfig", "load_corpus", "run_mode",
]
