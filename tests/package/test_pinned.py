"""What users see, pinned: the README's quick start and minimal example, a 10-round study cell, a
compressed run and a 2-rank ShardedIsoLoCo run (plain and compressed).

Reorganizing the package must not change any of these numbers. `tests/data/pinned.json` holds them
as recorded (`ISOLOCO_PIN_RECORD=1 python -m pytest tests/package/test_pinned.py` rewrites it): each
result as the SHA-256 of its bytes and a few float64 summaries. On the machine configuration it was
recorded on (torch version, CPU capability, BLAS core type) the bytes must match exactly; elsewhere a
result that went through LAPACK/BLAS may differ in its last digits, so the summaries are compared at a
relative 1e-5 (the quick start) or 2e-3 (the training runs, which carry those digits through hundreds of
steps; DESIGN.md: numbers that must not depend on the machine).
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy

import pytest
import torch
import torch.multiprocessing as mp

import isoloco_kernels as ik

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PINNED = os.path.join(ROOT, "tests", "data", "pinned.json")
RECORD = os.environ.get("ISOLOCO_PIN_RECORD") == "1"


def machine() -> str:
    """What the exact bytes of a BLAS/LAPACK result depend on here."""
    blas = os.environ.get("OPENBLAS_CORETYPE", "-")
    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, OPENBLAS_CORETYPE {blas}"


def pin(tensors) -> dict:
    """SHA-256 of the tensors' bytes (in order) and float64 summaries to compare elsewhere."""
    h = hashlib.sha256()
    norms, firsts = [], []
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        t64 = t.double()
        norms.append(float(t64.norm()))
        firsts.append(float(t64.flatten()[0]) if t.numel() else 0.0)
    return {"sha256": h.hexdigest(), "norms": norms, "firsts": firsts}


def _quick_start() -> dict:
    torch.manual_seed(0)
    delta = torch.randn(64, 256)
    flat = ik.iso_flatten(delta)
    buckets = [torch.randn(3, 16, 8), torch.randn(32, 32)]
    ik.iso_merge_(buckets)
    return pin([flat, *buckets])


def _minimal_example() -> dict:
    mod = runpy.run_path(os.path.join(ROOT, "examples", "diloco_minimal.py"))
    loss = mod["train"](lambda ps: ik.IsoLoCo(ps, lr=1.8, momentum=0.8), rounds=6, log=lambda *_: None)
    return pin([torch.tensor([loss], dtype=torch.float64)])


def _cell(mode: str, rounds: int, **extra) -> dict:
    from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode

    cfg = TrainConfig(
        workers=4, inner_steps=30, rounds=rounds, batch=4, seq_len=64, eval_windows=16, divergence=False, **extra
    )
    r = run_mode(mode, Setup(cfg, load_corpus()))
    curve = [float(x) for x in r["heldout_loss"]] + [float(x) for x in r["test_loss"]]
    return pin([torch.tensor(curve, dtype=torch.float64)])


def _sharded_rank(rank: int, world: int, port: int, compress, path: str) -> None:
    from tests.spawn import init_gloo

    init_gloo(rank, world, port, 60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 12))
    opt = ik.ShardedIsoLoCo(model.parameters(), lr=1.8, momentum=0.8, compress=compress)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        for p in model.parameters():
            p.grad = 1e-2 * torch.randn(p.shape, generator=gen)
        opt.step()
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], path)
    torch.distributed.barrier()
    os._exit(0)


def _sharded(compress, tmp_path) -> dict:
    from tests.spawn import free_port

    path = str(tmp_path / f"sharded_{compress}.pt")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_sharded_rank, args=(r, 2, port, compress, path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    return pin(torch.load(path))


CASES = {
    "quick_start": lambda tmp: _quick_start(),
    "minimal_example": lambda tmp: _minimal_example(),
    "cell_isoloco_10": lambda tmp: _cell("isoloco", 10),
    "cell_diloco_10": lambda tmp: _cell("diloco", 10),
    "cell_isoloco_int4": lambda tmp: _cell("isoloco", 3, compress="int4:128:0.95"),
    "sharded_2_ranks": lambda tmp: _sharded(None, tmp),
    "sharded_2_ranks_int4": lambda tmp: _sharded("int4", tmp),
}


def _load() -> dict:
    if not os.path.exists(PINNED):
        return {"machine": machine(), "results": {}}
    with open(PINNED, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pinned(name, tmp_path):
    got = CASES[name](tmp_path)
    saved = _load()
    if RECORD:
        saved["machine"] = machine()
        saved["results"][name] = got
        with open(PINNED, "w", encoding="utf-8") as f:
            json.dump(saved, f, indent=1, sort_keys=True)
            f.write("\n")
        return
    want = saved["results"].get(name)
    assert want is not None, f"{name} is not pinned in {PINNED}; record it with ISOLOCO_PIN_RECORD=1"
    if saved["machine"] == machine():
        assert got["sha256"] == want["sha256"], f"{name}: the bytes changed on the machine they were pinned on"
    else:
        # elsewhere: a direct computation agrees to LAPACK's last digits; a training run carries them through
        # hundreds of inner steps (and a quantized exchange's bins), so its curve is compared more loosely
        rtol = 1e-5 if name == "quick_start" else 2e-3
        for key in ("norms", "firsts"):
            torch.testing.assert_close(
                torch.tensor(got[key], dtype=torch.float64),
                torch.tensor(want[key], dtype=torch.float64),
                rtol=rtol,
                atol=1e-7,
                msg=f"{name}: {key}",
            )
