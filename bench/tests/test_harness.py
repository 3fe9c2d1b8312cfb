"""bench/harness.py reads the flatten registry: a method added with one registry line is benchmarked as itself,
its work from the registry's model (tests/flatten/test_methods.py: the same toy method passes the library's
contract)."""

from __future__ import annotations

from bench import harness
from isoloco_kernels.flatten import exact
from isoloco_kernels.flatten.registry import METHODS, Method


def test_a_new_method_joins_the_harness(monkeypatch):
    """A toy method (the exact svd under another name) added with one registry line: the harness resolves it to
    itself and its work model is the registry's."""
    monkeypatch.setitem(
        METHODS, "toy", Method(run=exact.flatten_svd_, flops=lambda k, r: {"fp64": 8.0 * k * r * r}, exact=True)
    )
    shapes = [(2, 64, 256), (1, 300, 40)]
    assert harness.resolved_methods("toy", shapes, "cpu") == ["toy", "toy"]
    assert harness.flatten_work(["toy", "toy"], shapes, "fp32") == {"fp64": 2 * 8.0 * 256 * 64**2 + 8.0 * 300 * 40**2}
