"""ASR text in any language (recipes/asr/text.py): symbols derived from the training transcripts,
Unicode normalization, refusal or removal of characters the model cannot emit; and through
train.py, a validation transcript with such a character refused in one line."""

from __future__ import annotations

import shutil
import unicodedata

import pytest

from tools.corpus import _SENTENCE_SEED, PROFILES, make_sentences
from common.data.manifest import read_librispeech
from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import ROOT, command, python

asr = recipe_modules("asr", "text")
text = asr.text

FRENCH = ["Composez votre numéro d'agent suivi du dièse.", "Échec à l’ouverture de session.",
          "Veuillez appuyer sur 1 ou 2", "Le cœur de la conférence"]


def test_french_symbols_come_from_the_training_transcripts(tmp_path):
    text.build_tokenizer("char", FRENCH, tmp_path, 0)
    tok = text.load_tokenizer(tmp_path)
    # a-z, ' and space keep ids 1..28; the rest follow in code-point order
    assert tok.vocab == ["<blank>", *text.CHARS, "1", "2", "à", "è", "é", "œ"]
    assert tok.decode(tok.encode(FRENCH[1])) == "échec à l'ouverture de session"  # ’ is the apostrophe


def test_nfc_and_nfd_give_the_same_ids():
    tok = text.CharTokenizer.from_texts(FRENCH)
    for line in FRENCH[:2]:  # accented
        nfd, nfc = unicodedata.normalize("NFD", line), unicodedata.normalize("NFC", line)
        assert nfd != nfc and tok.encode(nfd) == tok.encode(nfc)
    assert text.normalize_text("ﬁn ２ fois") == "fin 2 fois"  # NFKC: compatibility forms folded


def test_english_symbols_are_unchanged(tiny_corpus):
    """The built-in corpora give today's 28 characters + blank, in today's order (ids unchanged)."""
    train = read_librispeech(tiny_corpus / "librispeech", "train")["text"]
    assert text.CharTokenizer.from_texts(train).vocab == ["<blank>", *" 'abcdefghijklmnopqrstuvwxyz"]
    default = PROFILES["default"]
    n = (default["train_speakers"] * (default["train_utts"] + default["validation_utts"])
         + default["test_speakers"] * default["test_utts"] + default["ljspeech_utts"])
    assert text.CharTokenizer.from_texts(make_sentences(n, _SENTENCE_SEED)).vocab_size == 29
    assert text.normalize_text("MR. O'BRIEN'S well-known") == "mr o'brien's well known"


def test_unseen_characters_are_refused_in_one_line_or_dropped(caplog):
    tok = text.CharTokenizer.from_texts(FRENCH)
    ids, texts = ["a", "b", "c"], ["appuyez sur 3", "ça va", "tout va bien"]
    with pytest.raises(ValueError) as e:
        text.check_transcripts(ids, texts, tok, "test", "error")
    message = str(e.value)
    assert "\n" not in message and "'3'" in message and "'ç'" in message and "e.g. b" in message
    assert "--unknown_chars drop" in message
    text.check_transcripts(ids, texts, tok, "test", "drop")  # logged, not refused
    assert "removing characters" in caplog.text
    assert tok.normalize("ça va 3 fois") == "a va fois" and tok.decode(tok.encode("ça va")) == "a va"
    text.check_transcripts(["a"], ["appuyez sur 1"], tok, "test", "error")  # all seen: nothing to say


def test_char_map_applies_everywhere_and_is_saved(tmp_path):
    (tmp_path / "map.txt").write_text("# ligatures and a cedilla\nœ oe\nÇ c\n")
    char_map = text.read_char_map(tmp_path / "map.txt")
    assert char_map == {"œ": "oe", "ç": "c"}
    text.build_tokenizer("char", FRENCH, tmp_path, 0, char_map)
    tok = text.load_tokenizer(tmp_path)
    assert "œ" not in tok.vocab and tok.normalize("Le cœur, ça") == "le coeur ca"
    text.check_transcripts(["a"], ["ça"], tok, "test", "error")  # mapped: nothing unknown
    (tmp_path / "bad.txt").write_text("oe œ\n")
    with pytest.raises(ValueError, match="one character"):
        text.read_char_map(tmp_path / "bad.txt")


def test_bpe_knows_its_characters(tmp_path):
    text.build_tokenizer("bpe", FRENCH * 5, tmp_path, 40)
    tok = text.load_tokenizer(tmp_path)
    assert {"é", "œ", "1"} <= tok.charset and "ç" not in tok.charset
    with pytest.raises(ValueError, match="'ç'"):
        text.check_transcripts(["x"], ["ça"], tok, "validation", "error")


@pytest.mark.slow
def test_train_refuses_a_validation_character_it_cannot_emit(tiny_corpus, tmp_path):

    corpus = tmp_path / "librispeech"
    for split in ("train", "validation"):
        shutil.copytree(tiny_corpus / "librispeech" / split, corpus / split)
    trans = sorted((corpus / "validation").rglob("*.trans.txt"))[0]
    first, *rest = trans.read_text().splitlines()
    utt_id, words = first.split(" ", 1)
    trans.write_text("\n".join([f"{utt_id} {words} straße", *rest]) + "\n")
    cmd = command("asr", 1, ["--data_dir", str(corpus), "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
                             "--report_to", "none", "--hidden_size", "32", "--num_layers", "1", "--num_heads", "2",
                             "--ffn_dim", "64"])
    proc = python(cmd[cmd.index(str(ROOT / "recipes" / "asr" / "train.py")):], stderr_to_stdout=True)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and "'ß' (U+00DF) in 1 transcript(s), e.g. " + utt_id in errors[0], proc.stdout[-3000:]
    assert "ValueError" not in proc.stdout  # our one line, not a traceback (accelerate adds its own)
