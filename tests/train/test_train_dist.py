"""The training loop under torchrun: two real gloo ranks on 127.0.0.1 give the single-process
simulation's held-out losses (replicated and sharded outer step), and bad launches are refused
before training."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from isoloco_kernels.train import MODES, TrainConfig
from isoloco_kernels.train.cli import main
from isoloco_kernels.train.dist import Launch, check_outer, launched_by_torchrun
from tests.helpers import TOL, torch_settings_restored
from tests.spawn import free_port

pytestmark = pytest.mark.slow  # launches training ranks under torchrun

FLAGS = "-H 2 -R 2 --batch 2 --seq-len 16 --eval-windows 8 --max-bytes 200000 --quiet --seed 3".split()
OUTER_MODES = ["diloco", "isoloco", "isoloco-sgd", "avg"]
LAUNCH_TIMEOUT_S = 240
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """~400 KB of word salad: enough bytes for 2 shards and the held-out split, fresh per session."""
    rng = random.Random()
    words = "def class return import self value index total print for while if else yield".split()
    path = tmp_path_factory.mktemp("dist_data") / "text.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(6000)))
    return path


def _torchrun(args: list[str], out) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "isoloco_kernels.train",
        *args,
        "--out",
        str(out),
    ]
    # its own session, so a hung launch is killed with its workers, not just the torchrun agent
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun did not finish in {LAUNCH_TIMEOUT_S} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def simulation(data_file, tmp_path_factory):
    """The single-process run of the same 2 workers, every mode."""
    out = tmp_path_factory.mktemp("sim")
    with torch_settings_restored():  # a module fixture: set up before conftest's per-test restore
        assert (
            main(["--mode", "all", "-K", "2", "--threads", "1", "--data", str(data_file), *FLAGS, "--out", str(out)])
            == 0
        )
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize(
    "outer, modes",
    [("replicated", list(MODES)), ("sharded", OUTER_MODES)],
)
def test_torchrun_matches_the_simulation(simulation, data_file, tmp_path, outer, modes):
    # no --workers: under torchrun it defaults to the world size
    p = _torchrun(["--mode", ",".join(modes), "--outer", outer, "--data", str(data_file), *FLAGS], tmp_path)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert p.stdout.count("wrote ") == 1, p.stdout  # rank 0 alone reports
    got = json.loads((tmp_path / "results.json").read_text())
    assert got["launch"] == {"launcher": "torchrun", "world_size": 2, "backend": "gloo", "outer": outer}
    assert got["config"]["workers"] == 2
    assert list(got["modes"]) == modes
    tol = TOL[("train_dist", torch.float32)]
    for m in modes:
        run, ref = got["modes"][m], simulation["modes"][m]
        assert "diverged" not in run and "diverged" not in ref
        assert run["tokens"] == ref["tokens"]
        a, b = run["heldout_loss"], ref["heldout_loss"]
        assert len(a) == len(b) == 3
        assert a[-1] < a[0] - 0.05, (m, a)  # it trained
        err = max(abs(x - y) / abs(y) for x, y in zip(a, b))
        assert err <= tol, f"{m} ({outer}): held-out {a} vs simulation {b}, rel err {err:.2e} > {tol}"
        a, b = run["test_loss"], ref["test_loss"]  # and the test split
        err = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
        assert err <= tol, f"{m} ({outer}): test split {a} vs simulation {b}, rel err {err:.2e} > {tol}"
        # the divergence measurements all-reduce the per-worker sums: the same numbers on 2 ranks
        for d, e in zip(run.get("divergence", []), ref.get("divergence", []), strict=True):
            for what in ("cosine", "shrinkage", "norm"):
                for g, x in d[what].items():
                    assert x == pytest.approx(e[what][g], rel=1e-4, abs=1e-6), (m, outer, what, g)
    # the modes differ by far more than the tolerance, so a mode mix-up cannot pass
    finals = [simulation["modes"][m]["final_loss"] for m in modes]
    assert min(abs(x - y) for i, x in enumerate(finals) for y in finals[i + 1 :]) > 100 * tol


def test_torchrun_environment_detected(monkeypatch):
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert launched_by_torchrun(env)
    assert not launched_by_torchrun({k: v for k, v in env.items() if k != "MASTER_PORT"})
    launch = Launch.from_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.is_main) == (1, 2, 1, False)


@pytest.mark.parametrize(
    "workers, sweep, device, outer, match",
    [
        (3, None, "cpu", "replicated", r"--workers 3 does not match the torchrun world size 2"),
        (2, "workers", "cpu", "replicated", r"--sweep workers cannot run under torchrun"),
        (2, None, "cuda:1", "replicated", r"--device 'cuda:1' under torchrun"),
        (2, None, "cpu", "mirrored", r"--outer must be one of"),
    ],
)
def test_launch_refuses_bad_settings(workers, sweep, device, outer, match):
    launch = Launch(0, 2, 0)
    with pytest.raises(ValueError, match=match):
        launch.check([TrainConfig(workers=workers)], sweep, device, outer)
    assert launch.outer == "replicated"  # nothing taken from a refused check


def test_sharded_outer_needs_torchrun():
    with pytest.raises(ValueError, match=r"--outer sharded needs one process per worker"):
        check_outer(None, [TrainConfig(workers=2)], None, "cpu", "sharded")
    check_outer(None, [TrainConfig(workers=2)], None, "cpu", "replicated")


def test_cli_refuses_before_training(monkeypatch, tmp_path, data_file, capsys):
    """The CLI's own checks, in this process: nothing trains, nothing is written."""
    for k in _TORCHRUN_VARS:
        monkeypatch.delenv(k, raising=False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(
            ["--mode", "isoloco", "--outer", "sharded", "-K", "2", "--data", str(data_file), *FLAGS, "--out", str(out)]
        )
    assert e.value.code == 2 and "needs one process per worker" in capsys.readouterr().err
    # as rank 0 of a 2-rank torchrun launch asking for 3 workers (refused before joining the group)
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        main(["--mode", "diloco", "-K", "3", "--data", str(data_file), *FLAGS, "--out", str(out)])
    assert e.value.code == 2 and "does not match the torchrun world size 2" in capsys.readouterr().err
    assert not out.exists()


def test_divergence_ends_a_torchrun_run():
    # one rank's non-finite loss leaves the others in a collective: that rank must raise, not go on
    Launch(1, 2, 1).check_run({"mode": "isoloco", "heldout_loss": [5.5, 5.0]})
    with pytest.raises(RuntimeError, match=r"rank 1: isoloco diverged \(round 0 worker 1: loss is nan\)"):
        Launch(1, 2, 1).check_run({"mode": "isoloco", "diverged": "round 0 worker 1: loss is nan"})


def test_progress_on_rank_0_only_counts_every_rank():
    seen, closed = [], []

    def make(label, total):
        return (lambda done, loss: seen.append((label, total, done, loss))), (lambda: closed.append(label))

    cb, close = Launch(0, 2, 0).progress(make)("diloco", 40)
    cb(3, 5.5)
    close()
    assert seen == [("diloco", 40, 6, 5.5)] and closed == ["diloco"]
    cb, close = Launch(1, 2, 1).progress(make)("diloco", 40)
    assert cb is None
    close()
    assert closed == ["diloco"] and len(seen) == 1
