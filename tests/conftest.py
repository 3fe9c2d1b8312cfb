"""Fixtures shared by the test files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of small computations: on a busy 2-core machine a second thread
    buys nothing and stalls."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (bench/device_check.sh runs `-m cuda`)")
    config.addinivalue_line(
        "markers", "slow: spawns process groups or fresh interpreters, or trains; `-m 'not slow'` is the quick subset"
    )


#: Test files (relative to tests/) whose tests start process groups (gloo ranks), fresh interpreters or whole training runs: they
#: hold most of the suite's time. `pytest tests -m "not slow"` leaves them out (README: the quick subset).
SLOW_FILES = {
    "distributed/test_agreement.py",
    "distributed/test_alloc_failure.py",
    "distributed/test_checkpoints_dist.py",
    "distributed/test_compress_sharded.py",
    "distributed/test_control_plane.py",
    "distributed/test_distributed.py",
    "distributed/test_dtensor.py",
    "distributed/test_dtensor_half.py",
    "package/test_examples.py",
    "distributed/test_agree_attempt.py",
    "package/test_imports.py",
    "distributed/test_merge_sharded.py",
    "distributed/test_merge_workspace.py",
    "test_study.py",
    "test_study_v4.py",
    "train/test_train.py",
    "train/test_train_dist.py",
}


TESTS = Path(__file__).resolve().parent


_NEEDS_GPU = re.compile(r"\bneeds? .*\b(CUDA|GPUs?)\b|CUDA extension not loaded")


def pytest_collection_modifyitems(config, items):
    """Mark `cuda` every test that skips without a GPU (a skipif whose reason says it needs
    CUDA or a GPU, or the CUDA extension), so one selection runs exactly the device tests."""
    for item in items:
        if item.path.is_relative_to(TESTS) and item.path.relative_to(TESTS).as_posix() in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if any(_NEEDS_GPU.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)
