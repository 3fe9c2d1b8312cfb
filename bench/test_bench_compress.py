"""The compressed exchange's two passes (isoloco_kernels.compress), per format, on flat fp32 tensors.

One case = (op, format, rounding, size, device). Ops:
  quantize   compress(Δ, e, spec): v = Δ + e, blockwise absmax scales, codes packed 8/bits per byte,
             e ← β·(v − c) (β 0.95, fp32 residual); its NaN/Inf check included (one host sync)
  unpack     decompress_add_(acc, payload): acc += level·s, an fp32 accumulator
Backends: the torch path on the CPU, the Triton kernels (triton/quant.py) on CUDA (`backend` in the
record). Compulsory bytes (the roofline is this alone: bytes / copy bandwidth, bench/harness.py):
  quantize   read Δ and e, write e (12 B per entry) + the payload (bits/8 per entry + 4 per block)
  unpack     read the payload, read and write acc (8 B per entry)
Each record also carries the payload's bytes against the same tensor in fp32 (`wire_ratio`; issue
46's targets: ≤ 0.27 at 8 bits, ≤ 0.14 at 4, ≤ 0.08 at 2) and the sent values' relative error.
The CPU runs 2^16 + 7 and 2^20 entries (2^22 with --bench-full); a GPU 2^20, 2^24 and 2^26;
--bench-dry-run the smallest of each.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench import harness
from isoloco_kernels import compress as C

FORMATS = tuple(C.FORMATS)
BLOCK, BETA = 128, 0.95
CPU_SIZES, CPU_FULL, GPU_SIZES = (2**16 + 7, 2**20), (2**22,), (2**20, 2**24, 2**26)
#: Largest relative error of the sent values per (bits, rounding) (measured on these data, block 128: int8 0.007,
#: fp8 0.026, int4 0.12, fp4 0.11, int2 0.77 — ternary, ~80 % of the entries sent as 0; stochastic ×1.3–1.5).
ERROR_SANITY = {(8, "nearest"): 0.05, (4, "nearest"): 0.2, (2, "nearest"): 0.9}
ERROR_SANITY.update({(b, "stochastic"): 1.6 * e for (b, _), e in list(ERROR_SANITY.items())})

_DATA: dict = {}


def _data(numel: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(Δ, e): Gaussian pseudo-gradient entries whose magnitude varies along the tensor, and a residual
    10× smaller (fp32), made once per (size, device)."""
    key = (numel, str(device))
    if key not in _DATA:
        _DATA.clear()
        g = torch.Generator().manual_seed(0)
        d = torch.randn(numel, generator=g) * torch.logspace(-4, -2, numel)
        _DATA[key] = (d.to(device), (0.1 * d * torch.randn(numel, generator=g)).to(device))
    return _DATA[key]


def _cases():
    out = []
    for device, sizes in (("cpu", CPU_SIZES + CPU_FULL), ("cuda", GPU_SIZES)):
        for n in sizes:
            marks = [pytest.mark.bench_full] if n in CPU_FULL and device == "cpu" else []
            for fmt in FORMATS:
                for op, rounding in (("quantize", "nearest"), ("quantize", "stochastic"), ("unpack", "nearest")):
                    out.append(
                        pytest.param(
                            op, fmt, rounding, n, device, marks=marks, id=f"{op}-{fmt}-{rounding}-{n}-{device}"
                        )
                    )
    return out


def _compulsory_bytes(op: str, spec: C.Compression, n: int) -> int:
    payload = C.bytes_of(spec, n)
    return 12 * n + payload if op == "quantize" else 8 * n + payload


@pytest.mark.parametrize("op,fmt,rounding,numel,device", _cases(), indirect=["device"])
def test_compress(benchmark, op, fmt, rounding, numel, device, bench_seconds, bench_dry, ceilings):
    if bench_dry and numel != min(CPU_SIZES if device.type == "cpu" else GPU_SIZES):
        pytest.skip("--bench-dry-run: the smallest size only")
    spec = C.Compression(fmt, BLOCK, rounding, ef_beta=BETA)
    d, e = _data(numel, device)
    payload, _ = C.compress(d, e, spec, step=1, tensor_id=0)
    acc = torch.zeros(numel, device=device)

    if op == "quantize":
        target = lambda: C.compress(d, e, spec, step=1, tensor_id=0)  # noqa: E731
    else:
        target = lambda: C.decompress_add_(acc, payload)  # noqa: E731
    benchmark.group = f"compress {op} {numel} {device.type}"
    harness.sync(device)
    t0 = time.perf_counter()
    target()  # untimed: compiles the kernels on a GPU, sets the rounds
    harness.sync(device)
    first_s = time.perf_counter() - t0
    median = harness.run_timed(
        benchmark, target, lambda: None, device=device, seconds=bench_seconds, first_s=first_s, may_compile=True
    )

    sent = C.dequantize(payload)
    v = d + e
    err = ((sent - v).norm() / v.norm()).item()
    nbytes = _compulsory_bytes(op, spec, numel)
    benchmark.extra_info.update(
        kind="compress",
        impl=f"{op} {fmt} {rounding}" if op == "quantize" else f"{op} {fmt}",
        set=f"flat {numel}",
        device=device.type,
        dtype="fp32",
        op=op,
        format=fmt,
        rounding=rounding,
        block=BLOCK,
        ef_beta=BETA,
        numel=numel,
        backend=C.backend_for(d)[0],
        bytes_moved=nbytes,
        wire_bytes=C.bytes_of(spec, numel),
        fp32_bytes=4 * numel,
        wire_ratio=C.bytes_of(spec, numel) / (4 * numel),
        exchange_ratio=C.exchange_bytes(spec, numel, 8) / C.allreduce_bytes(numel, 8),
        residual_bytes=C.residual_bytes(spec, numel, torch.float32),
        err_rel_fro=err,
        **harness.roofline_and_rates(median, None, nbytes, ceilings(device)),
    )
    assert err <= ERROR_SANITY[spec.bits, rounding], f"{fmt} {rounding}: relative error {err:.3g}"
