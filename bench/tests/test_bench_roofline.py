"""Every benchmark case reports its roofline: bench/ run at --bench-dry-run (every case once at its smallest
size, one round, small ceilings; bench/conftest.py), its JSON read back, and each case's extra_info checked
for a fraction of its roofline (bench/report_data.missing_roofline). The numbers are not checked here: a
dry run measures nothing. The check's own check: a case without a fraction is named."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from bench.report_data import KINDS, missing_roofline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRY_RUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """(pytest's output, the JSON) of `pytest bench --benchmark-only --bench-dry-run` on the CPU."""
    out = tmp_path_factory.mktemp("bench") / "dry-run.json"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "bench",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--benchmark-only",
        "--bench-dry-run",
        "--bench-devices",
        "cpu",
        "--bench-threads",
        "1",
        f"--benchmark-json={out}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the dry run failed (exit code {proc.returncode}):\n{text[-4000:]}"
    with open(out) as f:
        return text, json.load(f)


@pytest.mark.slow
def test_every_case_of_the_dry_run_reports_its_roofline(dry_run):
    text, run = dry_run
    passed = re.search(r"(\d+) passed", text)
    assert passed, text[-2000:]
    assert len(run["benchmarks"]) == int(passed.group(1)), "a case that ran wrote no record"
    missing = missing_roofline(run)
    assert not missing, f"{len(missing)} of {len(run['benchmarks'])} cases report no roofline: {missing}"
    kinds = {b["extra_info"]["kind"] for b in run["benchmarks"]}
    assert set(KINDS) <= kinds, f"kinds of case that did not run: {sorted(set(KINDS) - kinds)}"
    assert run["isoloco"]["mode"] == "dry-run" and run["isoloco"]["bench_sets"] == ["dry-tiny"]


def test_the_check_names_a_case_without_a_roofline():
    run = {
        "benchmarks": [
            {"fullname": "bench/a.py::test_a[x]", "extra_info": {"kind": "flatten", "frac_roofline": 0.5}},
            {"fullname": "bench/b.py::test_b[y]", "extra_info": {"kind": "merge", "GBps": 1.0}},
            {"fullname": "bench/c.py::test_c[z]", "extra_info": {"kind": "merge", "frac_roofline": None}},
            {"fullname": "bench/d.py::test_d[w]"},
        ]
    }
    assert missing_roofline(run) == ["bench/b.py::test_b[y]", "bench/c.py::test_c[z]", "bench/d.py::test_d[w]"]
