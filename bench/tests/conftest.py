"""Fixtures of the tests of bench/ (the benchmark code's own unit tests; the library's are in tests/)."""

from __future__ import annotations

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
    config.addinivalue_line(
        "markers", "slow: spawns process groups or fresh interpreters, or trains; `-m 'not slow'` is the quick subset"
    )
