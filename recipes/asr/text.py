"""Transcript normalization and tokenizers (characters, or SentencePiece BPE) for CTC, any language.

Normalization, applied to every transcript (training targets and references alike):
  1. Unicode NFKC: one code point per accented letter (é typed as e + U+0301 or as U+00E9 gives the
     same ids), and compatibility forms folded to what is read aloud (ﬁ → fi, full-width and
     superscript digits, no-break spaces). NFKC rather than NFC because those forms are the same
     spoken text; NFC would keep them as separate, rarely seen symbols;
  2. lowercase; the apostrophes ’ ‘ ʼ become ';
  3. every character other than a letter, a combining mark, a decimal digit or the apostrophe
     becomes a space (punctuation is not spoken; digits are: "appuyez sur 1");
  4. runs of spaces collapse to one; leading/trailing spaces are removed;
  5. the run's `--char_map` (if any) replaces characters, e.g. œ → oe.
So "MR. O'BRIEN'S well-known CAFÉ" → "mr o'brien's well known café". LibriSpeech transcripts
(A-Z, apostrophe, space) and the built-in corpus only change case.

Characters: the symbols are " '" and a-z (ids 1-28, the same for every corpus, so an English model
keeps its ids), then every other character of the normalized training transcripts in code-point
order (é, ç, digits, Cyrillic ...). BPE: SentencePiece trained on the normalized training
transcripts (every character they hold is a piece). A validation or test transcript with a
character the model cannot emit (never seen in training) is refused, naming the characters
(`check_transcripts`), or with `--unknown_chars drop` the character is removed from that
transcript's target and reference.

Token ids: 0 is the CTC blank; real tokens are 1..vocab_size-1. A tokenizer lives in a folder
(`tokenizer.json` with the symbols and the character map, plus `bpe.model` for BPE), written once
per run into `<output_dir>/tokenizer/` and copied into `final/tokenizer/`: resume, decode and the
export all read it from there.
"""

from __future__ import annotations

import io
import json
import logging
import unicodedata
from collections import Counter
from pathlib import Path

BLANK = 0
CHARS = " '" + "abcdefghijklmnopqrstuvwxyz"  # ids 1..28 in every character vocabulary
_APOSTROPHES = str.maketrans({"’": "'", "‘": "'", "ʼ": "'"})


def _kept(c: str) -> bool:
    return c == "'" or unicodedata.category(c)[0] in "LM" or unicodedata.category(c) == "Nd"


def normalize_text(text: str, char_map: dict[str, str] | None = None) -> str:
    text = unicodedata.normalize("NFKC", text).lower().translate(_APOSTROPHES)
    text = " ".join("".join(c if _kept(c) else " " for c in text).split())
    return " ".join(text.translate(str.maketrans(char_map)).split()) if char_map else text


def read_char_map(path: str | Path) -> dict[str, str]:
    """`--char_map` file: one `<character> <replacement>` per line (no replacement: the character is
    removed; `#` starts a comment line). Keys and replacements are normalized like transcripts."""
    mapping = {}
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, _, value = line.strip().partition(" ")
        key = normalize_text(key)
        if len(key) != 1:
            raise ValueError(f"--char_map {path}:{n}: expected one character then its replacement, got {line!r}")
        mapping[key] = normalize_text(value)
    return mapping


class _Normalizing:
    """What both tokenizers share: the character map and the characters they can emit."""

    char_map: dict[str, str]
    charset: set[str]  # the characters this tokenizer can emit

    def normalize(self, text: str) -> str:
        """Target and reference text: normalized, characters the model cannot emit removed
        (`check_transcripts` refused them before, unless --unknown_chars drop)."""
        return " ".join("".join(c for c in normalize_text(text, self.char_map) if c in self.charset).split())


class CharTokenizer(_Normalizing):
    """One token per character: CHARS, then `extra` characters (from the training transcripts)."""

    kind = "char"

    def __init__(self, extra: str = "", char_map: dict[str, str] | None = None):
        self.vocab = ["<blank>", *CHARS, *extra]
        self.index = {c: i for i, c in enumerate(self.vocab)}
        if len(self.index) != len(self.vocab):
            raise ValueError(f"character vocabulary has duplicates: {self.vocab}")
        self.char_map = dict(char_map or {})
        self.charset = set(self.vocab[1:])

    @classmethod
    def from_texts(cls, texts: list[str], char_map: dict[str, str] | None = None) -> CharTokenizer:
        seen = set().union(*(normalize_text(t, char_map) for t in texts))
        return cls("".join(sorted(seen - set(CHARS))), char_map)

    @property
    def vocab_size(self) -> int:  # including the blank
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self.index[c] for c in self.normalize(text)]

    def decode(self, ids: list[int]) -> str:
        return " ".join("".join(self.vocab[i] for i in ids if i != BLANK).split())

    def save(self, folder: Path) -> None:
        (Path(folder) / "tokenizer.json").write_text(json.dumps(
            {"type": "char", "vocab": self.vocab, "char_map": self.char_map}, ensure_ascii=False, indent=1))


class BpeTokenizer(_Normalizing):
    """SentencePiece BPE; our id = SentencePiece id + 1 (SentencePiece's 0 is <unk>, ours the blank)."""

    kind = "bpe"

    def __init__(self, model_file: Path, char_map: dict[str, str] | None = None):
        import sentencepiece as spm

        self.model_file = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self.char_map = dict(char_map or {})
        pieces = (self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size()) if not self.sp.is_unknown(i))
        self.charset = set("".join(pieces).replace("▁", " ")) | {" "}

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size() + 1

    def encode(self, text: str) -> list[int]:
        return [i + 1 for i in self.sp.encode(self.normalize(text))]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.sp.decode([i - 1 for i in ids if i != BLANK]).split())

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        if self.model_file.resolve() != (folder / "bpe.model").resolve():
            (folder / "bpe.model").write_bytes(self.model_file.read_bytes())
        (folder / "tokenizer.json").write_text(json.dumps(
            {"type": "bpe", "model": "bpe.model", "char_map": self.char_map}, ensure_ascii=False, indent=1))


def train_bpe(texts: list[str], folder: Path, vocab_size: int, char_map: dict[str, str] | None = None) -> BpeTokenizer:
    """Train SentencePiece BPE on normalized `texts` into `folder/bpe.model` (deterministic: 1 thread)."""
    import sentencepiece as spm

    model = io.BytesIO()  # not model_prefix: the model would record its (temporary) path
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([normalize_text(t, char_map) for t in texts]), model_writer=model,
        model_type="bpe", vocab_size=vocab_size, character_coverage=1.0, num_threads=1,
        normalization_rule_name="identity",  # our normalize_text already did it
        bos_id=-1, eos_id=-1, unk_id=0,
        hard_vocab_limit=False,  # a small corpus may not support vocab_size pieces: fewer is fine
        minloglevel=2,
    )
    (Path(folder) / "bpe.model").write_bytes(model.getvalue())
    tokenizer = BpeTokenizer(Path(folder) / "bpe.model", char_map)
    tokenizer.save(folder)
    return tokenizer


def build_tokenizer(kind: str, texts: list[str], folder: Path, bpe_vocab_size: int,
                    char_map: dict[str, str] | None = None):
    """Write a `kind` tokenizer ("char" | "bpe"), its symbols taken from `texts`, into `folder`."""
    if kind == "char":
        CharTokenizer.from_texts(texts, char_map).save(folder)
    elif kind == "bpe":
        train_bpe(texts, folder, bpe_vocab_size, char_map)
    else:
        raise ValueError(f"unknown token_type {kind!r}: 'char' or 'bpe'")


def load_tokenizer(folder: str | Path):
    folder = Path(folder)
    meta = json.loads((folder / "tokenizer.json").read_text())
    char_map = meta.get("char_map", {})
    if meta["type"] == "char":
        vocab = meta["vocab"]
        if vocab[: len(CHARS) + 1] != ["<blank>", *CHARS]:
            raise ValueError(f"{folder}: not a character vocabulary of this code (blank, then {CHARS!r} first)")
        return CharTokenizer("".join(vocab[len(CHARS) + 1:]), char_map)
    return BpeTokenizer(folder / meta["model"], char_map)


def tokenizer_dir(folder: Path) -> Path:
    """Where the tokenizer of a checkpoint folder lives (see `checkpoint_tokenizer`)."""
    folder = Path(folder)
    return folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder.parent.parent / "tokenizer"


def checkpoint_tokenizer(folder: Path):
    """The tokenizer of a verified checkpoint folder (`common.training.sealing.resolve_checkpoint`): final/
    carries its own tokenizer/; a checkpoints/step_XXXXXXXX/ folder uses its run's
    <output_dir>/tokenizer/, two levels up. A step folder copied out of its run has none there:
    `UsageError` (one line, exit code 2) saying what it needs."""
    from common.training.faults import UsageError

    tok_dir = tokenizer_dir(folder)
    if not (tok_dir / "tokenizer.json").is_file():
        raise UsageError(f"--checkpoint {folder}: no tokenizer for it at {tok_dir}/tokenizer.json (a checkpoints/"
                         f"step_*/ folder uses its run's <output_dir>/tokenizer/): give the run's output_dir or its "
                         f"final/ (which carries its tokenizer), or the step folder inside its run folder")
    try:
        return load_tokenizer(tok_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:  # json's errors are ValueErrors
        raise UsageError(f"--checkpoint {folder}: its tokenizer {tok_dir} cannot be read ({type(e).__name__}: "
                         f"{e}): re-run the training command that made it (same --output_dir)") from None


def check_transcripts(ids: list[str], texts: list[str], tokenizer, split: str, unknown_chars: str) -> None:
    """Refuse (`unknown_chars="error"`: a ValueError, one line) a `split` whose normalized transcripts
    hold characters `tokenizer` cannot emit; with "drop", log them (`tokenizer.normalize` drops them)."""
    counts, first = Counter(), {}
    for utt_id, text in zip(ids, texts):
        for c in sorted(set(normalize_text(text, tokenizer.char_map)) - tokenizer.charset):
            counts[c] += 1
            first.setdefault(c, utt_id)
    if not counts:
        return
    listed = ", ".join(f"{c!r} (U+{ord(c):04X}) in {n} transcript(s), e.g. {first[c]}" for c, n in counts.most_common())
    if unknown_chars == "error":
        raise ValueError(f"{split}: characters the model cannot emit (absent from the training transcripts): "
                         f"{listed}; --unknown_chars drop removes them, --char_map FILE maps them")
    logging.getLogger(__name__).warning(f"{split}: removing characters the model cannot emit: {listed}")
