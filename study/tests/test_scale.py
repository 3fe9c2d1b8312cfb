"""Study v6 part D's GPU point (study/scale/gpu_point.py): its dry run on the CPU, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

STUDY = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # a fresh interpreter that trains


def test_the_gpu_point_dry_run_writes_a_line_per_run(tmp_path):
    out = tmp_path / "gpu_point.jsonl"
    proc = subprocess.run(
        [sys.executable, str(STUDY / "scale" / "gpu_point.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["run"] for r in lines] == ["diloco-official", "diloco-pick", "isoloco"]
    assert all(r["dry_run"] and r["rounds"] == 2 and len(r["heldout_loss"]) == 3 and r["epochs"] > 0 for r in lines)
    assert not (tmp_path / "gpu_point_corpus.txt").exists()
