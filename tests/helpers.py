"""Shared test helpers: the one tolerance table, the error measure, and input generators (random
matrices, named spectra, pseudo-gradients from the reference loop and the committed captures)."""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch


@contextlib.contextmanager
def torch_settings_restored():
    """Put back the process-wide settings `isoloco_kernels.train.cli.main` sets for its run (torch's
    thread count from --threads, deterministic algorithms, $CUBLAS_WORKSPACE_CONFIG on CUDA): a test
    that calls main in this process must not change the numbers of the tests after it (a training run
    on 1 thread instead of the default gives other bytes: tests/package/test_pinned.py)."""
    threads = torch.get_num_threads()
    det, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_COLUMNS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

# Relative Frobenius error allowed vs reference.py (float64): one row per key, one column per input
# dtype (None: not defined). A flatten method's row has its name in isoloco_kernels.flatten.METHODS
# (tests/flatten/test_methods.py runs every method's contract against its row); "exact" serves tests of
# exact results in general. Half/bfloat16 results are rounded to the input dtype, which alone costs
# ~2^-11 / 2^-8 per element.
_EXACT = (1e-9, 2e-5, 2e-3, 1e-2)
TOL_ROWS = {
    #              float64  float32  float16  bfloat16
    "exact": _EXACT,
    # svd: float64 SVD of the input's values, the result rounded to the input dtype: for float32 that
    # rounding bounds the error (≤ 2^-24 per element; measured 2.5e-8 … 5.6e-8), so 1e-7 fails an
    # SVD computed in float32 (measured 2.8e-7 … 5.3e-7 already on small Gaussian matrices).
    "svd": (1e-9, 1e-7, 2e-3, 1e-2),
    # eigh: float64 eigh of the short-side Gram matrix, which holds σ² to eps64·κ² (PER_COND2; measured
    # 1.3·eps64·κ², 2.3e-6 at κ 9e4, the most it serves in float32) plus the rounding of the result.
    "eigh": (1e-9, 1e-7, 2e-3, 1e-2),
    # polar: float32 by its contract (≤ 1e-3 at κ ≤ 1e4, README). float64 iterates in float64, so
    # only the schedule's own error remains: |1 − σ| ≤ 4.3e-12 after 10 steps on [ELL, 1]
    # (COEFFS), ≤ 2× that through s̄; measured ≤ 6.4e-12 at κ ≤ 2e4 on every spectrum and both
    # OpenBLAS kernels. Float32 GEMMs in a float64 run give ≥ 1e-7. Beyond the schedule's range
    # (κ ≳ 4e4) the float64-sized residual check (polar.CHECK_TOL_F64) hands the matrix to the SVD.
    "polar": (3e-11, 1e-3, 3e-3, 1.2e-2),
    # polar_bf16 on well-conditioned inputs (cond ≤ 1e2); it is not accurate beyond (polar.py).
    "polar_bf16": (4e-2, 4e-2, 4e-2, 4e-2),
    # polar_tf32x3: polar's contract (float32 products to ~2^-21 through three TF32 GEMMs: measured
    # 3e-6…2e-4 at κ ≤ 1e4 on the CPU emulation); float64 input runs in float64, as polar.
    "polar_tf32x3": (3e-11, 1e-3, 3e-3, 1.2e-2),
    # fast (training grade, fast.py): its contract is a flat spectrum (FLATNESS) and this error
    # at condition number ≤ 1e2, then COND_BANDS; bfloat16 GEMMs after float32-accurate steps
    # (measured 0.008–0.035 at κ ≤ 1e3 and on the captured pseudo-gradients).
    "fast": (5e-2, 5e-2, 5e-2, 5e-2),
    # gram (float64 Gram-space iteration): the result rounded to the input dtype (float32: ~2.5e-8
    # measured, ×8 margin) plus the Gram matrix's conditioning: A₀ = X Xᵀ holds the small σ² to
    # eps64·κ² relative, so the error grows as κ² (PER_COND2; measured at κ 1e5, flat tails:
    # 3.5e-7…1.1e-6 for float32 input, 2.5e-7…8.4e-7 for float64 input; 8× below the allowance).
    # Targets for float32 ≤ 1e-6 at κ ≤ 1e4 and ≤ 1e-5 at κ 1e5 are met by `method_tol`.
    "gram": (1e-11, 2e-7, 2e-3, 1e-2),
    # merges (isoloco_kernels/merges) vs merges/reference.py: mean, ties, dare are sums of K pruned
    # deltas in the compute dtype (float32 for half input) rounded to the input dtype; the spectral
    # ones (iso_c, tsv, iso_cts) add the subspaces' conditioning: + MERGE_PER_GAP·eps·σ_1/gap
    # (`merge_tol`), the gap at each truncation (a worker's k-th, the mean's common cut).
    "merge_sparse": (1e-12, 1e-6, 2e-3, 1e-2),
    "merge_spectral": (1e-10, 1e-5, 2e-3, 1e-2),
    "update": (1e-12, 1e-6, 2e-3, 1e-2),
    # iso_scale_ (⟨x, q⟩ accumulated in float32, float64 for float64 x; x rounded to its dtype).
    "iso_scale": (1e-12, 1e-5, 2e-3, 1e-2),
    # Held-out loss of a torchrun run (one worker per rank) vs the single-process simulation: the
    # same float32 math with the pseudo-gradient sums taken in another order (~1 ulp per round;
    # measured ≤ 1e-7 after 2 rounds of the tiny model). A wrong shard or average moves it ≥ 1e-3.
    "train_dist": (None, 1e-5, None, None),
}
# × eps(compute dtype) × σ_1/gap, added to "merge_spectral" (merge_tol).
MERGE_PER_GAP = 16.0
# Added to a method's row, × κ² (κ the input's condition number): methods whose error grows so.
PER_COND2 = {"gram": 4 * 2.0**-52, "eigh": 4 * 2.0**-52}
# A method's allowance by condition number band, replacing its row beyond κ 1e2: (κ up to, error).
# fast: 0.15 up to κ 1e3, then 0.3 (what training tolerates: the captured pseudo-gradients reach
# κ ~1e5; a pilot trained as well as the exact flatten with ~0.25 there).
COND_BANDS = {"fast": ((1e3, 0.15), (float("inf"), 0.3))}
# Largest |σ_i(out) / s̄ − 1| over the directions outside reference.py's rank cut, per method that
# promises a flat spectrum rather than a small error (exact methods: their error bounds it).
FLATNESS = {"fast": 0.1, "polar_bf16": 0.1}


class _Table(Mapping):
    """TOL[(key, dtype)]: the entry of TOL_ROWS (read at each lookup)."""

    def __getitem__(self, key):
        row, dtype = key
        value = TOL_ROWS[row][_COLUMNS.index(dtype)]
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self):
        return iter([(r, d) for r, vals in TOL_ROWS.items() for d, v in zip(_COLUMNS, vals) if v is not None])

    def __len__(self):
        return sum(1 for _ in self)


TOL = _Table()


def method_tol(method: str, dtype: torch.dtype, cond: float = 1.0) -> float:
    """Allowed relative error of flatten method `method` on `dtype` input of condition number `cond`."""
    base = TOL[(method, dtype)]
    if cond > 1e2:
        for upto, tol in COND_BANDS.get(method, ()):
            if cond <= upto:
                base = max(base, tol)
                break
    return base + PER_COND2.get(method, 0.0) * cond**2


def flatness(out: torch.Tensor, x: torch.Tensor) -> float:
    """The largest |σ_i(out) / s̄ − 1| over the singular directions of x outside reference.py's
    rank cut (s̄ = mean of x's singular values, all r0 of them), worst matrix of the batch; and 0
    when every direction is cut. Also checks that out has no singular value above the cut where
    x has none: a filled null space counts as a deviation of σ(out) / s̄ there."""
    from isoloco_kernels.reference import rank_tol

    x64 = x.detach().to("cpu", torch.float64)
    x64 = x64 if x64.ndim == 3 else x64.unsqueeze(0)
    o64 = out.detach().to("cpu", torch.float64).reshape(x64.shape)
    m, n = x64.shape[-2:]
    sx = torch.linalg.svdvals(x64)
    so = torch.linalg.svdvals(o64)
    keep = sx > rank_tol(m, n, x.dtype) * sx[..., :1]
    sbar = (sx.sum(-1, keepdim=True) / min(m, n)).clamp_min(torch.finfo(torch.float64).tiny)
    dev = torch.where(keep, (so / sbar - 1).abs(), so / sbar)  # cut directions must stay ~0
    return float(dev.max()) if dev.numel() else 0.0


def gram_tol(dtype: torch.dtype, cond: float) -> float:
    """Allowed relative error of method="gram" at condition number `cond` (see the TOL rows)."""
    return method_tol("gram", dtype, cond)


def merge_tol(method: str, dtype: torch.dtype, gap_cond: float = 1.0) -> float:
    """The allowed error of merge `method` on input of `dtype` (gap_cond: σ_1/gap, spectral merges)."""
    if method in ("mean", "ties", "dare"):
        return TOL[("merge_sparse", dtype)]
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    return TOL[("merge_spectral", dtype)] + MERGE_PER_GAP * eps * gap_cond


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    den = ref64.norm().item()
    num = (out64 - ref64).norm().item()
    return num if den == 0 else num / den


def with_spectrum(b: int, m: int, n: int, sigma: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[b, m, n] float64 matrices U diag(sigma) Vᵀ with Haar-random U, V (sigma has min(m, n) entries)."""
    r = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(b, m, r, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(b, n, r, generator=gen, dtype=torch.float64))
    return (u * sigma.to(torch.float64)) @ v.mT


def spectrum(kind: str, r: int, cond: float = 1e3) -> torch.Tensor:
    """Singular values (descending, σ_1 = 1) of a named test spectrum."""
    i = torch.arange(r, dtype=torch.float64)
    if kind == "geometric":
        return cond ** (-i / max(r - 1, 1))
    if kind == "lowrank_noise":  # a few strong directions over a noise floor 1/cond
        k = max(1, r // 16)
        s = torch.full((r,), 1.0 / cond, dtype=torch.float64)
        s[:k] = torch.linspace(1.0, 0.3, k, dtype=torch.float64)
        return s
    if kind == "flat":
        return torch.ones(r, dtype=torch.float64)
    raise ValueError(kind)


def flat_tail(r: int, cond: float) -> torch.Tensor:
    """A few strong directions (1 … 0.3), the rest flat at 1/cond: many directions at the bottom."""
    return spectrum("lowrank_noise", r, cond)


def gen(key) -> torch.Generator:
    """A generator seeded from any repr-able key (a test's own, so cases do not share draws)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def randn(shape, dtype: torch.dtype, key) -> torch.Tensor:
    """Gaussian entries drawn in float64 from `gen(key)`, rounded to `dtype`."""
    return torch.randn(shape, generator=gen(key), dtype=torch.float64).to(dtype)


def cond(x: torch.Tensor) -> float:
    """The largest condition number σ_1 / σ_min over the matrices of x (float64)."""
    s = torch.linalg.svdvals(x.detach().to(torch.float64))
    return float(s[..., 0].max() / s[..., -1].min())


def loop_pseudo_gradients() -> list[tuple[str, torch.Tensor]]:
    """(name, Δ) of every 2-D pseudo-gradient of a few seconds of the reference loop (tiny model,
    2 workers, 10 inner steps, 2 rounds; float32)."""
    from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode

    cfg = TrainConfig(
        model="tiny",
        workers=2,
        inner_steps=10,
        rounds=2,
        batch=2,
        seq_len=32,
        warmup=2,
        eval_windows=4,
        divergence=False,
        seed=0,
        iso_method="svd",
    )
    got = []

    def capture(r, names, deltas):
        got.extend((f"round {r} {n}", d.detach().clone()) for n, d in zip(names, deltas) if d.ndim == 2)

    run_mode("isoloco", Setup(cfg, load_corpus(max_bytes=60_000)), capture=capture)
    return got


def captured_pseudo_gradients() -> list[tuple[str, torch.Tensor]]:
    """(file: name, Δ) of every 2-D pseudo-gradient committed under bench/data/captured (the
    reference loop at K 4, H 30, saved in float16; bench/results/captured.md), as float32."""
    files = sorted((Path(__file__).resolve().parents[1] / "bench" / "data" / "captured").glob("*/*/round_*.pt"))
    assert files, "bench/data/captured holds no round_*.pt"
    out = []
    for f in files:
        for name, d in torch.load(f, weights_only=False)["delta"].items():
            if d.ndim == 2:
                out.append((f"{f.name}: {name}", d.to(torch.float32)))
    return out


def reset_tf32() -> None:
    """Every TF32 setting back to torch's defaults (both APIs: torch ≥ 2.9's fp32_precision and the legacy flags)."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.fp32_precision = "none"
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.backends.mkldnn.matmul.fp32_precision = "none"
    else:
        torch.set_float32_matmul_precision("highest")


def rerun_under_interpreter(test_file: str, min_passed: int, timeout: int = 900) -> None:
    """Run `test_file` again in a fresh Python with TRITON_INTERPRET=1 (Triton reads it at import,
    so the kernels are built for its interpreter and take CPU tensors); fail unless it passed with at
    least `min_passed` tests (the kernel tests really ran) and none failed."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(test_file)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed, tail
    assert "failed" not in proc.stdout.splitlines()[-1], tail


def seeded(shapes, seed: int, dtype=torch.float32, k: Optional[int] = None) -> list:
    """One N(0, 1) tensor per shape from a generator seeded `seed` (with k: a [k, *shape] stack of k workers' deltas),
    cast to dtype: the params and pseudo-gradients the multi-rank tests share between ranks and one process."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((*(() if k is None else (k,)), *s), generator=g).to(dtype) for s in shapes]


def step_as_rank(opt, params, stacks, rank: int) -> None:
    """One outer step of this rank: p.grad ← its slice of each [K, *shape] stack, then opt.step()."""
    for p, d in zip(params, stacks):
        p.grad = d[rank].clone()
    opt.step()


def step_with_one_process(
    ps, ref, rank: int, stacks_of, spec, merge: str, steps: int = 3, names: Optional[list] = None, **sharded_kw
):
    """ShardedIsoLoCo on this rank's params ps and the one-process simulation (MergeLoCo fed every worker's Δ)
    on ref, an equal copy, both at lr 0.9 and momentum 0.6 with compression `spec` and `merge` (given `names`,
    as named params; sharded_kw: the sharded optimizer's own settings): `steps` outer steps of each (this
    rank's by step_as_rank) on the same stacks, stacks_of(step) for step 0, 1, …, after which every param must
    be torch.equal — the sharded route is the simulation, bit for bit. Returns (opt, one) for the state each
    caller compares."""
    from isoloco_kernels import MergeLoCo, ShardedIsoLoCo

    def named(t):
        return t if names is None else list(zip(names, t))

    opt = ShardedIsoLoCo(named(ps), lr=0.9, momentum=0.6, compress=spec, merge=merge, **sharded_kw)
    one = MergeLoCo(named(ref), lr=0.9, momentum=0.6, compress=spec, merge=merge)
    for step in range(steps):
        stacks = stacks_of(step)
        step_as_rank(opt, ps, stacks, rank)
        one.step(deltas=stacks)
    for i, (p, q) in enumerate(zip(ps, ref)):
        assert torch.equal(p, q), f"{spec} {merge} {p.dtype}: param {i} differs from the one-process simulation"
    return opt, one


class CheckReads:
    """Elements the finiteness checks read (their one pass, `_validate._amax_pass`) while active."""

    def __init__(self, monkeypatch):
        from isoloco_kernels import _validate

        self.elements = 0
        real = _validate._amax_pass

        def counting(tensors):
            self.elements += sum(t.numel() for t in tensors)
            return real(tensors)

        monkeypatch.setattr(_validate, "_amax_pass", counting)


# -- small optimizer fixtures shared by the optimizer and state tests ------------------------------------


def three_params(dtype=torch.float32, key="contracts"):
    """A 7×5 matrix, a 4-vector and a 3×6 matrix, as Parameters."""
    g = gen(key)
    shapes = [(7, 5), (4,), (3, 6)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def worker_deltas(params, key, k=3):
    """K workers' pseudo-gradients of each param, as [K, *p.shape] stacks."""
    g = gen(key)
    return [torch.randn(k, *p.shape, generator=g).to(p.dtype) for p in params]


def opt_with_state(seed=30):
    """An IsoLoCo that has taken one step (momentum buffers held) over three small tensors."""
    import isoloco_kernels as ik

    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g), torch.randn(5, generator=g)]
    opt = ik.IsoLoCo(ps, lr=0.5, momentum=0.9)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return ps, opt
