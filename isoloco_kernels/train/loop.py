"""The reference training loop: DDP, DiLoCo and IsoLoCo on the same data, init and token budget.

    ddp          one model, one AdamW step per inner step on the K workers' batches together
                 (batch K×b): the FLOP- and data-matched synchronous baseline.
    diloco       K workers × H inner AdamW steps, then an outer Nesterov SGD step (lr 0.7, μ 0.9)
                 on the averaged pseudo-gradient Δ = mean_k(θ − θ_k).
    isoloco      the same rounds, outer step IsoLoCo (Iso-C flatten, then Nesterov; lr 1.8, μ 0.8).
    isoloco-sgd  Iso-C flatten with no momentum (μ 0): θ ← θ − lr·iso(Δ). Default lr 3.0, close
                 to IsoLoCo's first outer step lr·(1 + μ) = 1.8·1.8 = 3.24 (the Nesterov step of
                 isoloco_kernels.reference.nesterov_ref from a zero buffer), so both start with the
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

import contextlib
import os
import time
from typing import Callable, Sequence

import torch

# the settings (config.py) and the optimizers (optimizers.py) are importable from here as before
from ..merges import merge
from .config import DEFAULT_MODES, INNERS, MODES, OUTER_DEFAULTS, SGD_MODES, TrainConfig, check_device
from .data import Batches, Corpus, check_fits, heldout_splits, worker_seed, worker_shards
from .divergence import DivergenceMeter
from .model import ByteLM, count_params
from .optimizers import (
    InnerOptimizers,
    OuterSchedule,
    inner_optimizer,
    lr_factor,
    muon_params,
    outer_optimizer,
    outer_params,
    round_bytes,
)
from .tokenizer import tokenize

__all__ = [
    "DEFAULT_MODES",
    "INNERS",
    "MODES",
    "OUTER_DEFAULTS",
    "SGD_MODES",
    "Comm",
    "Diverged",
    "InnerOptimizers",
    "Setup",
    "TrainConfig",
    "available_memory",
    "check_device",
    "check_memory",
    "evaluate",
    "inner_optimizer",
    "lr_factor",
    "memory_estimate",
    "muon_params",
    "outer_optimizer",
    "outer_params",
    "run_mode",
]


def memory_estimate(cfg: TrainConfig, modes: Sequence[str], local_workers: int) -> int:
    """A lower bound, in bytes, of what one process holds at once to train cfg's modes with
    `local_workers` workers on it: float32 weights, grads and AdamW moments (each worker keeps its
    own), the global copy, Δ and the outer momentum, and the activations of one inner step (DDP
    takes the local workers' batches together) or of one evaluation chunk; with cfg.compress also the
    error-feedback residuals where the spec's feedback places them: one per local worker on its Δ ("workers",
    the default, or "both") and the owners' on the update ("both" or "owner"; float32)."""
    mcfg = cfg.model_config()
    n = cfg.n_params()
    outer = any(m != "ddp" for m in modes)
    states = n * 4 * ((2 * local_workers + 5) if outer else 5)
    if outer and cfg.compress is not None:
        from ..compress import model_residual_bytes, parse

        spec = parse(cfg.compress)
        with torch.device("meta"):  # the params' shapes and names (a skip rule keeps some without a residual)
            named = [(n, tuple(p.shape)) for n, p in ByteLM(mcfg).named_parameters()]
        shapes, names = [s for _, s in named], [n for n, _ in named]
        states += local_workers * model_residual_bytes(spec, shapes, names=names) + model_residual_bytes(
            spec, shapes, names=names, leg="owner"
        )
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


def check_memory(
    cfgs: Sequence[TrainConfig], modes: Sequence[str], local_workers: Callable[[TrainConfig], int]
) -> None:
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


class Diverged(RuntimeError):
    pass


def _check_finite(loss: torch.Tensor, where: str) -> None:
    if not torch.isfinite(loss):
        raise Diverged(f"{where}: loss is {loss.item()}")


@torch.no_grad()
def evaluate(
    model: ByteLM, hx: torch.Tensor, hy: torch.Tensor, chunk: int = 64, heldout_bytes: float | None = None
) -> float:
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


class _Clock:
    """Seconds spent in named parts of a run (synced on CUDA, so queued work is counted where it runs)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = {"eval": 0.0, "outer": 0.0}

    @contextlib.contextmanager
    def time(self, part: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[part] += time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


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
    if cfg.ragged() and comm.local_workers != list(range(cfg.workers)):
        raise ValueError(
            "drop, faulty and merge_clip simulate the workers in one process; under torchrun leave them out"
        )
    H, R = cfg.inner_steps, cfg.rounds
    total = H * R
    model = setup.model()
    batches = setup.batches()
    losses = [setup.evaluate(model)]
    test_losses = [setup.evaluate_test(model)]
    tokens = [0]
    out = {"mode": mode}
    if mode != "ddp":
        out["outer_lr"], out["outer_momentum"] = cfg.outer(mode)
        named = list(model.named_parameters())
        out.update(round_bytes(cfg, [p for _, p in named], [n for n, _ in named]))  # what a worker sends per round
        if cfg.outer_schedule != "constant":
            out["outer_schedule"] = cfg.outer_schedule
    clock = _Clock(setup.device)
    t0 = time.perf_counter()
    done = 0
    trained = 0  # tokens the inner steps trained on (every worker's)
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
                trained += sum(x.numel() for x in xs)
                if (step + 1) % H == 0 and _scored((step + 1) // H, cfg):
                    with clock.time("eval"):
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
            schedule = OuterSchedule(outer, cfg.outer_schedule, R)
            meter = DivergenceMeter(model) if cfg.divergence else None
            if meter is not None:
                out["divergence"] = []
            per_worker = hasattr(outer, "set_deltas")  # MergeLoCo (a merge, or compress): every worker's Δ
            at = {id(p): i for i, p in enumerate(params)}  # its stacks go in its groups' order (iso_skip: two)
            order = [at[id(p)] for g in outer.param_groups for p in g["params"]]
            ragged = cfg.ragged()  # some workers miss rounds, one is faulty, or the Δ are clipped: weighted merges
            draw = torch.Generator().manual_seed(cfg.seed)  # who misses each round: the same for every mode
            n_drop = round(cfg.drop * cfg.workers)
            if ragged:
                out["ragged"] = {"drop": cfg.drop, "faulty": cfg.faulty, "merge_clip": cfg.merge_clip, "missed": []}
            for r in range(R):
                delta = [torch.zeros_like(p) for p in params]
                stacks = [[] for _ in params] if per_worker or ragged else None
                missed = set(torch.randperm(cfg.workers, generator=draw)[:n_drop].tolist()) if n_drop else set()
                if ragged:
                    out["ragged"]["missed"].append(sorted(missed))
                if meter is not None:
                    meter.start_round()
                for k in comm.local_workers:
                    if k in missed:  # this worker does not deliver: no training, weight 0 (a finite Δ of zeros)
                        for st, p in zip(stacks, params):
                            st.append(torch.zeros_like(p))
                        continue
                    with torch.no_grad():
                        torch._foreach_copy_(list(work.parameters()), params)
                    for h in range(H):
                        step = r * H + h
                        lr = cfg.inner_lr * lr_factor(step, total, cfg.warmup, cfg.min_lr_ratio)
                        x, y = batches[k].next()
                        loss = _inner_step(work, inner[k], x, y, 1.0, lr, cfg)
                        _check_finite(loss, f"{mode} round {r} worker {k} inner step {h}")
                        done += 1
                        trained += x.numel()
                        if progress:
                            progress(done, losses[-1])
                    if ragged:  # every worker's Δ_k kept; the merge below weighs and clips them
                        with torch.no_grad():
                            d = torch._foreach_sub(params, list(work.parameters()))
                            if k == 0 and cfg.faulty != 1:
                                torch._foreach_mul_(d, float(cfg.faulty))
                            for st, x in zip(stacks, d):
                                st.append(x)
                            if meter is not None:
                                meter.add_worker(d)
                        continue
                    with torch.no_grad():  # Δ_k = global − local, summed over this process's workers
                        torch._foreach_add_(delta, params)
                        torch._foreach_sub_(delta, list(work.parameters()))
                        if per_worker:
                            for st, d in zip(stacks, torch._foreach_sub(params, list(work.parameters()))):
                                st.append(d)
                        if meter is not None:
                            meter.add_worker(torch._foreach_sub(params, list(work.parameters())))
                weights = None
                if ragged:
                    weights = [0.0 if k in missed else 1.0 for k in range(cfg.workers)]
                    stacks = [torch.stack(st) for st in stacks]
                    if not per_worker or meter is not None or capture is not None:
                        # the clipped mean of the delivering workers: what DiLoCo steps on and IsoLoCo flattens
                        # (MergeLoCo merges and clips the stacks itself: MergeLoCo(clip=), step(weights=))
                        delta = merge(stacks, "mean", weights=weights, clip=cfg.merge_clip)
                else:
                    comm.pseudo_gradients_(delta)
                if meter is not None or capture is not None:
                    mean_delta = delta if ragged else comm.mean_pseudo_gradients(delta)
                    if meter is not None:
                        over = Comm(cfg.workers - len(missed)) if ragged else comm  # the delivering workers
                        out["divergence"].append({"round": r + 1, **meter.finish(over, mean_delta)})
                    if capture is not None:
                        capture(r + 1, names, mean_delta)
                for p, d in zip(params, delta):
                    p.grad = d
                with clock.time("outer"):
                    if per_worker and ragged:
                        outer.step(deltas=[stacks[i] for i in order], weights=weights)
                    elif per_worker:  # MergeLoCo merges the stacks (it never reads .grad)
                        outer.step(deltas=[torch.stack(stacks[i]) for i in order])
                    else:
                        outer.step()
                    outer.zero_grad(set_to_none=True)
                    schedule.step()
                if not _scored(r + 1, cfg):
                    continue
                with clock.time("eval"):
                    losses.append(setup.evaluate(model))
                    test_losses.append(setup.evaluate_test(model))
                tokens.append((r + 1) * setup.tokens_per_round())
                _check_finite(torch.tensor(losses[-1]), f"{mode} held-out after round {r + 1}")
    except Diverged as e:
        out["diverged"] = str(e)
    out["wall_s"] = time.perf_counter() - t0
    # training time: the wall less the held-out evaluations (they are not part of a round)
    train_s = max(out["wall_s"] - clock.seconds["eval"], 1e-9)
    out["train_s"] = train_s
    out["tokens_per_s"] = trained / train_s
    if mode != "ddp":
        out["outer_step_s"] = clock.seconds["outer"]
        out["outer_share"] = clock.seconds["outer"] / train_s  # of the rounds' time
    out["tokens"] = tokens
    out["heldout_loss"] = losses  # the selection split
    out["final_loss"] = None if "diverged" in out else losses[-1]
    out["test_loss"] = test_losses
    out["eval_windows_scored"] = list(setup.eval_windows)  # (selection, test): fewer than asked where a half is short
    out["final_test_loss"] = None if "diverged" in out else test_losses[-1]
    return out
