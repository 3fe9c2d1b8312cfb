"""Fixtures shared by the test files."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import torch_settings_restored


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of small computations: on a busy 2-core machine a second thread
    buys nothing and stalls."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _torch_settings_restored():
    """Every test leaves torch's process-wide settings as it found them: one that calls the training
    CLI's main in this process (--threads, deterministic algorithms) must not change later tests' bytes."""
    with torch_settings_restored():
        yield


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (bench/device_check.sh runs `-m cuda`)")
    config.addinivalue_line(
        "markers",
        "slow: spawns process groups or fresh interpreters, or trains (a module marks itself: "
        "pytestmark = pytest.mark.slow); `-m 'not slow'` is the quick subset",
    )


_NEEDS_GPU = re.compile(r"\bneeds? .*\b(CUDA|GPUs?)\b|CUDA extension not loaded")


def pytest_collection_modifyitems(config, items):
    """Mark `cuda` every test that skips without a GPU (a skipif whose reason says it needs
    CUDA or a GPU, or the CUDA extension), so one selection runs exactly the device tests."""
    for item in items:
        if any(_NEEDS_GPU.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)
