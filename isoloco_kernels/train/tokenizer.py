"""BPE tokens for the reference loop (`--vocab N`): a byte-level BPE trained on the training split.

The tokenizer is Hugging Face `tokenizers`' BPE over the GPT-2 byte alphabet (ByteLevel
pre-tokenizer, GPT-2 split regex, no special tokens): every byte string has an encoding, and each
token stands for a known number of bytes. It is trained at first use on the training split only
(never the held-out one), in seconds, with nothing downloaded, and saved as
`bpe<N>-<sha1 of the training bytes>.json` in a cache folder (the CLI uses the run's --out), so a
second run on the same data and vocabulary loads it instead.

Held-out loss stays in nats per byte: the summed cross-entropy over the held-out target tokens
divided by the number of bytes those tokens stand for (`Corpus.token_bytes`), so byte-level and
BPE runs compare on one scale.

`tokenizers` is an optional dependency (`pip install -e ".[train]"`); byte-level runs do not need it.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import torch

from .data import Corpus

BYTE_VOCAB = 256  # the byte-level model: no tokenizer
_CHUNK = 1 << 16  # characters per piece handed to the trainer / encoder
_MEMO: dict[tuple[str, int, str], Corpus] = {}


def check_vocab(vocab) -> None:
    """256 (bytes, the default) or an integer > 256 (a BPE vocabulary of that size)."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < BYTE_VOCAB:
        raise ValueError(
            f"vocab must be {BYTE_VOCAB} (byte-level) or an integer > {BYTE_VOCAB} (BPE), got {vocab!r}"
        )
    if vocab > BYTE_VOCAB:
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ValueError(
                f"vocab {vocab} needs the `tokenizers` package: pip install -e \".[train]\""
            ) from None


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
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
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
    path = None if cache_dir is None else Path(cache_dir) / f"bpe{vocab}-{sha[:16]}.json"
    memo = _MEMO.get((sha, vocab, str(path)))  # the configs of one sweep share one tokenization
    if memo is not None and torch.equal(memo.heldout_bytes, corpus.heldout):
        return memo
    from tokenizers import Tokenizer

    train_text = _text(corpus.train)
    if path is not None and path.is_file():
        tok = Tokenizer.from_file(str(path))
        cached = True
    else:
        tok = train_bpe(train_text, vocab)
        cached = False
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tok.save(str(tmp))
            os.replace(tmp, path)  # atomic: parallel runs never read half a file
    if tok.get_vocab_size() != vocab:
        raise ValueError(
            f"BPE training reached {tok.get_vocab_size()} tokens, not {vocab}: the training text is too "
            "small for this vocabulary; use more data or a smaller --vocab"
        )
    tb = token_bytes(tok)
    out = replace(
        corpus, train=_encode(tok, train_text), heldout=_encode(tok, _text(corpus.heldout)), vocab=vocab,
        token_bytes=tb, tokenizer_path=None if path is None else str(path), tokenizer_cached=cached,
        heldout_bytes=corpus.heldout,
    )
    _MEMO[(sha, vocab, str(path))] = out
    return out
