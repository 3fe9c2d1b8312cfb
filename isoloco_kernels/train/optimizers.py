"""The inner and outer optimizers of each mode, and the inner lr schedule.

Inner: AdamW, or Muon on the hidden matrices with AdamW on the rest (TrainConfig.inner). Outer:
torch.optim.SGD with Nesterov momentum for diloco and avg, IsoLoCo for the Iso-C modes; both take the
same Nesterov step, stated once in `isoloco_kernels.reference.nesterov_ref`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .config import OUTER_DEFAULTS, SGD_MODES, TrainConfig


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
    muon = torch.optim.Muon(
        [p for n, p in model.named_parameters() if n in hidden],
        lr=cfg.inner_lr,
        weight_decay=cfg.weight_decay,
        momentum=0.95,
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )
    return InnerOptimizers(adamw, muon)


def outer_params(mode: str, names: Sequence[str], params: Sequence[torch.Tensor], cfg: TrainConfig) -> list:
    """The outer optimizer's params: all of them, or in an Iso-C mode with cfg.iso_skip two
    groups, the second (the parameters whose names start with a prefix of iso_skip) with iso=False
    and, with cfg.iso_skip_outer, its own (lr, momentum). With cfg.compress the groups carry the params' names
    (`param_names`), which a compression skip rule by name reads."""
    iso_skip = () if mode in SGD_MODES else tuple(cfg.iso_skip)
    if not iso_skip and cfg.compress is None:
        return list(params)
    keep, skip = {"params": [], "param_names": []}, {"params": [], "param_names": [], "iso": False}
    for n, p in zip(names, params):
        g = skip if iso_skip and n.startswith(iso_skip) else keep
        g["params"].append(p)
        g["param_names"].append(n)
    if cfg.iso_skip_outer is not None and iso_skip:
        skip["lr"], skip["momentum"] = (float(x) for x in cfg.iso_skip_outer)
    groups = [keep, skip] if iso_skip else [keep]
    if cfg.compress is None:
        for g in groups:
            del g["param_names"]
    return groups


def outer_optimizer(mode: str, params, cfg: TrainConfig) -> torch.optim.Optimizer:
    lr, mom = cfg.outer(mode)
    if cfg.compress is not None:  # the K workers' compressed exchange, simulated (optim/compressed.py)
        from ..optim.mergeloco import MergeLoCo

        merge, iso = ("mean", False) if mode in SGD_MODES else (cfg.merge, True)
        return MergeLoCo(
            params, lr=lr, momentum=mom, merge=merge, iso=iso, method=cfg.iso_method, compress=cfg.compress
        )
    if mode in SGD_MODES:
        return torch.optim.SGD(params, lr=lr, momentum=mom, nesterov=mom > 0)
    if cfg.merge != "iso_c":
        from ..optim.mergeloco import MergeLoCo

        return MergeLoCo(params, lr=lr, momentum=mom, merge=cfg.merge, method=cfg.iso_method, clip=cfg.merge_clip)
    from ..optim.isoloco import IsoLoCo

    return IsoLoCo(params, lr=lr, momentum=mom, iso=True, method=cfg.iso_method)


def round_bytes(cfg: TrainConfig, params: Sequence[torch.Tensor], names: Optional[Sequence[str]] = None) -> dict:
    """What one worker sends per outer round: with cfg.compress the compressed owner route's both legs, scales
    included (`compress.model_exchange_bytes`: a param the spec's skip rule keeps, by shape or by its name in
    `names`, in its dtype both ways), else an fp32 ring all-reduce's 2·(K − 1)/K·4 bytes per
    entry, which every run also records for comparison (optim/compressed.py `worker_bytes`)."""
    from ..compress import parse
    from ..optim.compressed import worker_bytes

    got = worker_bytes(parse(cfg.compress) if cfg.compress else None, params, cfg.workers, names)
    sent = got["allreduce_fp32"] if got["compressed"] is None else got["compressed"]
    out = {"bytes_per_worker_per_round": sent, "allreduce_fp32_bytes_per_worker_per_round": got["allreduce_fp32"]}
    return out | ({"compress": cfg.compress} if cfg.compress else {})


class OuterSchedule:
    """The outer optimizer's schedule over R rounds (TrainConfig.outer_schedule), through torch's LR scheduler
    (LambdaLR: the lr factor is set in param_groups before each outer step, which the outer optimizers read
    every step) or, for the momentum warm-up, the groups' momentum set the same way. W = min(R, max(2, round(5 % of R)))
    warm-up rounds: round r (0-based) runs at (r + 1)/W of the lr (or of μ) while r < W; warmup-cosine then
    decays the lr from 1× to 0.1× along a half cosine over the remaining rounds. `step()` after each outer step."""

    def __init__(self, opt: torch.optim.Optimizer, kind: str, rounds: int):
        self.opt, self.kind, self.rounds = opt, kind, rounds
        self.warm = min(rounds, max(2, round(0.05 * rounds)))  # 5 % of the rounds, ≥ 2 (a warm-up), ≤ R
        self.round = 0
        self.mu = [g["momentum"] for g in opt.param_groups]
        self.lr_sched = None
        if kind in ("warmup", "warmup-cosine"):
            self.lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_factor)
        self._set_momentum()

    def lr_factor(self, r: int) -> float:
        if r < self.warm:
            return (r + 1) / self.warm
        if self.kind != "warmup-cosine" or self.rounds <= self.warm + 1:
            return 1.0
        t = (r - self.warm) / (self.rounds - self.warm - 1)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))

    def _set_momentum(self) -> None:
        if self.kind == "momentum-warmup":
            f = min(1.0, (self.round + 1) / self.warm)
            for g, mu in zip(self.opt.param_groups, self.mu):
                g["momentum"] = mu * f

    def step(self) -> None:
        self.round += 1
        if self.lr_sched is not None:
            self.lr_sched.step()
        self._set_momentum()


def check_outer_step(mode: str, cfg: TrainConfig) -> None:
    """Build `mode`'s outer optimizer with cfg's settings on two small stand-in params and take one step on
    K = cfg.workers zero pseudo-gradients, so a setting the outer step cannot run (a merge, its options, the
    flatten method, K) fails here, before any training, instead of after the modes before it trained.
    Raises ValueError naming the mode."""
    if mode not in OUTER_DEFAULTS:
        return
    params = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))]
    try:
        opt = outer_optimizer(mode, params, cfg)
        stacks = [torch.zeros(cfg.workers, *p.shape) for p in params]
        if getattr(opt, "merge", "iso_c") != "iso_c" or getattr(opt, "compress", None) is not None:
            opt.step(deltas=stacks)
        else:
            for p, st in zip(params, stacks):
                p.grad = st.mean(0)
            opt.step()
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"--mode {mode} with K={cfg.workers}, merge {cfg.merge!r}: its outer step cannot run: {e}"
        ) from e
