"""Bucket sets shaped like real models: the one place the benchmark's workloads are defined.

IsoLoCo flattens every 2-D weight of the model, so a workload is the list of a decoder
transformer's 2-D weights, grouped by shape into [B, m, n] buckets. Iso-C commutes with transposition
(iso(Δᵀ) = iso(Δ)ᵀ), so a weight and its transposed twin (gate/up are ffn×h, down is h×ffn) share
one bucket, stored tall (m ≥ n).

Layout (nn.Linear weights are [out, in]), per decoder layer:
    q, k, v, o     hidden × hidden
    gate, up       ffn × hidden
    down           hidden × ffn
plus the token embedding and the (untied) lm_head, vocab × hidden each, and — for the optimizer
benchmarks only — the 1-D RMSNorm weights (two per layer and a final one), which IsoLoCo leaves
unflattened.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch

__all__ = [
    "ModelSpec",
    "SETS",
    "decoder_weight_shapes",
    "decoder_param_shapes",
    "bucket_shapes",
    "cpu_variant",
    "pseudo_gradient",
]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab: int
    hidden: int
    layers: int
    ffn: int
    embeddings: bool = True  # include the vocab × hidden embedding and lm_head
    note: str = ""  # how this spec differs from the model it is named after

    @property
    def n_params(self) -> int:
        return sum(m * n for _, (m, n) in decoder_weight_shapes(self)) + sum(
            s[0] for _, s in decoder_param_shapes(self) if len(s) == 1
        )


def decoder_weight_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, int]]]:
    """(name, (out, in)) for every 2-D weight of a llama-style decoder, in model order."""
    h, f = spec.hidden, spec.ffn
    out: list[tuple[str, tuple[int, int]]] = []
    if spec.embeddings:
        out.append(("embed", (spec.vocab, h)))
    for i in range(spec.layers):
        for proj in ("q", "k", "v", "o"):
            out.append((f"layers.{i}.{proj}", (h, h)))
        out.append((f"layers.{i}.gate", (f, h)))
        out.append((f"layers.{i}.up", (f, h)))
        out.append((f"layers.{i}.down", (h, f)))
    if spec.embeddings:
        out.append(("lm_head", (spec.vocab, h)))
    return out


def decoder_param_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter: the 2-D weights plus the 1-D RMSNorm weights (what an optimizer steps)."""
    out: list[tuple[str, tuple[int, ...]]] = list(decoder_weight_shapes(spec))
    for i in range(spec.layers):
        out.append((f"layers.{i}.attn_norm", (spec.hidden,)))
        out.append((f"layers.{i}.mlp_norm", (spec.hidden,)))
    out.append(("norm", (spec.hidden,)))
    return out


def bucket_shapes(shapes) -> list[tuple[int, int, int]]:
    """[(B, m, n)] with m ≥ n: matrices grouped by shape, transposed twins together; largest first."""
    count = Counter((max(s), min(s)) for s in shapes)
    return sorted(((b, m, n) for (m, n), b in count.items()), key=lambda t: -t[0] * t[1] * t[2])


# The model sizes every benchmark runs over. "ref-tiny" is the size of the reference training
# loop's byte-level CPU model; "wide-vocab" is synthetic (see its note); the llama-* sets follow the published configs' hidden / layers / ffn /
# vocab, with full-size k and v (no grouped-query attention) and untied embeddings.
SETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("ref-tiny", vocab=256, hidden=128, layers=4, ffn=512),
        ModelSpec("llama-tiny", vocab=4096, hidden=256, layers=4, ffn=688),
        ModelSpec("llama-178m", vocab=32000, hidden=1024, layers=9, ffn=2688),
        ModelSpec("llama-1b", vocab=128256, hidden=2048, layers=16, ffn=8192),
        # Llama-3-8B's hidden / layers / ffn / vocab, with full-size k and v (the model's grouped
        # k/v are 1024 × 4096): 30 GB of fp32 2-D grads, for the memory peaks (bench/memory_model.py,
        # bench/memory_peaks.py), too large to time every method within a GPU run's budget.
        ModelSpec("llama-8b", vocab=128256, hidden=4096, layers=32, ffn=14336, note="full-size k/v"),
        # Embedding-dominated: a large vocabulary over a small hidden size, so most elements sit in
        # 32000 × 256 buckets (aspect 125): the wide case the Gram-space flatten is for.
        ModelSpec(
            "wide-vocab",
            vocab=32000,
            hidden=256,
            layers=1,
            ffn=1024,
            note="synthetic: large vocabulary, small hidden size (wide buckets)",
        ),
        # The smallest, for --bench-dry-run only (bench/conftest.py: no other mode runs it unless
        # --bench-sets names it): every case once in seconds, to check that it runs and reports.
        ModelSpec("dry-tiny", vocab=96, hidden=32, layers=1, ffn=64, note="--bench-dry-run's: a check, not a model"),
    )
}

# On a 2-core CPU an exact flatten of llama-178m takes ~45 s per call and llama-1b minutes, so the
# CPU runs the first two sets as they are, llama-178m cut to one decoder layer without the vocab
# matrices (every bucket shape but the 32000 × 1024 one, one layer's worth of matrices), and skips
# llama-1b.
_CPU_MAX_PARAMS = 20_000_000
_CPU_SKIP = {"llama-1b", "llama-8b"}


def cpu_variant(spec: ModelSpec) -> ModelSpec | None:
    """The spec the CPU runs in place of `spec` (itself, a scaled copy, or None = skipped)."""
    if spec.name in _CPU_SKIP:
        return None
    if spec.n_params <= _CPU_MAX_PARAMS:
        return spec
    return replace(
        spec,
        layers=1,
        embeddings=False,
        note=f"scaled for CPU: 1 of {spec.layers} layers, no embedding/lm_head",
    )


def pseudo_gradient(b: int, m: int, n: int, *, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """A [b, m, n] stand-in for a DiLoCo pseudo-gradient: U · diag(σ) · Vᵀ, σ_j = 1e-3 / (1 + j).

    U, V are Haar-random (QR of Gaussians), so the spectrum is exactly the power law: condition
    number min(m, n) (128 … 2048 here, inside the polar method's 1e4 contract), magnitude ~1e-3
    like an outer-step delta, no accidental near-singular matrix (a square Gaussian has one now and
    then). Generated on `device` in float32 with a seeded generator, then cast to `dtype`.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    r = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(b, m, r, generator=gen, device=device))
    v, _ = torch.linalg.qr(torch.randn(b, n, r, generator=gen, device=device))
    sigma = 1e-3 / (1.0 + torch.arange(r, device=device, dtype=torch.float32))
    u *= sigma
    return torch.matmul(u, v.mT).to(dtype)
