"""bench/probes.py, the short probes of bench/device_check.sh, run end to end at their dry-run size (CPU), so a
GPU run of the script spends its minutes measuring. Their numbers are not checked here; what they print is."""

import re

import pytest
import torch

from bench import probes

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_gram_polar_probe_times_both_methods_and_reports_their_errors():
    lines = probes.gram_polar(dry=True)
    assert len(lines) == 2
    for line in lines:
        errs = [float(e) for e in re.findall(r"err (\S+)", line)]
        assert len(errs) == 2 and max(errs) <= 1e-3, line  # cond 1e4: both methods are exact-grade
        assert re.search(r"polar [\d.]+ ms .* gram [\d.]+ ms .* auto -> \w+", line), line


def test_the_sym_routes_probe_times_fast_on_each_route():
    lines = probes.sym_routes(dry=True)
    fast_lines = [line for line in lines if line.startswith("fast ")]
    assert len(fast_lines) == 1
    assert "direct (torch products)" in fast_lines[0] and "gram (torch products)" in fast_lines[0]
    assert re.search(r"route_for picks (direct|gram)$", fast_lines[0])
    # the one-triangle kernel and fast on it: timed where Triton runs on CPU tensors (TRITON_INTERPRET=1, as
    # .ci/run's interpreter step runs this file), else said so
    from isoloco_kernels import triton as tk

    if tk.usable_for(torch.empty(1)):
        assert "direct (triton products)" in fast_lines[0]
        assert [line for line in lines if line.startswith("X·Xᵀ (")], lines
    else:
        assert any("Triton cannot run" in line for line in lines)


def test_the_probes_refuse_an_unknown_name():
    with pytest.raises(SystemExit):
        probes.main(["svd-race"])
