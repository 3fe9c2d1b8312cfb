"""The reference training loop: DDP vs DiLoCo vs IsoLoCo on a small decoder-only language model.

Run `python -m isoloco_kernels.train --help`. The pieces are importable for other loops:
`ByteLM` (model.py), `load_corpus` (data.py), `tokenize` (tokenizer.py: BPE, optional `tokenizers`),
`TrainConfig` (config.py), `Setup`, `run_mode`, `Comm` (loop.py), the inner and outer optimizers
(optimizers.py), `DivergenceMeter` (divergence.py), `load_pseudo_gradients` (capture.py).
"""

from .capture import load_pseudo_gradients
from .config import DEFAULT_MODES, MODES, OUTER_DEFAULTS, TrainConfig
from .data import Corpus, load_corpus
from .divergence import DivergenceMeter
from .loop import Comm, Setup, run_mode
from .model import INITS, PRESETS, ByteLM, ModelConfig
from .tokenizer import tokenize

__all__ = [
    "DEFAULT_MODES",
    "INITS",
    "MODES",
    "OUTER_DEFAULTS",
    "PRESETS",
    "ByteLM",
    "Comm",
    "Corpus",
    "DivergenceMeter",
    "ModelConfig",
    "Setup",
    "TrainConfig",
    "load_corpus",
    "load_pseudo_gradients",
    "run_mode",
    "tokenize",
]
