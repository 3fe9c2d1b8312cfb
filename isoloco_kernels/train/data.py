"""Byte-level text data: the built-in corpus, train/held-out split, per-worker shards and batches.

The built-in corpus is the source of Python's own standard library, read from the running
interpreter (``sysconfig.get_paths()["stdlib"]``): real text, nothing downloaded. Files are
visited in a fixed pseudo-random order (sha1 of the relative path), so a byte cap samples the whole
library instead of its alphabetical head. Each document goes to the held-out set when the sha1 of
its name says so, which keeps the split stable across runs, machines and caps.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

HELDOUT_PERCENT = 10  # share of documents (by name hash) held out
SINGLE_FILE_CHUNK = 1 << 14  # fewer than 10 files are cut into 16 KiB documents before the split
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git"}


def _h(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode("utf-8", "surrogateescape")).digest()[:8], "big")


def _is_text(data: bytes) -> bool:
    if b"\0" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _cut(data: bytes, n: int) -> bytes:
    """data[:n], shortened by at most 3 bytes so a multi-byte UTF-8 character is not cut in two.

    Only a character the cut made incomplete is dropped: bytes that are not UTF-8 anyway stay, so
    `_is_text` still calls them binary.
    """
    if n >= len(data):
        return data
    head = data[:n]
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data" and e.end == len(head) and len(head) - e.start <= 3:
            return head[: e.start]
    return head


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in filenames:
            if f.endswith(".py"):
                p = Path(dirpath, f)
                out.append((p.relative_to(root).as_posix(), p))
    return out


def _folder_files(root: Path) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in _SKIP_DIRS)
        for f in filenames:
            p = Path(dirpath, f)
            if not f.startswith(".") and p.is_file():
                out.append((p.relative_to(root).as_posix(), p))
    return out


@dataclass
class Corpus:
    """Train and held-out streams and where they came from.

    Byte-level (vocab 256): uint8 byte streams. After `tokenizer.tokenize`: int32 token-id streams,
    `token_bytes[i]` the number of bytes token i stands for, `heldout_bytes` the held-out bytes.
    """

    train: torch.Tensor
    heldout: torch.Tensor
    source: str
    n_docs: int
    n_heldout_docs: int
    vocab: int = 256
    token_bytes: torch.Tensor | None = None
    heldout_bytes: torch.Tensor | None = None
    tokenizer_path: str | None = None
    tokenizer_cached: bool = False

    @property
    def unit(self) -> str:
        return "bytes" if self.vocab == 256 else "tokens"

    def describe(self) -> dict:
        if self.vocab == 256:
            return {
                "source": self.source,
                "docs": self.n_docs,
                "heldout_docs": self.n_heldout_docs,
                "train_bytes": int(self.train.numel()),
                "heldout_bytes": int(self.heldout.numel()),
            }
        return {
            "source": self.source,
            "docs": self.n_docs,
            "heldout_docs": self.n_heldout_docs,
            "train_bytes": int(self.token_bytes[self.train.long()].sum().item()),
            "heldout_bytes": int(self.heldout_bytes.numel()),
            "vocab": self.vocab,
            "tokenizer": {
                "kind": "bpe (HF tokenizers, byte-level)",
                "path": self.tokenizer_path,
                "loaded_from_cache": self.tokenizer_cached,
            },
            "train_tokens": int(self.train.numel()),
            "heldout_tokens": int(self.heldout.numel()),
        }


def _pieces(d: bytes) -> list[bytes]:
    """d in SINGLE_FILE_CHUNK-byte pieces, each cut moved back (≤ 3 bytes) to a UTF-8 character start."""
    out, o = [], 0
    while o < len(d):
        end = min(len(d), o + SINGLE_FILE_CHUNK)
        back = end
        while back < len(d) and back > end - 3 and (d[back] & 0xC0) == 0x80:  # a continuation byte
            back -= 1
        if back < len(d) and (d[back] & 0xC0) != 0x80:
            end = back
        out.append(d[o:end])
        o = end
    return out


def _split(docs: list[tuple[str, bytes]], source: str) -> Corpus:
    if len(docs) < 10:  # a lone file or a few: split by 16 KiB pieces instead of by file
        docs = [(f"{name}#{i}", piece) for name, d in docs for i, piece in enumerate(_pieces(d))]
    train, held = [], []
    for name, data in docs:
        (held if _h("split:" + name) % 100 < HELDOUT_PERCENT else train).append(data)
    if not held or not train:  # too few documents for the hash to fill both sides
        if len(docs) < 2:
            raise ValueError(
                f"data {source}: {sum(len(d) for _, d in docs)} bytes of text is too little to split "
                f"into train and held-out parts (need more than {SINGLE_FILE_CHUNK} bytes)"
            )
        train, held = [d for _, d in docs[:-1]], [docs[-1][1]]
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8)
    return Corpus(as_tensor(train), as_tensor(held), source, len(docs), len(held))


def load_corpus(path: str | os.PathLike | None = None, max_bytes: int = 4_000_000) -> Corpus:
    """Read at most ~max_bytes of text from `path` (a file or folder) or from the stdlib.

    Raises ValueError, before anything else happens, for a missing, empty or binary path.
    """
    if not isinstance(max_bytes, int) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    if path is None:
        root = stdlib_dir()
        files, source = _stdlib_files(root), f"python stdlib ({root})"
    else:
        root = Path(path)
        source = str(root)
        if not root.exists():
            raise ValueError(f"data path {source} does not exist")
        if root.is_file():
            data = _cut(root.read_bytes(), max_bytes)
            if not data.strip():
                raise ValueError(f"data file {source} is empty")
            if not _is_text(data):
                raise ValueError(f"data file {source} is not UTF-8 text (binary content); pass a text file or folder")
            return _split([(root.name, data)], source)
        files = _folder_files(root)
    docs, total, skipped = [], 0, 0
    for name, p in sorted(files, key=lambda t: (_h("order:" + t[0]), t[0])):
        if total >= max_bytes:
            break
        try:
            data = p.read_bytes()
        except OSError:
            skipped += 1
            continue
        if not data.strip():
            continue
        if not _is_text(data):
            skipped += 1
            continue
        data = _cut(data, max_bytes - total)
        if not data:  # the cap fell inside this file's first character
            break
        docs.append((name, data))
        total += len(data)
    if not docs:
        what = "binary or unreadable" if skipped else "empty"
        raise ValueError(f"data folder {source} holds no text: its {len(files)} files are {what}")
    return _split(docs, source)


def check_fits(corpus: Corpus, workers: int, batch: int, seq_len: int) -> None:
    """Every worker's shard must hold `batch` windows of seq_len+1 bytes (tokens after BPE); each
    half of the held-out stream (the selection and test splits) at least one."""
    win = seq_len + 1
    shard = corpus.train.numel() // workers
    u = getattr(corpus, "unit", "bytes")
    if batch * win > shard:
        raise ValueError(
            f"batch {batch} × sequence {seq_len} (+1) = {batch * win} {u} is larger than each of the "
            f"{workers} workers' data shard ({shard} of {corpus.train.numel()} train {u}); "
            "use more data, fewer workers, or a smaller batch/sequence"
        )
    if win > corpus.heldout.numel() // 2:
        raise ValueError(
            f"sequence {seq_len} (+1) is longer than each half of the held-out data (the selection and test "
            f"splits: {corpus.heldout.numel() // 2} of {corpus.heldout.numel()} {u})"
        )


def worker_shards(train: torch.Tensor, workers: int) -> list[torch.Tensor]:
    """K equal contiguous slices of the train stream (the tail that does not divide is dropped)."""
    n = train.numel() // workers
    return [train[k * n : (k + 1) * n] for k in range(workers)]


class Batches:
    """Random [batch, seq_len] windows (inputs, next-byte targets) from one shard, own RNG."""

    def __init__(self, shard: torch.Tensor, batch: int, seq_len: int, seed: int):
        self.shard, self.batch, self.seq_len = shard, batch, seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self._ar = torch.arange(seq_len + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        hi = self.shard.numel() - self.seq_len  # number of valid start positions
        start = torch.randint(0, hi, (self.batch, 1), generator=self.gen)
        w = self.shard[start + self._ar].long()
        return w[:, :-1], w[:, 1:]


def heldout_windows(heldout: torch.Tensor, seq_len: int, max_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to max_windows non-overlapping windows spread evenly over the held-out stream."""
    win = seq_len + 1
    fit = heldout.numel() // win
    n = max(1, min(max_windows, fit))
    starts = torch.linspace(0, fit - 1, n).long() * win
    w = heldout[starts.unsqueeze(1) + torch.arange(win)].long()
    return w[:, :-1], w[:, 1:]


def heldout_splits(heldout: torch.Tensor, seq_len: int, windows: int):
    """The selection and test splits: up to `windows` windows each (heldout_windows) from the first
    and the second half of the held-out stream, so the two never share a window and mostly not a
    document (documents are joined in hash order; at most the one across the middle is cut in two)."""
    half = heldout.numel() // 2
    return heldout_windows(heldout[:half], seq_len, windows), heldout_windows(heldout[half:], seq_len, windows)


def worker_seed(seed: int, worker: int) -> int:
    """The data-order seed of one worker: depends on (seed, worker) only, so every mode shares it."""
    return _h(f"data:{seed}:{worker}") % (1 << 62)
