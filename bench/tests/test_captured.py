"""bench/captured.py: the committed pseudo-gradient sample and the loop's captures read as bucket sets, slimmed
copies, and every fault of a capture file refused through bench's loader as through the loop's
(tests/package/test_files.py: the capture format itself)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.captured import DATA, load_captured_sets, slim
from isoloco_kernels.train.capture import CaptureError, save_capture
from isoloco_kernels.train.cli import main
from tests.package.test_files import CORRUPTIONS, _blob, _corrupt

pytestmark = pytest.mark.usefixtures("one_thread")

CLI_SMALL = "-K 2 -H 2 -R 2 --batch 2 --seq-len 16 --eval-windows 8 --max-bytes 60000 --quiet --threads 1".split()


@pytest.fixture
def good(tmp_path) -> Path:
    return save_capture(tmp_path / "cap" / "diloco" / "round_003.pt", **_blob())


@pytest.mark.parametrize("how, msg", CORRUPTIONS)
def test_corrupted_capture_is_refused_naming_the_file_by_the_bucket_set_loader(good, how, msg):
    _corrupt(good, how)
    with pytest.raises(CaptureError, match=msg):
        load_captured_sets(good.parents[1])


def test_slim_refuses_a_cast_that_overflows(good, tmp_path):
    b = _blob()
    b["delta"]["tok.weight"][0, 0] = 1e6  # fits float32, not float16
    save_capture(good, **b)
    with pytest.raises(CaptureError, match="tok.weight has 1 non-finite entries of 8192 in float16"):
        slim(good.parents[1], tmp_path / "slim", dtype="float16")


@pytest.mark.slow  # trains the reference loop
def test_captures_become_bucket_sets(tmp_path):
    cap = tmp_path / "cap"
    assert (
        main(
            CLI_SMALL
            + [
                "--out",
                str(tmp_path / "run"),
                "--mode",
                "diloco",
                "--save-pseudo-gradients",
                str(cap),
                "--save-rounds",
                "last",
            ]
        )
        == 0
    )
    small = slim(cap, tmp_path / "slim", keep=["tok.", "head.", "blocks.1."], dtype="float16")
    assert [p.name for p in small] == ["round_002.pt"]
    for folder, n_mats in ((cap, 11), (tmp_path / "slim", 6)):
        ((name, e),) = load_captured_sets(folder).items()
        assert name == "captured-diloco-r2"
        assert sum(b for b, _, _ in e["shapes"]) == n_mats
        for (b, m, n), x, names, cond in zip(e["shapes"], e["src"], e["names"], e["cond"]):
            assert x.shape == (b, m, n) and m >= n and x.dtype == torch.float32 and len(names) == b
            assert all(c is not None and c >= 1 for c in cond)
        assert any(n.endswith("ᵀ") for ns in e["names"] for n in ns)  # MLP down (128×512) stored tall


@pytest.mark.slow  # reads every committed capture
def test_committed_capture_sample():
    size = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert size < 2_000_000
    sets = load_captured_sets()
    assert {"captured-bytes-isoloco-r10", "captured-bpe1024-isoloco-r10"} <= set(sets)
    bpe = sets["captured-bpe1024-isoloco-r10"]
    assert (2, 1024, 128) in bpe["shapes"]  # the BPE embedding and head
    for e in sets.values():
        assert all(torch.isfinite(x).all() and x.abs().max() > 0 for x in e["src"])
