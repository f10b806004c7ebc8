"""TTS text front end: text → symbols (characters, or espeak-ng phonemes of a language) → ids.

- `characters` (default): Unicode NFKC (é typed as e + U+0301 or as U+00E9 is one symbol; ligatures
  and full-width forms folded to what is read aloud), lowercase, ’ ‘ ʼ → ', whitespace collapsed.
  Each character is a symbol; punctuation stays (it shapes prosody).
- `phonemes`: that normalized text read by espeak-ng's phonemizer in `--phonemizer_language` (any
  espeak-ng voice: fr, es, it, ru, en-us, ...), IPA with stress and length marks, one symbol per
  code point (ʃ, ˈ, ː, the nasal ◌̃ ...); clauses joined by a space. espeak-ng drops punctuation;
  with `phoneme_punctuation` (config.yaml: true) the marks that end a clause are kept after its
  phonemes as one of two symbols, `,` for a clause inside a sentence (, ; :) and `.` for its end
  (. ? ! …): a recorded pause then has a symbol to be aligned to, instead of lengthening the phonemes
  beside it. Two symbols, because a voice of minutes has few `;` or `?` to learn from; a decimal
  point (3.5) is not a clause end; a mark the training transcripts never had (a table without `,`)
  is left out of other texts, as before the option: the model has no pause to give it.
  Not given for a voice of one's own, train.py reads the language off its training transcripts
  (`guess_language`: their function words), or refuses the run when they do not say.

The symbol table is `--symbols`: the characters allowed (default: English letters and punctuation),
or `auto`: every symbol of the training transcripts after the front end, in code-point order (with
phonemes it must be `auto`). The training run writes the table it used into its config.yaml
(checkpoints, final/) and final/symbols.json, so resume, synthesis and scoring use that table. A
validation or test transcript with a symbol outside the table is refused in one line naming it, or
with `--unknown_chars drop` the symbol is left out of that text.

Ids: 0 is padding; symbol i of the table is id i + 1.
"""

from __future__ import annotations

import ctypes
import re
import threading
import unicodedata
from collections import Counter

AUTO = "auto"
_APOSTROPHES = str.maketrans({"’": "'", "‘": "'", "ʼ": "'"})


def normalize(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).lower().translate(_APOSTROPHES).split())


# The most frequent short function words of some espeak-ng languages: in a few hundred transcripts
# they are a fifth to a third of the words of their own language and rare in the others.
FUNCTION_WORDS = {
    "en-us": "the a an and of to in is it you your that this for on with be are was not please",
    "fr": "le la les de des du et est un une vous votre pour que qui pas ne en au aux ce sur",
    "es": "el la los las de del y en un una por para su es que no se con al lo",
    "it": "il lo la i gli le di del della che e è per un una non si al con sono",
    "pt": "o os as do da dos das em um uma não você é na ao pelo com",
    "de": "der die das und ist nicht ein eine zu sie ich mit den dem des auf für bitte",
    "nl": "de het een en van is niet dat ik je u op te met voor",
    "ru": "и в не на что я с вы это по как он но к у из за",
    "uk": "і в не на що я з ви це по як він але до у із за",
    "pl": "i w nie na się że z to jest do jak o co po",
}


def guess_language(texts: list[str], min_share: float = 0.08, margin: float = 1.5,
                   min_hits: int = 5) -> tuple[str | None, str]:
    """The espeak-ng language of `texts` (a voice's training transcripts) from FUNCTION_WORDS: the
    language whose words are the largest share of all words, if that share is at least `min_share`,
    `min_hits` words and `margin` × the runner-up's; else None. Also the shares, for the log or the refusal."""
    words = [w for t in texts for w in re.findall(r"[^\W\d_]+", normalize(t))]
    counts = Counter(words)
    shares = sorted(((sum(counts[w] for w in set(ws.split())) / max(len(words), 1), lang)
                     for lang, ws in FUNCTION_WORDS.items()), reverse=True)
    (best, lang), (second, runner_up) = shares[0], shares[1]
    why = f"function words: {best:.0%} {lang}, {second:.0%} {runner_up} of {len(words)} words"
    sure = best >= min_share and best * len(words) >= min_hits and best >= margin * second
    return (lang if sure else None), why


class Phonemizer:
    """espeak-ng's text → IPA, in one language, through ctypes on the library `espeakng-loader` ships."""

    _lock = threading.Lock()  # one library state per process
    _lib = None

    # A clause-ending mark: punctuation followed by a space or the end of the text (not 3.5 or a.m.).
    CLAUSE_END = re.compile(r"([,;:.?!…]+)(?=\s|$)")
    MARKS = ",."  # what the marks become: inside a sentence, its end

    def __init__(self, language: str, punctuation: bool = False):
        self.language, self.punctuation = language, punctuation
        with self._lock:
            self._load()
            if Phonemizer._lib.espeak_SetVoiceByName(language.encode()) != 0:
                raise ValueError(f"--phonemizer_language {language!r}: espeak-ng has no such voice "
                                 f"(e.g. fr, es, it, ru, en-us)")

    @classmethod
    def _load(cls):
        if cls._lib is not None:
            return
        import espeakng_loader

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_int]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        # 2: synchronous (no audio device); 0x8000: return an error instead of exit() when data is missing
        if lib.espeak_Initialize(2, 0, espeakng_loader.get_data_path().encode(), 0x8000) <= 0:
            raise RuntimeError("espeak-ng did not initialize (espeakng-loader's data folder)")
        cls._lib = lib

    def __call__(self, text: str) -> str:
        if not self.punctuation:
            return self._phonemes(text)
        # "la clave, de entrada." → ["la clave", ",", " de entrada", ".", ""]: each clause read alone
        # (espeak-ng splits there too), each mark kept after it as written
        parts = self.CLAUSE_END.split(text)
        out = []
        for clause, mark in zip(parts[::2], parts[1::2] + [""]):
            phonemes = self._phonemes(clause)
            if phonemes or out:  # a mark before any speech ("... hola") is dropped: no pause to align it to
                out.append(phonemes + ("" if not mark else "." if set(mark) & set(".?!…") else ","))
        return " ".join(" ".join(out).split())

    def _phonemes(self, text: str) -> str:
        with self._lock:
            lib = Phonemizer._lib
            lib.espeak_SetVoiceByName(self.language.encode())  # another Phonemizer may have changed it
            buf = ctypes.create_string_buffer(text.encode())
            pointer = ctypes.c_char_p(ctypes.addressof(buf))  # advanced clause by clause by espeak-ng
            clauses = []
            while pointer.value:
                # 1: UTF-8 text; 0x02: IPA phoneme names
                clauses.append(lib.espeak_TextToPhonemes(ctypes.byref(pointer), 1, 0x02).decode())
        return " ".join(" ".join(clauses).split())


class Symbols:
    """Text → ids through the front end; `unknown="drop"` leaves out symbols outside the table,
    "error" refuses them (never silently dropped unless asked)."""

    def __init__(self, table: str, frontend: str = "characters", language: str | None = None,
                 unknown: str = "error", punctuation: bool = False):
        if len(set(table)) != len(table):
            raise ValueError(f"symbol table has duplicates: {table!r}")
        if frontend == "phonemes" and not language:
            raise ValueError("--text_frontend phonemes needs --phonemizer_language (an espeak-ng voice: fr, es, it, ru, en-us ...)")
        self.chars, self.frontend, self.unknown = table, frontend, unknown
        self.index = {c: i + 1 for i, c in enumerate(table)}
        self.phonemize = Phonemizer(language, punctuation) if frontend == "phonemes" else None
        # clause marks the phonemizer writes that this table lacks: left out of the texts (module docstring)
        self.absent_marks = "".join(c for c in Phonemizer.MARKS if c not in self.index) if self.phonemize and punctuation else ""

    @classmethod
    def from_config(cls, cfg, table: str | None = None) -> Symbols:
        """The front end a config describes (a namespace from an older config.yaml: characters, no marks)."""
        return cls(table if table is not None else cfg.symbols, getattr(cfg, "text_frontend", "characters"),
                   getattr(cfg, "phonemizer_language", None), getattr(cfg, "unknown_chars", "error"),
                   getattr(cfg, "phoneme_punctuation", False))

    @classmethod
    def derived(cls, cfg, texts: list[str]) -> Symbols:
        """`cfg.symbols`, or with `auto` the symbols of `texts` (the training transcripts) after the front end."""
        if cfg.symbols != AUTO:
            if getattr(cfg, "text_frontend", "characters") == "phonemes":
                raise ValueError("--text_frontend phonemes takes its symbols from the phonemized training "
                                 "transcripts: add --symbols auto")
            return cls.from_config(cfg)
        probe = cls.from_config(cfg, table="")
        return cls.from_config(cfg, table="".join(sorted(set().union(*(probe._units(t, all_marks=True) for t in texts)))))

    def __len__(self) -> int:
        return len(self.chars) + 1  # with padding

    def normalize(self, text: str) -> str:
        """The normalized text (idempotent: score.py shows it and synthesizes from it)."""
        return normalize(text)

    def _units(self, text: str, all_marks: bool = False) -> str:
        """The front end's symbols of `text`, without the clause marks the table lacks unless `all_marks`."""
        text = normalize(text)
        if self.phonemize is None:
            return text
        units = self.phonemize(text)
        if self.absent_marks and not all_marks:
            units = " ".join(units.translate({ord(c): None for c in self.absent_marks}).split())
        return units

    def units(self, text: str) -> str:
        """What the model reads: the symbols of `text` (characters or phonemes), those outside the
        table left out with unknown="drop"."""
        units = self._units(text)
        return "".join(c for c in units if c in self.index) if self.unknown == "drop" else units

    def encode(self, text: str) -> list[int]:
        units = self.units(text)
        outside = sorted(set(units) - set(self.index))
        if outside:
            raise ValueError(f"characters outside the symbol table: {''.join(outside)!r} in {units!r}")
        if not units:
            raise ValueError("empty text")
        return [self.index[c] for c in units]

    def decode(self, ids) -> str:
        return "".join(self.chars[i - 1] for i in ids if i > 0)

    def check(self, ids: list[str], texts: list[str], split: str) -> None:
        """Refuse (ValueError, one line) a `split` with symbols outside the table, unless unknown="drop"."""
        counts, first = Counter(), {}
        for utt_id, text in zip(ids, texts):
            for c in sorted(set(self._units(text)) - set(self.index)):
                counts[c] += 1
                first.setdefault(c, utt_id)
        if counts and self.unknown == "error":
            listed = ", ".join(f"{c!r} (U+{ord(c):04X}) in {n} text(s), e.g. {first[c]}" for c, n in counts.most_common())
            raise ValueError(f"{split}: symbols outside the model's symbol table (--symbols, or with auto the training "
                             f"transcripts' symbols): "
                             f"{listed}; --unknown_chars drop leaves them out")
