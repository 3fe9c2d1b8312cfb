"""The reference training loop: DDP, DiLoCo and IsoLoCo on the same data, init and token budget.

    ddp          one model, one AdamW step per inner step on the K workers' batches together
                 (batch K×b): the FLOP- and data-matched synchronous baseline.
    diloco       K workers × H inner AdamW steps, then an outer Nesterov SGD step (lr 0.7, μ 0.9)
                 on the averaged pseudo-gradient Δ = mean_k(θ − θ_k).
    isoloco      the same rounds, outer step IsoLoCo (Iso-C flatten, then Nesterov; lr 1.8, μ 0.8).
    isoloco-sgd  Iso-C flatten with no momentum (μ 0): θ ← θ − lr·iso(Δ). Default lr 3.0, close
                 to IsoLoCo's first outer step lr·(1 + μ) = 1.8·1.8 = 3.24, so both start with the
                 same step size. lr 1 (the bare Iso-C merge) is too small: the flatten keeps only
                 the mean singular value, so ‖iso(Δ)‖_F < ‖Δ‖_F. Measured (study/README.md, K 4,
                 H 30, 2 seeds): held-out 2.50 at lr 3.0 vs 3.18 at lr 1.0.
    avg          plain averaging (local SGD / FedAvg): outer SGD lr 1, μ 0, so θ ← mean_k θ_k.
                 Not in the default set of modes (`--mode all` or `--mode avg` runs it).

Every round of a mode with an outer step also records how far the workers drifted apart
(divergence.py: pairwise cosine and shrinkage of the Δ_k, spectrum of the averaged Δ), and a
`capture` callback can save the averaged Δ (the CLI's --save-pseudo-gradients).

Workers are simulated one after another in this process. Each keeps its own data stream and its
own AdamW state across rounds (as in DiLoCo); they share one scratch model that is reset to the
global weights at the start of each worker's turn. The only cross-worker communication is
`Comm.average_`, so a multi-process launcher replaces that one object.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from .data import Batches, Corpus, check_fits, heldout_splits, worker_seed, worker_shards
from .divergence import DivergenceMeter
from .model import INITS, PRESETS, ByteLM, ModelConfig, count_params
from .tokenizer import check_vocab, tokenize

MODES = ("ddp", "diloco", "isoloco", "isoloco-sgd", "avg")
DEFAULT_MODES = ("ddp", "diloco", "isoloco", "isoloco-sgd")  # the CLI's default comparison
# (outer lr, outer momentum) per mode; ddp has no outer step.
OUTER_DEFAULTS = {"diloco": (0.7, 0.9), "isoloco": (1.8, 0.8), "isoloco-sgd": (3.0, 0.0), "avg": (1.0, 0.0)}
SGD_MODES = ("diloco", "avg")  # outer torch.optim.SGD (no Iso-C)
INNERS = ("adamw", "muon")  # the inner optimizer (inner_optimizer)


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
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**63:
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
        for mode, lr in self.outer_lr.items():
            if mode not in OUTER_DEFAULTS:
                raise ValueError(
                    f"outer lr given for {mode!r}, which has no outer step; modes with one: "
                    f"{sorted(OUTER_DEFAULTS)}"
                )
            if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
                raise ValueError(f"outer lr for {mode} must be a finite number > 0, got {lr!r}")
        for mode, mu in self.outer_momentum.items():
            if mode not in OUTER_DEFAULTS:
                raise ValueError(
                    f"outer momentum given for {mode!r}, which has no outer step; modes with one: "
                    f"{sorted(OUTER_DEFAULTS)}"
                )
            if isinstance(mu, bool) or not (isinstance(mu, (int, float)) and 0 <= mu < 1):
                raise ValueError(f"outer momentum for {mode} must be in [0, 1), got {mu!r}")
        if self.inner not in INNERS:
            raise ValueError(f"inner must be one of {INNERS}, got {self.inner!r}")
        from ..flatten import METHODS

        if self.iso_method not in METHODS:
            raise ValueError(f"iso_method must be one of {METHODS}, got {self.iso_method!r}")
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
        if self.iso_skip_outer is not None:
            if not self.iso_skip:
                raise ValueError("iso_skip_outer is set but iso_skip names no parameters")
            v = self.iso_skip_outer
            numbers = isinstance(v, (tuple, list)) and len(v) == 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
            if not (numbers and math.isfinite(v[0]) and v[0] > 0 and 0 <= v[1] < 1):
                raise ValueError(f"iso_skip_outer must be (lr > 0, 0 ≤ momentum < 1), got {self.iso_skip_outer!r}")

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


def memory_estimate(cfg: TrainConfig, modes: Sequence[str], local_workers: int) -> int:
    """A lower bound, in bytes, of what one process holds at once to train cfg's modes with
    `local_workers` workers on it: float32 weights, grads and AdamW moments (each worker keeps its
    own), the global copy, Δ and the outer momentum, and the activations of one inner step (DDP
    takes the local workers' batches together) or of one evaluation chunk."""
    mcfg = cfg.model_config()
    n = cfg.n_params()
    outer = any(m != "ddp" for m in modes)
    states = n * 4 * ((2 * local_workers + 5) if outer else 5)
    seqs = cfg.batch * (local_workers if "ddp" in modes else 1)
    per_token = 4 * (mcfg.n_layers * 8 * mcfg.d_model + 2 * mcfg.vocab)
    return states + max(seqs, min(cfg.eval_windows, 64)) * mcfg.seq_len * per_token


def available_memory(device) -> int | None:
    """Bytes free for a new allocation on device: CUDA's free memory, or the CPU's MemAvailable
    (None where the system does not say)."""
    d = torch.device(device)
    if d.type == "cuda":
        return int(torch.cuda.mem_get_info(d)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_memory(cfgs: Sequence[TrainConfig], modes: Sequence[str], local_workers: Callable[[TrainConfig], int]) -> None:
    """ValueError, before any training, when even memory_estimate exceeds the device's free memory
    (e.g. --workers 20000, or a batch × sequence that fits the data but not the machine)."""
    for c in cfgs:
        free = available_memory(c.device)
        need = memory_estimate(c, modes, local_workers(c))
        if free is not None and need > free:
            raise ValueError(
                f"the run needs at least {need / 2**30:.2f} GiB on {c.device} (model {c.model}, vocab {c.vocab}, "
                f"{local_workers(c)} worker(s) here, batch {c.batch}) but {free / 2**30:.2f} GiB is free; "
                "use fewer workers, a smaller batch, sequence or vocabulary"
            )


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


class Comm:
    """Averaging across the K workers; the one place a multi-process run differs.

    `average_` takes tensors that hold the SUM of this process's workers' contributions and
    leaves in them the MEAN over all K workers. Here every worker lives in this process, so the
    sum is already complete and only the division remains. A torch.distributed version does
    `all_reduce(t, SUM)` on each tensor (or one flat buffer) before the same division, and sets
    `local_workers` to the worker(s) of its rank.
    """

    def __init__(self, workers: int):
        self.world_workers = workers
        self.local_workers = list(range(workers))

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        torch._foreach_div_(list(tensors), float(self.world_workers))

    def outer_optimizer(self, mode: str, params, cfg: TrainConfig) -> torch.optim.Optimizer:
        """The outer optimizer over this process's copy of the global params (replicated)."""
        return outer_optimizer(mode, params, cfg)

    def pseudo_gradients_(self, delta: Sequence[torch.Tensor]) -> None:
        """Δ summed over this process's workers → the outer optimizer's p.grad: the mean over all K.

        A launcher whose outer optimizer averages by itself (a sharded step) leaves Δ as it is.
        """
        self.average_(delta)

    def mean_pseudo_gradients(self, delta: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The mean Δ over all K workers, after pseudo_gradients_ (read only: measured, saved)."""
        return delta


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from 1 to min_ratio at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


class InnerOptimizers:
    """Several optimizers stepped as one (Muon on some parameters, AdamW on the others): what the
    loop needs of an inner optimizer — param_groups (the lr schedule writes each group's lr),
    step() and zero_grad()."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def muon_params(model: torch.nn.Module) -> list[str]:
    """The names of the matrices Muon steps under inner="muon": the 2-D weights inside the blocks
    (attention qkv and output, MLP up and down); the embeddings, head and norms stay on AdamW."""
    return [n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]


def inner_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer | InnerOptimizers:
    """AdamW (weight decay on matrices only), or with cfg.inner "muon" the MuLoCo recipe:
    torch.optim.Muon (momentum 0.95, Nesterov, 5 Newton–Schulz steps) on the hidden matrices with
    the same lr and weight decay as AdamW, its step rescaled by 0.2·sqrt(max(m, n)) so its update
    RMS matches AdamW's (adjust_lr_fn="match_rms_adamw", Moonlight's rule), and AdamW on the
    embeddings, head and norm gains."""
    hidden = set(muon_params(model)) if cfg.inner == "muon" else set()
    named = [(n, p) for n, p in model.named_parameters() if n not in hidden]
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.inner_lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=True,  # one kernel for all params, on CPU and CUDA: the inner step is overhead-bound
    )
    if not hidden:
        return adamw
    muon = torch.optim.Muon([p for n, p in model.named_parameters() if n in hidden], lr=cfg.inner_lr,
                            weight_decay=cfg.weight_decay, momentum=0.95, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    return InnerOptimizers(adamw, muon)


def outer_params(mode: str, names: Sequence[str], params: Sequence[torch.Tensor], cfg: TrainConfig) -> list:
    """The outer optimizer's params: all of them, or in an Iso-C mode with cfg.iso_skip two
    groups, the second (the parameters whose names start with a prefix of iso_skip) with iso=False
    and, with cfg.iso_skip_outer, its own (lr, momentum)."""
    if mode in SGD_MODES or not cfg.iso_skip:
        return list(params)
    keep, skip = [], []
    for n, p in zip(names, params):
        (skip if n.startswith(tuple(cfg.iso_skip)) else keep).append(p)
    group = {"params": skip, "iso": False}
    if cfg.iso_skip_outer is not None:
        group["lr"], group["momentum"] = (float(x) for x in cfg.iso_skip_outer)
    return [{"params": keep}, group]


def outer_optimizer(mode: str, params, cfg: TrainConfig) -> torch.optim.Optimizer:
    lr, mom = cfg.outer(mode)
    if mode in SGD_MODES:
        return torch.optim.SGD(params, lr=lr, momentum=mom, nesterov=mom > 0)
    from ..optim import IsoLoCo

    return IsoLoCo(params, lr=lr, momentum=mom, iso=True, method=cfg.iso_method)


class Diverged(RuntimeError):
    pass


def _check_finite(loss: torch.Tensor, where: str) -> None:
    if not torch.isfinite(loss):
        raise Diverged(f"{where}: loss is {loss.item()}")


@torch.no_grad()
def evaluate(model: ByteLM, hx: torch.Tensor, hy: torch.Tensor, chunk: int = 64,
             heldout_bytes: float | None = None) -> float:
    """Held-out loss in nats/byte over the fixed windows.

    Byte-level: the mean loss. Tokens: the summed loss over every target token divided by
    `heldout_bytes`, the number of bytes those targets stand for.
    """
    model.eval()
    total = 0.0
    for i in range(0, hx.shape[0], chunk):
        with torch.autocast("cuda", torch.bfloat16, enabled=hx.is_cuda):
            total += model.loss(hx[i : i + chunk], hy[i : i + chunk]).item() * hx[i : i + chunk].shape[0]
    model.train()
    if heldout_bytes is None:
        return total / hx.shape[0]
    return total * hx.shape[1] / heldout_bytes


class Setup:
    """Everything a mode needs that must be identical across modes: init, shards, eval set.

    With cfg.vocab > 256 a byte corpus is tokenized first (tokenizer.py; the tokenizer is trained
    on its training split and kept in `cache_dir` when given).
    """

    def __init__(self, cfg: TrainConfig, corpus: Corpus, cache_dir=None):
        cfg.validate()
        self.cfg = cfg
        self.mcfg = cfg.model_config()
        if corpus.vocab != cfg.vocab:
            corpus = tokenize(corpus, cfg.vocab, cache_dir)
        self.corpus = corpus
        check_fits(corpus, cfg.workers, cfg.batch, self.mcfg.seq_len)
        self.device = torch.device(cfg.device)
        self.shards = [s.to(self.device) for s in worker_shards(corpus.train, cfg.workers)]
        (hx, hy), (tx, ty) = heldout_splits(corpus.heldout, self.mcfg.seq_len, cfg.eval_windows)
        self.hx, self.hy = hx.to(self.device), hy.to(self.device)  # selection split
        self.tx, self.ty = tx.to(self.device), ty.to(self.device)  # test split
        # nats/byte for tokens: the bytes the held-out targets stand for (None: they are bytes)
        self.heldout_bytes = None if corpus.token_bytes is None else float(corpus.token_bytes[hy].sum())
        self.test_bytes = None if corpus.token_bytes is None else float(corpus.token_bytes[ty].sum())
        # windows per split: cfg.eval_windows, or fewer where a half of the held-out text holds fewer
        self.eval_windows = (int(hx.shape[0]), int(tx.shape[0]))
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(cfg.seed)
        init = ByteLM(self.mcfg)
        torch.random.set_rng_state(gen_state)
        self.n_params = count_params(init)
        self.init_state = {k: v.to(self.device) for k, v in init.state_dict().items()}

    def model(self) -> ByteLM:
        m = ByteLM(self.mcfg).to(self.device)
        m.load_state_dict(self.init_state)
        return m

    def batches(self) -> list[Batches]:
        """Worker k's stream depends on (seed, k) only, so every mode sees the same bytes."""
        T = self.mcfg.seq_len
        return [Batches(s, self.cfg.batch, T, worker_seed(self.cfg.seed, k)) for k, s in enumerate(self.shards)]

    def evaluate(self, model: ByteLM) -> float:
        """Held-out loss on the selection split."""
        return evaluate(model, self.hx, self.hy, heldout_bytes=self.heldout_bytes)

    def evaluate_test(self, model: ByteLM) -> float:
        """Held-out loss on the test split (report it; pick settings on `evaluate`)."""
        return evaluate(model, self.tx, self.ty, heldout_bytes=self.test_bytes)

    def tokens_per_round(self) -> int:
        c = self.cfg
        return c.workers * c.inner_steps * c.batch * self.mcfg.seq_len


def _inner_step(model, opt, x, y, scale, lr, cfg, comm=None) -> torch.Tensor:
    for g in opt.param_groups:
        g["lr"] = lr
    with torch.autocast("cuda", torch.bfloat16, enabled=x.is_cuda):  # bf16 matmuls on a GPU
        loss = model.loss(x, y)
    (loss * scale).backward()
    if comm is not None:
        comm.average_([p.grad for p in model.parameters()])
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _scored(round_: int, cfg: TrainConfig) -> bool:
    """Whether the held-out splits are scored after this (1-based) round: every eval_every-th, and the last."""
    return round_ % cfg.eval_every == 0 or round_ == cfg.rounds


def run_mode(
    mode: str,
    setup: Setup,
    comm: Comm | None = None,
    progress: Callable[[int, float | None], None] | None = None,
    capture: Callable[[int, list[str], Sequence[torch.Tensor]], None] | None = None,
) -> dict:
    """Train one mode from the shared init; return its held-out curve and timings.

    progress(inner_steps_done, last_heldout_loss) is called after every inner step (per worker).
    capture(round, names, mean_delta) is called in every round of an outer mode (1-based round)
    with the averaged pseudo-gradient before the outer step; it must not modify it.
    With cfg.divergence, out["divergence"] holds one dict per round (divergence.py).
    A non-finite loss stops the mode and is reported under "diverged" (never silently).
    Held-out losses: heldout_loss / final_loss on the selection split, test_loss / final_test_loss
    on the test split (Setup.evaluate, Setup.evaluate_test).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    cfg = setup.cfg
    comm = comm or Comm(cfg.workers)
    K, H, R = cfg.workers, cfg.inner_steps, cfg.rounds
    total = H * R
    model = setup.model()
    batches = setup.batches()
    losses = [setup.evaluate(model)]
    test_losses = [setup.evaluate_test(model)]
    tokens = [0]
    out = {"mode": mode}
    if mode != "ddp":
        out["outer_lr"], out["outer_momentum"] = cfg.outer(mode)
    t0 = time.perf_counter()
    done = 0
    try:
        if mode == "ddp":
            opt = inner_optimizer(model, cfg)
            local = comm.local_workers
            for step in range(total):
                lr = cfg.inner_lr * lr_factor(step, total, cfg.warmup, cfg.min_lr_ratio)
                xs, ys = zip(*(batches[k].next() for k in local))
                # scale: the loss is the mean over local workers; average_ wants their sum
                loss = _inner_step(model, opt, torch.cat(xs), torch.cat(ys), len(local), lr, cfg, comm)
                _check_finite(loss, f"ddp step {step}")
                done += len(local)
                if (step + 1) % H == 0 and _scored((step + 1) // H, cfg):
                    losses.append(setup.evaluate(model))
                    test_losses.append(setup.evaluate_test(model))
                    tokens.append((step + 1) // H * setup.tokens_per_round())
                    _check_finite(torch.tensor(losses[-1]), f"ddp held-out after step {step + 1}")
                if progress:
                    progress(done, losses[-1])
        else:
            work = ByteLM(setup.mcfg).to(setup.device)  # the scratch model every worker trains
            inner = {k: inner_optimizer(work, cfg) for k in comm.local_workers}
            params = list(model.parameters())
            names = [n for n, _ in model.named_parameters()]
            outer = comm.outer_optimizer(mode, outer_params(mode, names, params, cfg), cfg)
            meter = DivergenceMeter(model) if cfg.divergence else None
            if meter is not None:
                out["divergence"] = []
            for r in range(R):
                delta = [torch.zeros_like(p) for p in params]
                if meter is not None:
                    meter.start_round()
                for k in comm.local_workers:
                    with torch.no_grad():
                        torch._foreach_copy_(list(work.parameters()), params)
                    for h in range(H):
                        step = r * H + h
                        lr = cfg.inner_lr * lr_factor(step, total, cfg.warmup, cfg.min_lr_ratio)
                        x, y = batches[k].next()
                        loss = _inner_step(work, inner[k], x, y, 1.0, lr, cfg)
                        _check_finite(loss, f"{mode} round {r} worker {k} inner step {h}")
                        done += 1
                        if progress:
                            progress(done, losses[-1])
                    with torch.no_grad():  # Δ_k = global − local, summed over this process's workers
                        torch._foreach_add_(delta, params)
                        torch._foreach_sub_(delta, list(work.parameters()))
                        if meter is not None:
                            meter.add_worker(torch._foreach_sub(params, list(work.parameters())))
                comm.pseudo_gradients_(delta)
                if meter is not None or capture is not None:
                    mean_delta = comm.mean_pseudo_gradients(delta)
                    if meter is not None:
                        out["divergence"].append({"round": r + 1, **meter.finish(comm, mean_delta)})
                    if capture is not None:
                        capture(r + 1, names, mean_delta)
                for p, d in zip(params, delta):
                    p.grad = d
                outer.step()
                outer.zero_grad(set_to_none=True)
                if not _scored(r + 1, cfg):
                    continue
                losses.append(setup.evaluate(model))
                test_losses.append(setup.evaluate_test(model))
                tokens.append((r + 1) * setup.tokens_per_round())
                _check_finite(torch.tensor(losses[-1]), f"{mode} held-out after round {r + 1}")
    except Diverged as e:
        out["diverged"] = str(e)
    out["wall_s"] = time.perf_counter() - t0
    out["tokens"] = tokens
    out["heldout_loss"] = losses  # the selection split
    out["final_loss"] = None if "diverged" in out else losses[-1]
    out["test_loss"] = test_losses
    out["eval_windows_scored"] = list(setup.eval_windows)  # (selection, test): fewer than asked where a half is short
    out["final_test_loss"] = None if "diverged" in out else test_losses[-1]
    return out
