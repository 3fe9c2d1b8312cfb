"""The one harness of the multi-rank tests: gloo ranks spawned on 127.0.0.1.

A spawned group costs seconds (every rank imports torch and builds its process group), so one
group runs many checks. Each check is registered in a `Checks` table; every rank runs the table
in order (`Checks.run`), writing each check's outcome (ok, or its traceback) to a file, with a
barrier after each so a check that failed on one rank cannot leave the next one out of step. The
group is spawned by a module fixture on first use (`Group`), and each check is reported as its
own test (`Group.assert_ok`). The parent enforces a hard deadline, so a hang fails instead of
blocking CI; the process-group timeout is the backstop for a rank left waiting in a collective.
"""

from __future__ import annotations

import inspect
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 120  # per spawned group, generous for 2 busy cores; a hang fails here
PG_TIMEOUT_S = 15  # process group timeout: the backstop for a rank that vanishes

#: 4 spawned ranks run by default; ISOLOCO_SKIP_4_RANKS=1 skips them.
four_ranks = pytest.mark.skipif(
    os.environ.get("ISOLOCO_SKIP_4_RANKS") == "1", reason="ISOLOCO_SKIP_4_RANKS=1 (4 spawned ranks)"
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """This spawned rank's gloo process group over loopback, one torch thread."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _entry(rank, world, port, body, tmpdir, pg_timeout_s):
    init_gloo(rank, world, port, pg_timeout_s)
    body(rank, world, tmpdir)
    finished(tmpdir, rank)
    os._exit(0)  # skip process-group teardown: a check may have left a peer gone


def finished(tmpdir, rank: int) -> None:
    """Mark this rank as done (a rank that leaves early on purpose calls it itself)."""
    with open(os.path.join(tmpdir, f"done{rank}"), "w") as f:
        f.write("ok")


def spawn(body, world: int, tmp_path, pg_timeout_s: float = PG_TIMEOUT_S, deadline_s: float = DEADLINE_S) -> None:
    """Run body(rank, world, tmpdir) on `world` spawned gloo ranks; fail if any rank did not
    finish within `deadline_s` (process-group timeout `pg_timeout_s`: a collective that waits
    longer fails that rank)."""
    ctx = mp.start_processes(
        _entry,
        args=(world, free_port(), body, str(tmp_path), pg_timeout_s),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    t0 = time.monotonic()
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() - t0 > deadline_s:
                pytest.fail(f"spawned group of {world} did not finish within {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    missing = [r for r in range(world) if not (Path(tmp_path) / f"done{r}").exists()]
    assert not missing, f"ranks {missing} exited without finishing their checks"


def record(tmpdir, rank: int, name: str, fn: Callable, /, *args, **kwargs) -> None:
    """Run one check and write its outcome (ok, or the traceback) for the test that reports it.
    pytest's own failures (pytest.fail, pytest.raises) are BaseExceptions: caught too."""
    try:
        fn(*args, **kwargs)
        out = "ok"
    except BaseException:  # noqa: BLE001 — reported by the test of that check
        out = traceback.format_exc()
    with open(os.path.join(tmpdir, f"check-{name}-rank{rank}"), "w") as f:
        f.write(out)


class Checks(dict):
    """name → check, run in order on every rank of a group. `@table` registers a function under
    its name without the `_check_` prefix; `table.add(name, fn)` under any name."""

    def __call__(self, fn: Callable) -> Callable:
        return self.add(fn.__name__.removeprefix("_check_"), fn)

    def add(self, name: str, fn: Callable) -> Callable:
        assert name not in self, f"check {name!r} registered twice"
        self[name] = fn
        return fn

    def run(self, tmpdir, rank: int, /, *args, **ctx) -> None:
        """Every check as fn(*args), or with `ctx` as fn(**the entries of ctx it names as
        parameters), each recorded, a barrier after each."""
        for name, fn in self.items():
            if ctx:
                wanted = inspect.signature(fn).parameters
                record(tmpdir, rank, name, fn, *args, **{k: v for k, v in ctx.items() if k in wanted})
            else:
                record(tmpdir, rank, name, fn, *args)
            dist.barrier()  # a check that failed on one rank cannot leave the next one out of step


class Group:
    """A group of `world` spawned ranks running `body`, spawned once, on the first report asked
    of it; a failed spawn is kept and named by every check it left unreported."""

    def __init__(self, body, world: int, folder, **spawn_kw):
        self.body, self.world, self.folder, self.spawn_kw = body, world, Path(folder), spawn_kw
        self.error: Optional[str] = None
        self.started = False

    def assert_ok(self, name: str) -> None:
        """Check `name` passed on every rank."""
        if not self.started:
            self.started = True
            try:
                spawn(self.body, self.world, self.folder, **self.spawn_kw)
            except BaseException as e:  # noqa: BLE001 — each check then says what it lacks
                self.error = f"{type(e).__name__}: {e}"
        for rank in range(self.world):
            f = self.folder / f"check-{name}-rank{rank}"
            assert f.exists(), f"rank {rank} did not report check {name!r}: {self.error}"
            text = f.read_text()
            assert text == "ok", f"rank {rank}:\n{text}"


def groups(body, *worlds: int, **spawn_kw):
    """A module fixture: world size → `Group` running `body`, each spawned on first use."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        return {w: Group(body, w, tmp_path_factory.mktemp(f"ranks{w}"), **spawn_kw) for w in worlds}

    return fixture


def params(tables: dict) -> list:
    """pytest params (world, name) for every check of {world: Checks}, with ids "<world>ranks-<name>";
    groups of 4 ranks or more are marked `four_ranks`."""
    return [
        pytest.param(w, name, id=f"{w}ranks-{name}", marks=[four_ranks] if w >= 4 else [])
        for w, table in tables.items()
        for name in table
    ]
