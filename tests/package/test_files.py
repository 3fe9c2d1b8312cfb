"""Files and sizes: every CLI size is bounded before anything allocates, every output folder is
probed by writing, and every file the loop, the benchmarks and the study read is checked, a bad
one named with what is wrong."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from isoloco_kernels.train import loop, tokenizer
from isoloco_kernels.train.capture import (
    CaptureError,
    CaptureFormatWarning,
    load_capture,
    load_pseudo_gradients,
    save_capture,
    tensor_checksum,
)
from isoloco_kernels.train.cli import check_folder, main

ROOT = Path(__file__).resolve().parents[2]
CLI_SMALL = "-K 2 -H 2 -R 2 --batch 2 --seq-len 16 --eval-windows 8 --max-bytes 60000 --quiet --threads 1".split()

pytestmark = pytest.mark.usefixtures("one_thread")


def _refused(args, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(CLI_SMALL + args)
    assert e.value.code == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# sizes: bounded with an argparse error before any allocation


@pytest.mark.parametrize(
    "args, msg",
    [
        pytest.param(
            ["--vocab", "1000000000000"], "--vocab takes bytes, 256 or an integer in 257..262144", id="vocab-1e12"
        ),
        pytest.param(["--vocab", str(tokenizer.MAX_VOCAB + 1)], "an integer in 257..262144", id="vocab-max+1"),
        pytest.param(["--threads", "1000000000000"], "--threads must be in 1..", id="threads-1e12"),
        pytest.param(["--threads", "0"], "--threads must be in 1..", id="threads-0"),
        pytest.param(["--seed", str(2**64)], "seed must be an integer in [-2**63, 2**63)", id="seed-2**64"),
        pytest.param(["-K", "1000000000"], "larger than each of the 1000000000 workers' data shard", id="workers-1e9"),
        pytest.param(["--seq-len", "1000000000"], "larger than each of the 2 workers' data shard", id="seq-len-1e9"),
        pytest.param(
            ["-R", "100000000", "--save-pseudo-gradients", "CAP", "--save-rounds", "all"],
            "GiB there but",
            id="save-all-of-1e8-rounds-disk",
        ),
    ],
)
def test_cli_sizes_are_bounded_before_training(tmp_path, capsys, args, msg):
    out = tmp_path / "out"
    err = _refused(["--out", str(out)] + [str(tmp_path / "cap") if a == "CAP" else a for a in args], capsys)
    assert msg in err
    assert not out.exists() and not (tmp_path / "cap").exists()


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="default-workers"),
        pytest.param(["--vocab", "300"], id="vocab-before-the-tokenizer-trainer"),
    ],
)
def test_cli_refuses_a_run_larger_than_free_memory(tmp_path, capsys, monkeypatch, args):
    monkeypatch.setattr(loop, "available_memory", lambda device: 1 << 20)  # 1 MiB free
    err = _refused(["--out", str(tmp_path / "out")] + args, capsys)
    assert "the run needs at least" in err and "GiB is free" in err
    assert not (tmp_path / "out").exists()


def test_memory_estimate_grows_with_workers_and_vocab():
    c = loop.TrainConfig(workers=2)
    small = loop.memory_estimate(c, ["diloco"], 2)
    # each more worker holds its own two AdamW moments
    assert loop.memory_estimate(c, ["diloco"], 20) - small >= 18 * 2 * 4 * c.n_params()
    assert loop.memory_estimate(loop.TrainConfig(workers=2, vocab=4096), ["diloco"], 2) > small
    assert small > 4 * c.n_params() * 4  # weights, two AdamW moments per worker, …: a lower bound
    assert loop.available_memory("cpu") is None or loop.available_memory("cpu") > small


def test_memory_estimate_counts_the_error_feedback_residuals():
    c = loop.TrainConfig(workers=4)
    plain = loop.memory_estimate(c, ["isoloco"], 4)
    n4 = 4 * c.n_params()  # one float32 residual
    assert loop.memory_estimate(loop.TrainConfig(workers=4, compress="int2:128:none"), ["isoloco"], 4) == plain
    # the default placement ("workers"): the 4 local workers' residuals, no owner residual
    assert loop.memory_estimate(loop.TrainConfig(workers=4, compress="int2:128:0.95"), ["isoloco"], 4) == plain + 4 * n4
    workers = loop.TrainConfig(workers=4, compress="int2:128:0.95:nearest:workers")
    assert loop.memory_estimate(workers, ["isoloco"], 4) == plain + 4 * n4  # the same spec, named
    both = loop.TrainConfig(workers=4, compress="int2:128:0.95:nearest:both")
    assert loop.memory_estimate(both, ["isoloco"], 4) == plain + 5 * n4  # and the owner's update residual
    owner = loop.TrainConfig(workers=4, compress="int2:128:0.95:nearest:owner")
    assert loop.memory_estimate(owner, ["isoloco"], 4) == plain + n4
    assert loop.memory_estimate(
        loop.TrainConfig(workers=4, compress="int8:128:0.95"), ["ddp"], 4
    ) == loop.memory_estimate(c, ["ddp"], 4)  # DDP exchanges no pseudo-gradients


# ----------------------------------------------------------------------------------------------
# output folders: probed by writing a file, whatever os.access says


def _unwritable_but_access_says_yes(path: str) -> bool:
    p = Path(path)
    q = p if p.exists() else p.parent
    if not q.is_dir() or not os.access(q, os.W_OK):
        return False
    try:
        (q / ".isoloco-probe").write_bytes(b"")
        (q / ".isoloco-probe").unlink()
        return False
    except OSError:
        return True


@pytest.mark.parametrize(
    "flag, target",
    [
        pytest.param("--out", "/proc/isoloco-out", id="out-under-proc"),
        pytest.param("--out", "/sys", id="out-is-sys"),
        pytest.param("--save-pseudo-gradients", "/proc/isoloco-cap", id="capture-under-proc"),
        pytest.param("--save-pseudo-gradients", "/sys", id="capture-is-sys"),
    ],
)
def test_output_folder_os_access_calls_writable_is_probed(tmp_path, capsys, flag, target):
    if not _unwritable_but_access_says_yes(target):
        pytest.skip(f"{target} is not an os.access-writable but unwritable path on this system")
    out = tmp_path / "a" / "b" / "out"
    args = ["--out", str(out), "--mode", "diloco"]
    args = [target if a == str(out) and flag == "--out" else a for a in args]
    if flag != "--out":
        args += [flag, target]
    err = _refused(args, capsys)
    assert f"{flag} {target}: cannot write there" in err
    assert not (tmp_path / "a").exists()  # the folders the probe made are gone again


def test_read_only_file_system_is_refused(tmp_path, monkeypatch):
    """A read-only mount: os.access may say yes (root), the write says EROFS."""
    import errno
    import tempfile

    def read_only(*args, dir=None, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(ValueError, match=r"--out .*: cannot write there \(Read-only file system"):
        check_folder("--out", tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()


def test_probe_leaves_nothing_behind(tmp_path):
    check_folder("--out", tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "c").mkdir()
    check_folder("--out", tmp_path / "c")
    assert list((tmp_path / "c").iterdir()) == []


@pytest.mark.parametrize(
    "make, args, msg",
    [
        pytest.param("out/results.json/", [], "results.json exists and is not a file", id="results-json-is-a-folder"),
        pytest.param(
            "cap/diloco",
            ["--save-pseudo-gradients", "CAP"],
            "cap/diloco is a file, not a folder",
            id="capture-run-folder-is-a-file",
        ),
        pytest.param(
            "cap/diloco/round_002.pt/",
            ["--save-pseudo-gradients", "CAP", "--save-rounds", "last"],
            "round_002.pt exists and is not a file",
            id="capture-round-is-a-folder",
        ),
    ],
)
def test_files_the_run_writes_are_checked_before_training(tmp_path, capsys, make, args, msg):
    p = tmp_path / make.rstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.mkdir() if make.endswith("/") else p.write_text("x")
    err = _refused(
        ["--out", str(tmp_path / "out"), "--mode", "diloco"]
        + [str(tmp_path / "cap") if a == "CAP" else a for a in args],
        capsys,
    )
    assert msg in err


# ----------------------------------------------------------------------------------------------
# captured pseudo-gradients: format 2, a checksum per tensor, every fault named


def _blob(**over):
    g = torch.Generator().manual_seed(0)
    delta = {"tok.weight": torch.randn(256, 32, generator=g), "norm.weight": torch.randn(32, generator=g)}
    return {"round": 3, "mode": "diloco", "config": {"workers": 2}, "cond": {"tok.weight": 5.0}, "delta": delta, **over}


@pytest.fixture
def good(tmp_path) -> Path:
    return save_capture(tmp_path / "cap" / "diloco" / "round_003.pt", **_blob())


def test_capture_round_trip_and_checksum(good):
    b = load_capture(good)
    assert b["format"] == 2 and b["round"] == 3 and set(b["checksums"]) == set(b["delta"])
    ref = _blob()["delta"]
    assert all(torch.equal(b["delta"][n], ref[n]) for n in ref)
    t = ref["tok.weight"]
    assert tensor_checksum(t) == tensor_checksum(t.clone()) != tensor_checksum(t.to(torch.float64))
    assert tensor_checksum(t) != tensor_checksum(t.reshape(512, 16))  # the shape is part of it
    assert tensor_checksum(t.mT) == tensor_checksum(t.mT.contiguous())


def _corrupt(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "empty":
        raw = bytearray()
    elif how == "truncated":
        raw = raw[: len(raw) // 2]
    elif how == "garbage":
        raw = bytearray(b"not a torch file\n" * 100)
    else:  # 4 KB overwritten inside the 32 KB tensor record: zeros stay finite, random bytes may not
        import ctypes

        t = _blob()["delta"]["tok.weight"]
        start = raw.index(ctypes.string_at(t.data_ptr(), 64)) + 1024  # inside tok.weight's bytes
        g = torch.Generator().manual_seed(1)
        new = bytes(4096) if how == "4k-zeros" else bytes(torch.randint(0, 256, (4096,), generator=g).tolist())
        raw[start : start + 4096] = new
    path.write_bytes(bytes(raw))


#: (how, what the refusal says) of each corruption `_corrupt` makes (bench/tests/test_captured.py: bench's loader).
CORRUPTIONS = [
    pytest.param("empty", r"is empty \(0 bytes\)", id="empty"),
    pytest.param("truncated", r"is not a readable torch file, truncated or corrupted", id="truncated"),
    pytest.param("garbage", r"is not a readable torch file", id="garbage"),
    pytest.param("4k-zeros", r"tensor tok.weight does not match its checksum: the file is corrupted", id="4k-zeros"),
    pytest.param("4k-random", r"tensor tok.weight does not match its checksum", id="4k-random"),
]


@pytest.mark.parametrize("how, msg", CORRUPTIONS)
def test_corrupted_capture_is_refused_naming_the_file(good, how, msg):
    _corrupt(good, how)
    with pytest.raises(CaptureError, match=msg) as e:
        load_capture(good)
    assert str(good) in str(e.value)
    with pytest.raises(CaptureError, match=msg):  # and through every loader built on it (bench's: bench/tests)
        load_pseudo_gradients(good.parents[1])


@pytest.mark.parametrize(
    "blob, msg",
    [
        pytest.param(
            {k: v for k, v in _blob().items() if k != "delta"} | {"format": 2, "checksums": {}},
            "lacks delta",
            id="missing-delta",
        ),
        pytest.param(_blob(format=2), "lacks checksums", id="format-2-without-checksums"),
        pytest.param(_blob(format=3, checksums={}), "has format 3; this version reads formats 1 and 2", id="format-3"),
        pytest.param(
            _blob(format=2, checksums={"tok.weight": "0" * 64}),
            r"checksums do not list exactly the saved "
            r"tensors \(differ in \['norm.weight'\]\)",
            id="checksum-missing-for-a-tensor",
        ),
        pytest.param(_blob(delta={}), "'delta' must be a non-empty dict", id="empty-delta"),
        pytest.param(_blob(delta={"w": [1.0, 2.0]}), "'delta' must be a non-empty dict", id="delta-not-tensors"),
        pytest.param(_blob(round=0), "'round' must be an integer ≥ 1, got 0", id="round-0"),
        pytest.param(
            _blob(delta={"w": torch.tensor([[1.0, float("nan")]])}),
            "tensor w has 1 non-finite entries of 2",
            id="format-1-nan",
        ),
        pytest.param([1, 2], "holds a list, not a saved round", id="not-a-dict"),
    ],
)
def test_incomplete_capture_is_refused_naming_the_file(tmp_path, blob, msg):
    p = tmp_path / "round_001.pt"
    torch.save(blob, p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CaptureFormatWarning)
        with pytest.raises(CaptureError, match=msg) as e:
            load_capture(p)
    assert str(p) in str(e.value)


def test_format_1_loads_with_a_warning(tmp_path):
    p = tmp_path / "round_001.pt"
    torch.save(_blob(), p)
    with pytest.warns(CaptureFormatWarning, match=r"round_001.pt: no checksum \(format 1\)"):
        b = load_capture(p)
    assert b["format"] == 1 and torch.equal(b["delta"]["tok.weight"], _blob()["delta"]["tok.weight"])


@pytest.mark.parametrize(
    "delta, msg",
    [
        pytest.param(
            {"w": torch.tensor([1e5, 1.0]).half()},
            "tensor w has 1 non-finite entries of 2 in float16",
            id="float16-overflow",
        ),
        pytest.param({"w": torch.tensor([float("nan")])}, "tensor w has 1 non-finite", id="nan"),
    ],
)
def test_capture_writer_refuses_non_finite_and_writes_nothing(tmp_path, delta, msg):
    p = tmp_path / "run" / "round_001.pt"
    with pytest.raises(CaptureError, match=msg):
        save_capture(p, **_blob(delta=delta))
    assert not (tmp_path / "run").exists()


def test_committed_sample_is_format_2_and_verified():
    files = sorted((ROOT / "bench" / "data" / "captured").rglob("round_*.pt"))
    assert len(files) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureFormatWarning)
        for f in files:
            b = load_capture(f)
            assert b["format"] == 2 and b["delta"] and all(t.dtype == torch.float16 for t in b["delta"].values())


# ----------------------------------------------------------------------------------------------
# the BPE tokenizer cache: a checked envelope


def _tok_json() -> str:
    return json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})


@pytest.mark.parametrize(
    "write, msg",
    [
        pytest.param(lambda p: p.write_bytes(b""), r"is empty \(0 bytes\)", id="empty"),
        pytest.param(lambda p: p.write_text(p.read_text()[:40]), "is not valid JSON", id="truncated"),
        pytest.param(lambda p: p.write_bytes(b"\xff\xfe" * 50), "is not valid JSON", id="binary"),
        pytest.param(
            lambda p: p.write_text(_tok_json()), "lacks format, vocab, train_sha1, sha256", id="plain-tokenizer-json"
        ),
        pytest.param(
            lambda p: p.write_text(p.read_text().replace('\\"a\\": 0', '\\"b\\": 0')),
            "does not match its sha256",
            id="edited",
        ),
        pytest.param(
            lambda p: p.write_text(p.read_text().replace('"format": 2', '"format": 3')), "has format 3", id="format-3"
        ),
        pytest.param(
            lambda p: p.write_text(p.read_text().replace('"vocab": 300', '"vocab": 512')),
            "was trained for vocab 512",
            id="other-vocab",
        ),
    ],
)
def test_bad_tokenizer_cache_is_refused_naming_the_file(tmp_path, write, msg):
    p = tmp_path / "bpe300-0123.v2.json"
    tokenizer.write_cache(p, _tok_json(), 300, "ab" * 20)
    assert tokenizer.read_cache(p, 300, "ab" * 20) == _tok_json()
    write(p)
    with pytest.raises(ValueError, match=msg) as e:
        tokenizer.read_cache(p, 300, "ab" * 20)
    assert str(p) in str(e.value) and "delete it" in str(e.value)


def test_tokenizer_cache_for_other_training_text_is_refused(tmp_path):
    p = tmp_path / "bpe300-x.v2.json"
    tokenizer.write_cache(p, _tok_json(), 300, "ab" * 20)
    with pytest.raises(ValueError, match=f"tokenizer cache {p} was trained for vocab 300 on training text abab"):
        tokenizer.read_cache(p, 300, "cd" * 20)


# ----------------------------------------------------------------------------------------------
# the study's JSONL results


def _summarize():
    spec = importlib.util.spec_from_file_location("study_summarize", ROOT / "study" / "summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "text, msg",
    [
        pytest.param('{"seed": 0}\n{"seed": 1, "final_lo', r"r.jsonl:2: not a JSON record", id="cut-off-line"),
        pytest.param('{"seed": 0}\n\n[1, 2]\n', r"r.jsonl:3: a list, not a run record", id="not-an-object"),
    ],
)
def test_study_results_with_a_bad_line_name_file_and_line(tmp_path, text, msg):
    s = _summarize()
    (tmp_path / "r.jsonl").write_text(text)
    with pytest.raises(ValueError, match=msg):
        s.read_jsonl(tmp_path / "r.jsonl")
    (tmp_path / "r.jsonl").write_text('{"seed": 0}\n\n{"seed": 1}\n')
    assert s.read_jsonl(tmp_path / "r.jsonl") == [{"seed": 0}, {"seed": 1}]


@pytest.mark.parametrize("how", [pytest.param("truncated", id="truncated"), pytest.param("empty", id="empty")])
def test_cli_names_a_bad_tokenizer_cache(tmp_path, capsys, how):
    pytest.importorskip("tokenizers")
    out = tmp_path / "out"
    args = ["--out", str(out), "--mode", "ddp", "--vocab", "300", "-R", "1"]
    assert main(CLI_SMALL + args) == 0
    (cache,) = out.glob("bpe300-*.v2.json")
    cache.write_bytes(b"" if how == "empty" else cache.read_bytes()[:100])
    tokenizer._MEMO.clear()  # as a new process would start
    err = _refused(args, capsys)
    assert f"tokenizer cache {cache}" in err and "delete it" in err
