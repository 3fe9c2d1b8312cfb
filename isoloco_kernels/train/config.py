"""The run's settings: the modes, their outer defaults and `TrainConfig`, validated before any training.

The outer step of each mode (its Nesterov rule is `isoloco_kernels.reference.nesterov_ref`) is built in
optimizers.py; the loop that runs the modes is loop.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .model import INITS, PRESETS, ByteLM, ModelConfig, count_params
from .tokenizer import check_vocab

MODES = ("ddp", "diloco", "isoloco", "isoloco-sgd", "avg")
DEFAULT_MODES = ("ddp", "diloco", "isoloco", "isoloco-sgd")  # the CLI's default comparison
# (outer lr, outer momentum) per mode; ddp has no outer step.
OUTER_DEFAULTS = {"diloco": (0.7, 0.9), "isoloco": (1.8, 0.8), "isoloco-sgd": (3.0, 0.0), "avg": (1.0, 0.0)}
SGD_MODES = ("diloco", "avg")  # outer torch.optim.SGD (no Iso-C)
MERGING_MODES = ("isoloco", "isoloco-sgd")  # the modes --merge applies to
INNERS = ("adamw", "muon")  # the inner optimizer (inner_optimizer)
#: The outer optimizer's schedules (optimizers.OuterSchedule): constant; a linear warm-up of the outer lr over
#: the first 5 % of rounds; that warm-up, then a cosine decay of the outer lr to 0.1×; a linear warm-up of the
#: outer momentum from 0 over the first 5 % of rounds.
OUTER_SCHEDULES = ("constant", "warmup", "warmup-cosine", "momentum-warmup")


@dataclass
class TrainConfig:
    model: str = "tiny"  # a key of model.PRESETS
    workers: int = 8  # K
    inner_steps: int = 30  # H
    rounds: int = 12  # outer steps
    batch: int = 4  # sequences per worker per inner step
    seq_len: int | None = None  # None: the preset's
    tie_embeddings: bool = False  # share the input embedding with the output head
    inner_lr: float = 3e-3  # AdamW peak lr
    warmup: int = 20  # inner steps of linear warmup, then cosine to min_lr_ratio·inner_lr
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1  # on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0
    outer_lr: dict = field(default_factory=dict)  # mode -> lr, overrides OUTER_DEFAULTS
    outer_momentum: dict = field(default_factory=dict)  # mode -> μ, overrides OUTER_DEFAULTS
    inner: str = "adamw"  # "adamw", or "muon": Muon on the hidden matrices, AdamW on the rest (MuLoCo)
    iso_method: str = "auto"  # IsoLoCo's flatten method
    # the Iso-C modes' aggregation of the K workers' deltas (merges.MERGES): "iso_c" is IsoLoCo;
    # another keeps every worker's Δ and steps with MergeLoCo (one process only)
    merge: str = "iso_c"
    outer_schedule: str = "constant"  # OUTER_SCHEDULES: the outer lr or momentum over the rounds
    # held-out windows of seq_len tokens in each of two splits, the same for every mode: the
    # selection split (first half of the held-out stream: heldout_loss, final_loss, to pick lrs on)
    # and the test split (second half: test_loss, final_test_loss, to report)
    eval_windows: int = 64
    eval_every: int = 1  # rounds (DDP: H inner steps) between held-out evaluations; the last is always scored
    seed: int = 0
    device: str = "cpu"
    vocab: int = 256  # 256: bytes; more: a BPE vocabulary trained on the training split
    init: str = "gpt2"  # a key of model.INITS: "gpt2" N(0, 0.02), "torch" (PyTorch defaults), "torch-pos1"
    divergence: bool = True  # measure the workers' drift every round (divergence.py)
    # parameter-name prefixes kept out of Iso-C in the Iso-C modes (e.g. ("tok.", "head.")): their
    # averaged Δ takes the same outer step unflattened (an IsoLoCo param group with iso=False)
    iso_skip: tuple = ()
    iso_skip_outer: tuple | None = None  # (lr, momentum) of the iso_skip group; None: the mode's
    # a compress.parse spec ("int4:128:0.95": format, block, β): every outer mode's exchange compressed, each
    # worker's Δ and the owners' update (MergeLoCo(compress=...) here; ShardedIsoLoCo under torchrun); None: off
    compress: str | None = None
    # workers as they really arrive (one process, every outer mode): `drop`, the fraction of the K workers that
    # miss each round (round(drop·K) of them, drawn anew each round from the seed; they do not train that round
    # and their Δ enters the merge with weight 0); `faulty`, a factor on worker 0's Δ every round (a faulty
    # worker); `merge_clip`, each worker's Δ clipped per tensor before the merge ("median" of the delivering
    # workers' norms, or a cap: merges.merge's clip)
    drop: float = 0.0
    faulty: float = 1.0
    merge_clip: str | float | None = None

    def model_config(self) -> ModelConfig:
        if self.model not in PRESETS:
            raise ValueError(f"model must be one of {sorted(PRESETS)}, got {self.model!r}")
        cfg = PRESETS[self.model].as_dict()
        if self.seq_len is not None:
            cfg["seq_len"] = self.seq_len
        cfg["tie_embeddings"] = self.tie_embeddings
        cfg["vocab"] = self.vocab
        cfg["init"] = self.init
        return ModelConfig(**cfg)

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting; call before any training."""
        for name in ("workers", "inner_steps", "rounds", "batch", "eval_windows", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer ≥ 1, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise ValueError(f"seq_len must be an integer ≥ 1, got {self.seq_len!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer ≥ 0, got {self.warmup!r}")
        for name in ("inner_lr", "clip"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("weight_decay", "min_lr_ratio"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number ≥ 0, got {v!r}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ValueError(f"{name} must be in [0, 1), got {v!r}")
        for what, given, ok, rule in (
            (
                "lr",
                self.outer_lr,
                lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0,
                "a finite number > 0",
            ),
            (
                "momentum",
                self.outer_momentum,
                lambda v: not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v < 1,
                "in [0, 1)",
            ),
        ):
            for mode, v in given.items():
                if mode not in OUTER_DEFAULTS:
                    raise ValueError(
                        f"outer {what} given for {mode!r}, which has no outer step; modes with one: "
                        f"{sorted(OUTER_DEFAULTS)}"
                    )
                if not ok(v):
                    raise ValueError(f"outer {what} for {mode} must be {rule}, got {v!r}")
        if self.inner not in INNERS:
            raise ValueError(f"inner must be one of {INNERS}, got {self.inner!r}")
        from ..flatten.registry import METHODS

        if self.iso_method not in METHODS:
            raise ValueError(f"iso_method must be one of {METHODS}, got {self.iso_method!r}")
        from ..merges import MERGES

        if self.merge not in MERGES:
            raise ValueError(f"merge must be one of {tuple(MERGES)}, got {self.merge!r}")
        if self.compress is not None:
            from ..compress import parse

            parse(self.compress)  # ValueError naming the spec
        if isinstance(self.drop, bool) or not isinstance(self.drop, (int, float)) or not 0 <= self.drop < 1:
            raise ValueError(f"drop must be a fraction of the workers in [0, 1), got {self.drop!r}")
        if round(self.drop * self.workers) >= self.workers:
            raise ValueError(f"drop {self.drop} of {self.workers} workers leaves none to merge; lower it")
        if (
            isinstance(self.faulty, bool)
            or not isinstance(self.faulty, (int, float))
            or not (math.isfinite(self.faulty) and self.faulty > 0)
        ):
            raise ValueError(f"faulty must be a finite factor > 0 on worker 0's Δ (1: none), got {self.faulty!r}")
        c = self.merge_clip
        if (
            c is not None
            and c != "median"
            and (isinstance(c, bool) or not isinstance(c, (int, float)) or not (math.isfinite(c) and c > 0))
        ):
            raise ValueError(f"merge_clip must be None, 'median' or a finite number > 0, got {c!r}")
        if self.ragged() and self.compress is not None:
            raise ValueError("drop, faulty and merge_clip run on the uncompressed exchange; leave out compress")
        if self.outer_schedule not in OUTER_SCHEDULES:
            raise ValueError(f"outer_schedule must be one of {OUTER_SCHEDULES}, got {self.outer_schedule!r}")
        if self.merge != "iso_c" and self.iso_skip:
            raise ValueError(f"iso_skip keeps matrices out of Iso-C; it cannot combine with merge {self.merge!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        check_vocab(self.vocab)
        check_device(self.device)
        mcfg = self.model_config()
        if isinstance(self.iso_skip, str):
            raise ValueError(f"iso_skip must be a tuple of parameter-name prefixes, got the string {self.iso_skip!r}")
        if self.iso_skip:
            with torch.device("meta"):  # names only: no memory, no init
                matrices = [n for n, p in ByteLM(mcfg).named_parameters() if p.ndim == 2]
            for prefix in self.iso_skip:
                if not isinstance(prefix, str) or not prefix:
                    raise ValueError(f"iso_skip entries must be non-empty parameter-name prefixes, got {prefix!r}")
                if not any(n.startswith(prefix) for n in matrices):
                    raise ValueError(
                        f"iso_skip {prefix!r} matches no matrix of the model; its matrices: {', '.join(matrices)}"
                    )
        if self.compress is not None:  # a skip rule's name prefixes must name params of the model (a typo keeps
            from ..compress import parse  # everything compressed, silently)

            with torch.device("meta"):
                names = [n for n, _ in ByteLM(mcfg).named_parameters()]
            for prefix in parse(self.compress).skip_prefixes:
                if not any(n.startswith(prefix) for n in names):
                    raise ValueError(
                        f"compress {self.compress!r}: skip name={prefix} matches no param of the model; its params: "
                        f"{', '.join(names)}"
                    )
        if self.iso_skip_outer is not None:
            if not self.iso_skip:
                raise ValueError("iso_skip_outer is set but iso_skip names no parameters")
            v = self.iso_skip_outer
            numbers = (
                isinstance(v, (tuple, list))
                and len(v) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
            )
            if not (numbers and math.isfinite(v[0]) and v[0] > 0 and 0 <= v[1] < 1):
                raise ValueError(f"iso_skip_outer must be (lr > 0, 0 ≤ momentum < 1), got {self.iso_skip_outer!r}")

    def ragged(self) -> bool:
        """Whether the workers do not all arrive alike (drop, faulty or merge_clip set): the loop then keeps every
        worker's Δ and merges them with weights (merges.merge)."""
        return self.drop > 0 or self.faulty != 1 or self.merge_clip is not None

    def n_params(self) -> int:
        """The model's parameter count, from its shapes alone (nothing allocated)."""
        with torch.device("meta"):
            return count_params(ByteLM(self.model_config()))

    def outer(self, mode: str) -> tuple[float, float]:
        if mode not in OUTER_DEFAULTS:
            raise ValueError(f"mode {mode!r} has no outer step; modes with one: {sorted(OUTER_DEFAULTS)}")
        lr, mom = OUTER_DEFAULTS[mode]
        return float(self.outer_lr.get(mode, lr)), float(self.outer_momentum.get(mode, mom))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["model_config"] = self.model_config().as_dict()
        return d


def check_device(device) -> None:
    """cpu, cuda or cuda:N (N a visible GPU); anything else is a ValueError naming it."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r} (the loop runs on CPUs and CUDA GPUs)")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
