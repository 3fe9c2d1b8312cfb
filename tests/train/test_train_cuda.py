"""`python -m isoloco_kernels.train` end to end on each device: every mode trains, and results.json
carries the throughput (tokens/s) and the outer step's share of the rounds. The CUDA run skips
without a GPU."""

from __future__ import annotations

import json
import math

import pytest
import torch

from isoloco_kernels.train.cli import main
from isoloco_kernels.train.loop import DEFAULT_MODES

TINY = "-K 2 -H 2 -R 2 --batch 2 --seq-len 16 --eval-windows 8 --max-bytes 60000 --quiet --threads 1".split()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
            ],
        ),
    ],
)
def test_tiny_run_reports_throughput_and_outer_share(tmp_path, device):
    out = tmp_path / "run"
    assert main([*TINY, "--device", device, "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["machine"]["device"] == device and set(res["modes"]) == set(DEFAULT_MODES)
    for mode, r in res["modes"].items():
        assert math.isfinite(r["final_loss"]) and r["final_loss"] < r["heldout_loss"][0], mode
        assert 0 < r["train_s"] <= r["wall_s"] and r["tokens_per_s"] > 0, mode
        # every worker's tokens: K · R · H inner steps of batch × seq_len
        assert r["tokens_per_s"] * r["train_s"] == pytest.approx(2 * 2 * 2 * 2 * 16), mode
        if mode == "ddp":
            assert "outer_share" not in r
        else:
            assert 0 < r["outer_step_s"] < r["train_s"] and 0 < r["outer_share"] < 1, mode
