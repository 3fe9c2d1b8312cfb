"""The study's tests run apart from the package's (python -m pytest study/tests -q): their markers here."""

from __future__ import annotations

import pytest

#: Test files whose tests start fresh interpreters that train (the runner's end-to-end runs):
#: `-m "not slow"` leaves them out, as tests/conftest.py does for the package's.
SLOW_FILES = {"test_runner.py", "test_precision.py", "test_scale.py"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: spawns process groups or fresh interpreters, or trains; `-m 'not slow'` is the quick subset"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
