"""Short probes of bench/device_check.sh: a few shapes timed side by side, one line each, on the GPU (or, with
--dry-run, tiny shapes on the CPU, so the script is known to run before a GPU minute is spent on it).

    python bench/probes.py sym-routes [--dry-run]   # one-triangle X·Xᵀ (triton/sym_gram.py) vs torch's GEMM;
                                                     # fast's routes: direct (torch / one-triangle products), Gram
    python bench/probes.py gram-polar [--dry-run]   # gram vs polar per shape at cond 1e4, and auto's choice

With --dry-run the Triton parts run where Triton can (TRITON_INTERPRET=1 on the CPU) and say so where it cannot.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch


def _device(dry: bool) -> tuple[torch.device, callable]:
    dev = torch.device("cpu" if dry else "cuda")
    return dev, (lambda: None) if dry else torch.cuda.synchronize


def timed(f, sync, n: int = 3, reset=None) -> float:
    """The fastest of n timed calls of f, after one warm-up call; reset() (untimed) before each."""
    best = float("inf")
    for i in range(n + 1):
        if reset is not None:
            reset()
        sync()
        t0 = time.perf_counter()
        f()
        sync()
        if i:  # call 0 warms up
            best = min(best, time.perf_counter() - t0)
    return best


def sym_routes(dry: bool) -> list[str]:
    from isoloco_kernels import triton as tk
    from isoloco_kernels.flatten import fast

    dev, sync = _device(dry)
    lines = []
    triton_ok = tk.usable_for(torch.empty(1, device=dev))
    if triton_ok:
        from isoloco_kernels.triton.sym_gram import sym_gram

        shapes = [(2, 24, 80)] if dry else [(48, 2048, 8192), (64, 2048, 2048), (2, 2048, 128256)]
        for shape in shapes:
            for dt, prec in [(torch.bfloat16, "ieee"), (torch.float32, "tf32x3")]:
                x = torch.randn(shape, device=dev).to(dt)
                full = timed(lambda: torch.matmul(x, x.mT), sync)
                tri = timed(lambda: sym_gram(x, precision=prec), sync)
                ref = x.float() @ x.float().mT
                err = float((sym_gram(x, precision=prec) - ref).norm() / ref.norm())
                lines.append(
                    f"X·Xᵀ {shape} {dt} {prec}: torch {full * 1e3:.2f} ms, one-triangle {tri * 1e3:.2f} ms "
                    f"({full / tri:.2f}×), rel. diff {err:.1e}"
                )
    else:
        lines.append(f"X·Xᵀ: Triton cannot run on {dev.type} tensors here (set TRITON_INTERPRET=1 for the CPU)")
    variants = [("direct", "torch"), ("direct", "triton"), ("gram", "torch")]
    shapes = [(2, 32, 512)] if dry else [(8, 2048, 8192), (2, 2048, 128256), (8, 2048, 2048)]
    for shape in shapes:
        x = torch.randn(shape, device=dev)
        y = torch.empty_like(x)
        row = {
            (r, s): timed(lambda r=r, s=s: fast.flatten_fast_(y, route=r, sym=s), sync, 2, reset=lambda: y.copy_(x))
            for r, s in variants
            if s == "torch" or triton_ok
        }
        cells = ", ".join(f"{r} ({s} products) {t * 1e3:.1f} ms" for (r, s), t in row.items())
        lines.append(f"fast {shape}: {cells}; route_for picks {fast.route_for(*shape[1:], fast.device_kind(x))}")
    return lines


def gram_polar(dry: bool) -> list[str]:
    import isoloco_kernels as ik
    from isoloco_kernels.flatten import registry as flatten
    from isoloco_kernels.reference import iso_flatten_ref

    dev, sync = _device(dry)
    lines = []
    if dev.type == "cuda":
        lines.append(
            f"compute capability {torch.cuda.get_device_capability(dev)} | float64 rate auto assumes: "
            f"{flatten._fp64_rate(dev)}"
        )
    shapes = (
        [(2, 64, 64), (2, 32, 256)] if dry else [(8, 1024, 1024), (4, 1024, 4096), (2, 2048, 32000), (16, 256, 256)]
    )
    for b, m, n in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        u, _ = torch.linalg.qr(torch.randn(b, m, m, device=dev, generator=g))
        v, _ = torch.linalg.qr(torch.randn(b, n, m, device=dev, generator=g))
        x = (u * torch.logspace(0, -4, m, device=dev)) @ v.mT  # cond 1e4
        ref = iso_flatten_ref(x[:1])
        row = []
        for meth in ("polar", "gram"):
            y = x.clone()
            ik.iso_merge_([y], method=meth)
            err = float((y[:1].double().cpu() - ref).norm() / ref.norm())
            t = timed(lambda meth=meth: ik.iso_merge_([y], method=meth), sync, 5, reset=lambda: y.copy_(x))
            row.append(f"{meth} {t * 1e3:.2f} ms err {err:.1e}")
        lines.append(f"{(b, m, n)} " + " | ".join(row) + f" | auto -> {flatten.resolve_method('auto', x)}")
    return lines


PROBES = {"sym-routes": sym_routes, "gram-polar": gram_polar}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("probe", choices=sorted(PROBES))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    for line in PROBES[args.probe](args.dry_run):
        print(line, flush=True)


if __name__ == "__main__":
    main()
