"""Transcript normalization and tokenizers (characters, or SentencePiece BPE) for CTC.

Normalization, applied to every transcript (training targets and references alike):
  1. Unicode NFKD, then accents dropped (é → e);
  2. lowercase;
  3. every character other than a-z and the apostrophe becomes a space;
  4. runs of spaces collapse to one; leading/trailing spaces are removed.
So "MR. O'BRIEN'S well-known CAFÉ" → "mr o'brien's well known cafe". LibriSpeech transcripts
(A-Z, apostrophe, space) only change case.

Token ids: 0 is the CTC blank; real tokens are 1..vocab_size-1. A tokenizer lives in a folder
(`tokenizer.json`, plus `bpe.model` for BPE), written once per run into `<output_dir>/tokenizer/`
and copied into `final/tokenizer/`.
"""

from __future__ import annotations

import io
import json
import re
import unicodedata
from pathlib import Path

BLANK = 0
CHARS = " '" + "abcdefghijklmnopqrstuvwxyz"  # the whole normalized alphabet
_NOT_ALPHABET = re.compile(r"[^a-z' ]")


def normalize_text(text: str) -> str:
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    return " ".join(_NOT_ALPHABET.sub(" ", text).split())


class CharTokenizer:
    """One token per character of the normalized alphabet (28 + blank = 29 classes)."""

    kind = "char"

    def __init__(self):
        self.vocab = ["<blank>", *CHARS]
        self.index = {c: i for i, c in enumerate(self.vocab)}

    @property
    def vocab_size(self) -> int:  # including the blank
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in normalize_text(text)]

    def decode(self, ids: list[int]) -> str:
        return " ".join("".join(self.vocab[i] for i in ids if i != BLANK).split())

    def save(self, folder: Path) -> None:
        (Path(folder) / "tokenizer.json").write_text(json.dumps({"type": "char", "vocab": self.vocab}, indent=1))


class BpeTokenizer:
    """SentencePiece BPE; our id = SentencePiece id + 1 (SentencePiece's 0 is <unk>, ours the blank)."""

    kind = "bpe"

    def __init__(self, model_file: Path):
        import sentencepiece as spm

        self.model_file = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size() + 1

    def encode(self, text: str) -> list[int]:
        return [i + 1 for i in self.sp.encode(normalize_text(text))]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.sp.decode([i - 1 for i in ids if i != BLANK]).split())

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        if self.model_file.resolve() != (folder / "bpe.model").resolve():
            (folder / "bpe.model").write_bytes(self.model_file.read_bytes())
        (folder / "tokenizer.json").write_text(json.dumps({"type": "bpe", "model": "bpe.model"}, indent=1))


def train_bpe(texts: list[str], folder: Path, vocab_size: int) -> BpeTokenizer:
    """Train SentencePiece BPE on normalized `texts` into `folder/bpe.model` (deterministic: 1 thread)."""
    import sentencepiece as spm

    model = io.BytesIO()  # not model_prefix: the model would record its (temporary) path
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([normalize_text(t) for t in texts]), model_writer=model,
        model_type="bpe", vocab_size=vocab_size, character_coverage=1.0, num_threads=1,
        normalization_rule_name="identity",  # our normalize_text already did it
        bos_id=-1, eos_id=-1, unk_id=0,
        hard_vocab_limit=False,  # a small corpus may not support vocab_size pieces: fewer is fine
        minloglevel=2,
    )
    (Path(folder) / "bpe.model").write_bytes(model.getvalue())
    tokenizer = BpeTokenizer(Path(folder) / "bpe.model")
    tokenizer.save(folder)
    return tokenizer


def build_tokenizer(kind: str, texts: list[str], folder: Path, bpe_vocab_size: int):
    """Write a `kind` tokenizer ("char" | "bpe", trained on `texts`) into `folder`."""
    if kind == "char":
        CharTokenizer().save(folder)
    elif kind == "bpe":
        train_bpe(texts, folder, bpe_vocab_size)
    else:
        raise ValueError(f"unknown token_type {kind!r}: 'char' or 'bpe'")


def load_tokenizer(folder: str | Path):
    folder = Path(folder)
    meta = json.loads((folder / "tokenizer.json").read_text())
    if meta["type"] == "char":
        tokenizer = CharTokenizer()
        if meta["vocab"] != tokenizer.vocab:
            raise ValueError(f"{folder}: character vocabulary differs from this code's")
        return tokenizer
    return BpeTokenizer(folder / meta["model"])
