"""Fixtures of the tests of bench/ (the benchmark code's own unit tests; the library's are in tests/)."""

from __future__ import annotations

from tests.conftest import one_thread  # noqa: F401  (the fixture, shared with the library's tests)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: spawns process groups or fresh interpreters, or trains; `-m 'not slow'` is the quick subset"
    )
