"""A small decoder-only transformer over bytes (vocab 256) or BPE tokens: the model the
reference loop trains.

Pre-norm blocks (RMSNorm → causal self-attention → RMSNorm → GELU MLP), learned positions, no
biases. Every weight except the norms' gains is a 2-D matrix, so IsoLoCo flattens all of them
(embeddings and the output head included); the gains and nothing else take the plain Nesterov step.

Three initialisations (`ModelConfig.init`, the CLI's --init):

    gpt2        (default) GPT-2 / Llama style: every matrix N(0, 0.02), the residual output
                projections (attention proj, MLP down) N(0, 0.02/sqrt(2·layers)); embeddings
                N(0, 0.02) too.
    torch       PyTorch's module defaults, a much larger scale: the token embedding N(0, 1), every
                nn.Linear Kaiming-uniform U(−1/sqrt(fan_in), 1/sqrt(fan_in)) (std 0.051 at d 128,
                0.026 for the 512-wide MLP down projection), no residual scaling; the learned
                position table N(0, 0.02), as a GPT-style model built from PyTorch modules draws it.
    torch-pos1  the same with the position table at nn.Embedding's own N(0, 1) (what `torch` was
                before; study v2's "torch" runs).

The init scale changes how far apart the workers' pseudo-gradients drift and how anisotropic
their spectra are, which is a first-order factor of the DiLoCo / IsoLoCo gap (study/README.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes: no tokenizer (the default vocabulary)
INITS = ("gpt2", "torch", "torch-pos1")


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    vocab: int = VOCAB
    init: str = "gpt2"

    def __post_init__(self):
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "mlp_ratio", "vocab"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model {name} must be a positive integer, got {v!r}")
        if self.init not in INITS:
            raise ValueError(f"model init must be one of {INITS}, got {self.init!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model d_model={self.d_model} must be divisible by n_heads={self.n_heads}")

    def as_dict(self) -> dict:
        return asdict(self)


# ~0.4M (CPU, the default), ~6M (a fast CPU or a small GPU), ~100M (GPU) parameters.
PRESETS = {
    "tiny": ModelConfig(d_model=128, n_layers=2, n_heads=4, seq_len=64),
    "tiny-wide": ModelConfig(d_model=256, n_layers=2, n_heads=4, seq_len=64),  # tiny with d ×2: ~4× the block weights
    "small": ModelConfig(d_model=256, n_layers=6, n_heads=8, seq_len=256),
    "base": ModelConfig(d_model=768, n_layers=14, n_heads=12, seq_len=512),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.norm1 = RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = RMSNorm(d)
        self.up = nn.Linear(d, cfg.mlp_ratio * d, bias=False)
        self.down = nn.Linear(cfg.mlp_ratio * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ByteLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.cfg.init == "torch-pos1":  # keep what the modules' own constructors drew
            return
        if self.cfg.init == "torch":  # the same, but a GPT-style position table
            nn.init.normal_(self.pos.weight, 0.0, 0.02)
            return
        # GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2·layers).
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = resid_std if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits [b, t, vocab] for token (byte) ids idx [b, t] (t ≤ seq_len)."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        x = self.tok(idx) + self.pos.weight[:t]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in nats/token (nats/byte at vocab 256)."""
        logits = self.forward(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
