"""BPE tokens for the reference loop (`--vocab N`): a byte-level BPE trained on the training split.

The tokenizer is Hugging Face `tokenizers`' BPE over the GPT-2 byte alphabet (ByteLevel
pre-tokenizer, GPT-2 split regex, no special tokens): every byte string has an encoding, and each
token stands for a known number of bytes. It is trained at first use on the training split only
(never the held-out one), in seconds, with nothing downloaded, and saved as
`bpe<N>-<sha1 of the training bytes>.v2.json` in a cache folder (the CLI uses the run's --out), so
a second run on the same data and vocabulary loads it instead. The cache file is a small JSON
envelope: {"format": 2, "vocab": N, "train_sha1": …, "sha256": …, "tokenizer": the tokenizer's
own JSON}; a cache that is empty, cut short, edited or made for other data is refused with its
path and what is wrong (delete it to retrain).

Held-out loss stays in nats per byte: the summed cross-entropy over the held-out target tokens
divided by the number of bytes those tokens stand for (`Corpus.token_bytes`), so byte-level and
BPE runs compare on one scale.

`tokenizers` is an optional dependency (`pip install -e ".[train]"`); byte-level runs do not need it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from .data import Corpus

BYTE_VOCAB = 256  # the byte-level model: no tokenizer
MAX_VOCAB = 1 << 18  # 262,144 tokens: above any common LM vocabulary; the trainer's memory grows with it
CACHE_FORMAT = 2
_CHUNK = 1 << 16  # characters per piece handed to the trainer / encoder
_MEMO: dict[tuple[str, int, str], Corpus] = {}


def check_vocab(vocab) -> None:
    """256 (bytes, the default) or an integer in (256, MAX_VOCAB] (a BPE vocabulary of that size)."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not BYTE_VOCAB <= vocab <= MAX_VOCAB:
        raise ValueError(
            f"vocab must be {BYTE_VOCAB} (byte-level) or an integer in {BYTE_VOCAB + 1}..{MAX_VOCAB} (BPE), "
            f"got {vocab!r}"
        )
    if vocab > BYTE_VOCAB:
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ValueError(f'vocab {vocab} needs the `tokenizers` package: pip install -e ".[train]"') from None


def _pieces(text: str) -> list[str]:
    """The text in pieces of about _CHUNK characters, cut after a newline where there is one."""
    out, i = [], 0
    while i < len(text):
        j = min(len(text), i + _CHUNK)
        if j < len(text):
            nl = text.rfind("\n", i, j)
            j = nl + 1 if nl > i else j
        out.append(text[i:j])
        i = j
    return out


def _new_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(text: str, vocab: int):
    """A byte-level BPE tokenizer with `vocab` tokens trained on `text`."""
    from tokenizers import pre_tokenizers, trainers

    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_pieces(text), trainer=trainer)
    return tok


def token_bytes(tok) -> torch.Tensor:
    """Bytes each token id stands for (float64 [vocab]): ByteLevel maps one byte to one character."""
    n = tok.get_vocab_size()
    lens = [len(tok.id_to_token(i) or "") for i in range(n)]
    if min(lens) < 1:
        raise ValueError("tokenizer has an empty or missing token; expected a byte-level BPE")
    return torch.tensor(lens, dtype=torch.float64)


def write_cache(path: Path, tokenizer_json: str, vocab: int, train_sha1: str) -> None:
    """Save a trained tokenizer's JSON in the cache envelope, atomically (parallel runs never read
    half a file)."""
    blob = {
        "format": CACHE_FORMAT,
        "vocab": vocab,
        "train_sha1": train_sha1,
        "sha256": hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest(),
        "tokenizer": tokenizer_json,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(blob), encoding="utf-8")
    os.replace(tmp, path)


def read_cache(path: Path, vocab: int, train_sha1: str) -> str:
    """The tokenizer JSON a cache file holds, checked: ValueError naming the file and what is wrong
    for an empty, truncated or edited file, another format, vocabulary or training text."""
    fix = "delete it to train the tokenizer again"
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"tokenizer cache {path} cannot be read ({e.strerror}); {fix}") from None
    if not raw:
        raise ValueError(f"tokenizer cache {path} is empty (0 bytes); {fix}")
    try:
        blob = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"tokenizer cache {path} is not valid JSON ({e}): truncated or corrupted; {fix}") from None
    missing = [
        k
        for k in ("format", "vocab", "train_sha1", "sha256", "tokenizer")
        if not isinstance(blob, dict) or k not in blob
    ]
    if missing:
        raise ValueError(f"tokenizer cache {path} lacks {', '.join(missing)}: not a cache this loop wrote; {fix}")
    if blob["format"] != CACHE_FORMAT:
        raise ValueError(f"tokenizer cache {path} has format {blob['format']!r}, this loop reads {CACHE_FORMAT}; {fix}")
    if blob["vocab"] != vocab or blob["train_sha1"] != train_sha1:
        raise ValueError(
            f"tokenizer cache {path} was trained for vocab {blob['vocab']!r} on training text "
            f"{str(blob['train_sha1'])[:16]}, not vocab {vocab} on {train_sha1[:16]}; {fix}"
        )
    text = blob["tokenizer"]
    if not isinstance(text, str) or hashlib.sha256(text.encode("utf-8")).hexdigest() != blob["sha256"]:
        raise ValueError(
            f"tokenizer cache {path}: the tokenizer does not match its sha256 (corrupted or edited); {fix}"
        )
    return text


def _encode(tok, text: str) -> torch.Tensor:
    ids = []
    for enc in tok.encode_batch(_pieces(text), add_special_tokens=False):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


def _text(stream: torch.Tensor) -> str:
    # load_corpus keeps every document valid UTF-8; "replace" only guards hand-made corpora
    return bytes(stream.numpy().tobytes()).decode("utf-8", errors="replace")


def tokenize(corpus: Corpus, vocab: int, cache_dir: str | os.PathLike | None = None) -> Corpus:
    """The corpus as BPE token ids (int32 streams), with `token_bytes`; byte-level if vocab is 256.

    The tokenizer is trained on corpus.train, or loaded from cache_dir when an earlier run trained
    it on the same bytes; cache_dir None keeps it in memory only.
    """
    check_vocab(vocab)
    if vocab == BYTE_VOCAB:
        return corpus
    if corpus.vocab != BYTE_VOCAB:
        raise ValueError(f"corpus is already tokenized (vocab {corpus.vocab})")
    sha = hashlib.sha1(corpus.train.numpy().tobytes()).hexdigest()
    path = None if cache_dir is None else Path(cache_dir) / f"bpe{vocab}-{sha[:16]}.v2.json"
    memo = _MEMO.get((sha, vocab, str(path)))  # the configs of one sweep share one tokenization
    if memo is not None and torch.equal(memo.heldout_bytes, corpus.heldout):
        return memo
    from tokenizers import Tokenizer

    train_text = _text(corpus.train)
    cached = path is not None and path.is_file()
    if cached:
        text = read_cache(path, vocab, sha)
        try:
            tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for a JSON it cannot use
            raise ValueError(f"tokenizer cache {path}: not a tokenizer ({e}); delete it to retrain") from None
    else:
        tok = train_bpe(train_text, vocab)
        if path is not None:
            write_cache(path, tok.to_str(), vocab, sha)
    where = f"tokenizer cache {path}" if cached else "BPE training"
    if tok.get_vocab_size() != vocab:
        raise ValueError(
            f"{where} reached {tok.get_vocab_size()} tokens, not {vocab}"
            + (
                ""
                if cached
                else ": the training text is too small for this vocabulary; use more data or a smaller --vocab"
            )
        )
    try:
        tb = token_bytes(tok)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    train = _encode(tok, train_text)
    if tb[train.long()].sum() != len(train_text.encode("utf-8")):  # each token stands for its bytes
        raise ValueError(f"{where}: the tokens do not cover the training bytes exactly; expected a byte-level BPE")
    out = replace(
        corpus,
        train=train,
        heldout=_encode(tok, _text(corpus.heldout)),
        vocab=vocab,
        token_bytes=tb,
        tokenizer_path=None if path is None else str(path),
        tokenizer_cached=cached,
        heldout_bytes=corpus.heldout,
    )
    _MEMO[(sha, vocab, str(path))] = out
    return out
