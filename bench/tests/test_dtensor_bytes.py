"""bench/dtensor_bytes.py: the bytes each DTensor route puts on the wire, per rank, no process group needed
(tests/distributed/test_dtensor.py: the route rule these counts are modelled on)."""

from __future__ import annotations

from bench.dtensor_bytes import wire_bytes


def test_wire_bytes_of_each_route():
    b = wire_bytes([(32000, 1024), (1024,)], 4)
    assert b["gram_or_gather"] == b["chosen"] == 2 * 3 / 4 * 8 * 1024**2
    assert wire_bytes([(1024, 1024)], 4, mode="owner")["chosen"] == 2 * 3 / 16 * 1024 * 1024 * 4
    assert b["allgather"] == 3 * 8000 * 1024 * 4 and b["owner"] == 2 * 3 / 16 * 32000 * 1024 * 4
