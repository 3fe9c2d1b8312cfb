"""The study's tests run apart from the package's (python -m pytest study/tests -q): their marker here."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: spawns process groups or fresh interpreters, or trains (a module marks itself: "
        "pytestmark = pytest.mark.slow); `-m 'not slow'` is the quick subset",
    )
