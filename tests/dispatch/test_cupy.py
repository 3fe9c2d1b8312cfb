"""The CuPy path (dispatch/_cupy.py) without CuPy or a GPU: its handle on torch's stream."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from isoloco_kernels.dispatch import _cupy


def _fake_cupy(with_from_external: bool):
    calls = []

    class Stream:
        pass

    if with_from_external:
        Stream.from_external = staticmethod(lambda obj: calls.append(("from_external", obj)) or "from_external")

    def external(ptr, device):
        calls.append(("ExternalStream", ptr, device))
        return "ExternalStream"

    return SimpleNamespace(cuda=SimpleNamespace(Stream=Stream, ExternalStream=external)), calls


@pytest.mark.parametrize(
    "new_cupy,protocol,want",
    [(True, True, "from_external"), (False, True, "ExternalStream"), (True, False, "ExternalStream")],
    ids=["cupy14-torch-protocol", "older-cupy", "torch-without-protocol"],
)
def test_cupy_takes_torchs_stream_through_from_external_where_both_allow(new_cupy, protocol, want):
    cupy, calls = _fake_cupy(new_cupy)
    stream = SimpleNamespace(cuda_stream=0x1234)
    if protocol:
        stream.__cuda_stream__ = lambda: (0, 0x1234)
    assert _cupy.external_stream(cupy, stream, 3) == want
    assert calls == ([("from_external", stream)] if want == "from_external" else [("ExternalStream", 0x1234, 3)])
