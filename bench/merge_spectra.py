"""The picture in docs/merges.md: what each merge does to the spectrum of K workers' deltas.

K = 4 synthetic worker deltas of one 128×256 matrix, Δ_i = C + E_i: a common part C with a
power-law spectrum (σ_j ∝ j^-1.5) and each worker's own part E_i (the same law, other directions,
half its norm) — the shape DiLoCo's pseudo-gradients take when workers agree on a few directions
and differ on the rest. Plots σ_j / σ_1 of every merge's result.

    python -m bench.merge_spectra [--out docs/merges_spectra.png]
"""

from __future__ import annotations

import argparse

import torch

import isoloco_kernels as ik


def worker_deltas(K: int = 4, m: int = 128, n: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = min(m, n)
    law = torch.arange(1, r + 1, dtype=torch.float64) ** -1.5

    def part(scale: float) -> torch.Tensor:
        u, _ = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))
        return scale * (u * law) @ v.mT

    common = part(1.0)
    return torch.stack([common + part(0.5) for _ in range(K)]).float()


def spectra(x: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for method in ik.merges.MERGES:
        s = torch.linalg.svdvals(ik.merge([x], method)[0].double())
        out[method] = s / s[0]
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/merges_spectra.png")
    a = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method, s in spectra(worker_deltas()).items():
        ax.semilogy(range(1, len(s) + 1), s.clamp_min(1e-8), label=method, lw=1.6)
    ax.set_xlabel("singular direction j")
    ax.set_ylabel("σ_j / σ_1 of the merged Δ")
    ax.set_title(
        "K = 4 workers' deltas (128×256): the mean and the five merges (iso_c, iso_cts: flat at 1)", fontsize=9
    )
    ax.set_ylim(1e-4, 2)
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
