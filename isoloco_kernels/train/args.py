"""The command line of `python -m isoloco_kernels.train`: its flags and their parsers (cli.py runs it)."""

from __future__ import annotations

import argparse

from ..merges.options import MERGES
from .capture import SAVE_DTYPES
from .config import DEFAULT_MODES, INNERS, MODES, OUTER_DEFAULTS, OUTER_SCHEDULES, TrainConfig
from .dist import OUTER_PLACEMENTS
from .model import INITS, PRESETS
from .tokenizer import MAX_VOCAB

SWEEPABLE = {"workers": "workers", "inner-steps": "inner_steps", "rounds": "rounds", "batch": "batch"}


def _parse_modes(s: str) -> list[str]:
    if s == "all":
        return list(MODES)
    modes = [m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad or s!r}; choose from all, {', '.join(MODES)}")
    return list(dict.fromkeys(modes))


def _parse_sweep(s: str) -> tuple[str, list[int]]:
    name, sep, vals = s.partition("=")
    if not sep or name not in SWEEPABLE:
        raise argparse.ArgumentTypeError(
            f"--sweep takes NAME=V1,V2,... with NAME one of {sorted(SWEEPABLE)}, got {s!r}"
        )
    try:
        values = [int(v) for v in vals.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sweep {name}: values must be integers, got {vals!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--sweep {name}: values must be integers ≥ 1, got {vals!r}")
    return name, values


def _per_mode(flag: str, example: str):
    """A parser of '1.2' (every mode with an outer step) or 'diloco=0.5,isoloco=2.0'."""

    def parse(s: str) -> dict | float:
        try:
            if "=" not in s:
                return float(s)
            out = {}
            for part in s.split(","):
                mode, _, v = part.partition("=")
                out[mode.strip()] = float(v)
            return out
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes a number or MODE=VALUE,... (e.g. {example}), got {s!r}"
            ) from None

    return parse


_parse_outer_lr = _per_mode("--outer-lr", "diloco=0.7,isoloco=1.8")
_parse_outer_momentum = _per_mode("--outer-momentum", "diloco=0.5,isoloco=0.8")


def _parse_vocab(s: str) -> int:
    if s == "bytes":
        return 256
    try:
        v = int(s)
    except ValueError:
        v = None
    if v is None or not 256 <= v <= MAX_VOCAB:
        raise argparse.ArgumentTypeError(f"--vocab takes bytes, 256 or an integer in 257..{MAX_VOCAB} (BPE), got {s!r}")
    return v


def _parse_lr_momentum(s: str) -> tuple[float, float]:
    try:
        lr, mom = (float(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes LR,MOMENTUM (e.g. 0.35,0.9), got {s!r}") from None
    return lr, mom


def _parse_clip(text: str) -> str | float:
    if text == "median":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'median' or a number, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m isoloco_kernels.train",
        description="Compare DDP, DiLoCo and IsoLoCo on a byte-level LM (same init, data and tokens).",
    )
    p.add_argument(
        "--mode",
        type=_parse_modes,
        default=list(DEFAULT_MODES),
        help=f"a comma list of {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)}), or all",
    )
    p.add_argument(
        "--model", choices=sorted(PRESETS), default=d.model, help="tiny ~0.5M params (CPU), small ~5M, base ~100M (GPU)"
    )
    p.add_argument(
        "--workers",
        "-K",
        type=int,
        default=d.workers,
        help="K workers (default %(default)s; under torchrun one worker per rank: omit it or pass the world size)",
    )
    p.add_argument("--inner-steps", "-H", type=int, default=d.inner_steps, help="H inner steps per round")
    p.add_argument("--rounds", "-R", type=int, default=d.rounds, help="outer steps (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per worker per inner step")
    p.add_argument("--seq-len", type=int, default=None, help="bytes per sequence (default: the model's)")
    p.add_argument("--tie-embeddings", action="store_true", help="share input embedding and output head")
    p.add_argument(
        "--vocab",
        type=_parse_vocab,
        default=d.vocab,
        help="bytes/256 (default): byte-level; N > 256: a BPE vocabulary of N tokens (HF tokenizers) "
        "trained on the training split at first use and cached in --out; held-out loss "
        "stays in nats/byte",
    )
    p.add_argument(
        "--init",
        choices=INITS,
        default=d.init,
        help="gpt2 (default): every matrix N(0, 0.02), residual projections /sqrt(2·layers); "
        "torch: PyTorch's module defaults (token embedding N(0, 1), Kaiming-uniform linears) "
        "with the position table N(0, 0.02); torch-pos1: the same with positions N(0, 1)",
    )
    p.add_argument(
        "--inner",
        choices=INNERS,
        default=d.inner,
        help="inner optimizer: adamw (default), or muon: torch.optim.Muon on the blocks' matrices "
        "(lr scaled to AdamW's update RMS), AdamW on embeddings, head and norms (MuLoCo)",
    )
    p.add_argument("--inner-lr", type=float, default=d.inner_lr, help="inner peak lr (AdamW's, and Muon's)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="inner warmup steps")
    per_mode = (  # flag, parser, what it sets, its index in OUTER_DEFAULTS' (lr, μ)
        ("--outer-lr", _parse_outer_lr, "outer lr for every outer mode, or MODE=LR,...", 0),
        ("--outer-momentum", _parse_outer_momentum, "outer Nesterov momentum, or MODE=MU,... (0 ≤ μ < 1)", 1),
    )
    for flag, parse, what, i in per_mode:
        defaults = ", ".join(f"{m} {v[i]}" for m, v in OUTER_DEFAULTS.items())
        p.add_argument(flag, type=parse, default=None, help=f"{what}; defaults {defaults}")
    p.add_argument("--iso-method", default=d.iso_method, help="IsoLoCo flatten method (auto, svd, eigh, polar, ...)")
    p.add_argument(
        "--merge",
        default=d.merge,
        choices=tuple(MERGES),
        help="how the Iso-C modes (isoloco: Nesterov outer, isoloco-sgd: SGD outer) merge the K workers' "
        "deltas (default %(default)s; docs/merges.md); ddp, diloco and avg do not merge (refused with none of "
        "the Iso-C modes)",
    )
    p.add_argument(
        "--compress",
        default=None,
        metavar="SPEC",
        help="compress every outer mode's exchange: format[:block[:beta[:rounding[:feedback]]]], e.g. "
        "int4:128:0.95 (int8, fp8, int4, fp4, int2; beta none: no error feedback; feedback workers (the "
        "default: each worker's Δ only), both or owner: where error feedback runs, e.g. "
        "int2:128:0.95:nearest:both; docs/compression.md); under "
        "torchrun it needs --outer sharded",
    )
    p.add_argument(
        "--drop",
        type=float,
        default=d.drop,
        metavar="FRACTION",
        help="the fraction of the K workers that miss each outer round, drawn anew each round from the seed: they "
        "do not train and the merge weighs them 0 (one process only; default %(default)s)",
    )
    p.add_argument(
        "--faulty",
        type=float,
        default=d.faulty,
        metavar="FACTOR",
        help="multiply worker 0's Δ by this every round: a faulty worker (default %(default)s: none)",
    )
    p.add_argument(
        "--merge-clip",
        type=_parse_clip,
        default=None,
        metavar="median|CAP",
        help="clip each worker's Δ per tensor before the merge: to the median of the delivering workers' norms, "
        "or to a number (docs/merges.md)",
    )
    p.add_argument(
        "--iso-skip",
        default="",
        metavar="PREFIXES",
        help="comma list of parameter-name prefixes kept out of Iso-C in the Iso-C modes, e.g. "
        "tok.,head. (the embedding and head take the outer step unflattened)",
    )
    p.add_argument(
        "--iso-skip-outer",
        type=_parse_lr_momentum,
        default=None,
        metavar="LR,MOMENTUM",
        help="the outer lr and momentum of the --iso-skip matrices (default: the mode's)",
    )
    p.add_argument("--data", default=None, help="a text file or folder (default: Python's stdlib source)")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="read at most this much text")
    p.add_argument(
        "--eval-windows",
        type=int,
        default=d.eval_windows,
        help="held-out windows in each split (default %(default)s): the selection split (first half "
        "of the held-out text, to pick settings on) and the test split (second half, to report)",
    )
    p.add_argument(
        "--sweep", type=_parse_sweep, default=None, help="NAME=V1,V2,... e.g. workers=2,4,8,16 or inner-steps=30,100"
    )
    p.add_argument(
        "--outer-schedule",
        default=d.outer_schedule,
        choices=OUTER_SCHEDULES,
        help="the outer lr or momentum over the rounds (default %(default)s): warmup = linear over the first "
        "5%% of rounds; warmup-cosine = that, then cosine to 0.1x; momentum-warmup = μ linear from 0 over 5%%",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="fixes the global init and every worker's data order, the same for every mode (default %(default)s)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default="runs/latest", help="folder for results.json and loss.png")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--save-pseudo-gradients",
        metavar="DIR",
        default=None,
        help="save the averaged pseudo-gradient Δ of the rounds --save-rounds picks, one .pt per "
        "round under DIR/<mode>/ (capture.py)",
    )
    p.add_argument(
        "--save-rounds",
        default="first,mid,last",
        help="rounds to save: all, or a comma list of numbers/first/mid/last (default %(default)s)",
    )
    p.add_argument(
        "--save-dtype",
        choices=sorted(SAVE_DTYPES),
        default="float32",
        help="dtype of the saved Δ (default %(default)s)",
    )
    p.add_argument(
        "--no-divergence",
        action="store_true",
        help="skip the per-round divergence and spectrum measurements (results.json 'divergence')",
    )
    p.add_argument(
        "--outer",
        choices=OUTER_PLACEMENTS,
        default="replicated",
        help="under torchrun: the outer step on every rank (replicated, default) or each "
        "tensor's on one owner rank (sharded: ShardedIsoLoCo)",
    )
    return p
