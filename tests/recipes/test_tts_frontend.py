"""TTS text front end (recipes/tts/frontend.py): characters or espeak-ng phonemes in any language,
symbol tables derived from the training transcripts, refusal or removal of unseen symbols; and
through train.py + synthesize.py, a phoneme model whose derived table travels with its checkpoints."""

from __future__ import annotations

import json
import unicodedata
from types import SimpleNamespace

import pytest
import yaml

from common.data.manifest import read_ljspeech
from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import ROOT, python, run

tts = recipe_modules("tts", "frontend", "train")
frontend = tts.frontend
DEFAULT = tts.train.Config()

FRENCH = ["Composez votre numéro d'agent, suivi du dièse.", "Échec à l’ouverture de session.",
          "Le cœur de la conférence"]


def cfg(**kw):
    return SimpleNamespace(**{"symbols": "auto", "text_frontend": "characters", "phonemizer_language": None,
                              "unknown_chars": "error", **kw})


def test_english_characters_are_unchanged(tiny_corpus):
    """The default table gives the ids it gave before the front end existed: lowercased, whitespace collapsed."""
    symbols = frontend.Symbols.derived(DEFAULT, [])
    assert symbols.chars == DEFAULT.symbols
    for text in read_ljspeech(tiny_corpus / "ljspeech")["text"]:
        old = [DEFAULT.symbols.index(c) + 1 for c in " ".join(text.lower().split())]
        assert symbols.encode(text) == old


def test_french_characters_derive_their_table_and_nfd_equals_nfc():
    symbols = frontend.Symbols.derived(cfg(), FRENCH)
    assert symbols.chars == " ',.acdefghilmnoprstuvzàèéœ"  # code-point order, lowercased, ’ → '
    for text in FRENCH:
        nfd, nfc = unicodedata.normalize("NFD", text), unicodedata.normalize("NFC", text)
        assert nfd != nfc and symbols.encode(nfd) == symbols.encode(nfc)


def test_unseen_symbols_are_refused_in_one_line_or_dropped():
    symbols = frontend.Symbols.derived(cfg(), FRENCH)
    with pytest.raises(ValueError) as e:
        symbols.check(["u1", "u2"], ["ça va", "tout"], "test")
    assert "\n" not in str(e.value) and "'ç' (U+00E7) in 1 text(s), e.g. u1" in str(e.value)
    assert "--unknown_chars drop" in str(e.value)
    with pytest.raises(ValueError, match="outside the symbol table"):
        symbols.encode("ça")
    dropping = frontend.Symbols.derived(cfg(unknown_chars="drop"), FRENCH)
    dropping.check(["u1"], ["ça va"], "test")  # allowed
    assert dropping.decode(dropping.encode("ça va")) == "a va"


@pytest.mark.parametrize("language,text", [("fr", "Composez votre numéro"), ("es", "Por favor ingrese su contraseña"),
                                           ("it", "Quell'operatore è già loggato"), ("ru", "Введите номер оператора")])
def test_espeak_phonemes_of_each_language(language, text):
    symbols = frontend.Symbols.derived(cfg(text_frontend="phonemes", phonemizer_language=language), [text])
    ipa = symbols.units(text)
    assert ipa and "ˈ" in ipa and ipa != frontend.normalize(text)  # IPA with stress marks, not the letters
    other = frontend.Symbols.derived(cfg(text_frontend="phonemes", phonemizer_language="en-us"), ["hello"])
    other.units("a radio wrote this")  # another language in between changes nothing
    assert symbols.units(text) == ipa and symbols.units(unicodedata.normalize("NFD", text)) == ipa
    assert symbols.decode(symbols.encode(text)) == ipa


def test_clause_marks_are_kept_after_their_phonemes_only_when_asked():
    """With phoneme_punctuation the marks that end a clause become symbols (a recorded pause has one to align
    to); the phonemes themselves are espeak-ng's either way, and a decimal point or a leading mark is no pause."""
    text = "Clave incorrecta. Por favor; ingrese 3.5 euros?!"
    plain = frontend.Symbols.derived(cfg(text_frontend="phonemes", phonemizer_language="es"), [text])
    marked = frontend.Symbols.derived(cfg(text_frontend="phonemes", phonemizer_language="es", phoneme_punctuation=True), [text])
    ipa, ipa_marked = plain.units(text), marked.units(text)
    assert not set(",.;?!") & set(plain.chars) and set(",.") <= set(marked.chars) and not set(";?!") & set(marked.chars)
    assert [w.rstrip(",.") for w in ipa_marked.split()] == ipa.split()  # the same phonemes, marks after words
    assert ipa_marked.endswith(".") and ipa_marked.count(",") == 1 and ipa_marked.count(".") == 2  # not 3.5's point
    assert marked.units("... ¡Hola!") == marked.units("hola.")  # no pause before any speech; ! ends a sentence
    unmarked = frontend.Symbols.derived(cfg(text_frontend="phonemes", phonemizer_language="es", phoneme_punctuation=True),
                                        ["Clave incorrecta Por favor ingrese 3.5 euros"])  # no marks: none to give
    assert unmarked.units(text) == ipa and unmarked.encode(text)


def test_the_language_is_read_off_enough_transcripts_or_not_at_all():
    spanish = ["Por favor ingrese su numero de agente seguido por la tecla de numero.", "El buzón de voz no está disponible.",
               "Gracias por su llamada, la operadora le atenderá en un momento."]
    cases = {"en-us": ["Please enter your number and the pound key.", "The party you are calling is not available."],
             "fr": FRENCH * 2, "es": spanish, "it": ["Quell'operatore è già loggato. Digitare il proprio numero di operatore.",
                    "Il numero che avete chiamato non è al momento raggiungibile."],
             "ru": ["Этот оператор уже зарегистрирован. Введите номер оператора и нажмите решетку.", "Вы не можете это сделать.",
                   "Я не могу соединить вас с оператором по этому номеру."]}
    for language, texts in cases.items():
        assert frontend.guess_language(texts)[0] == language, (language, frontend.guess_language(texts))
    for unclear in (["Xq zzk brr", "Hmm qqq"], ["le", "the"], ["Arrivederci"], []):  # no function words, a tie, too few
        language, why = frontend.guess_language(unclear)
        assert language is None and "function words" in why


def test_phonemes_need_a_derived_table_and_a_known_language():
    with pytest.raises(ValueError, match="--symbols auto"):
        frontend.Symbols.derived(cfg(symbols="abc", text_frontend="phonemes", phonemizer_language="fr"), FRENCH)
    with pytest.raises(ValueError, match="needs --phonemizer_language"):
        frontend.Symbols.derived(cfg(text_frontend="phonemes"), FRENCH)
    with pytest.raises(ValueError, match="no such voice"):
        frontend.Symbols.derived(cfg(text_frontend="phonemes", phonemizer_language="xx-nowhere"), FRENCH)


TINY = ["--dim", "32", "--ffn_dim", "64", "--duration_channels", "32", "--attention_dim", "32", "--num_heads", "2",
        "--warmup_steps", "5", "--logging_steps", "1", "--report_to", "none", "--num_valid", "2", "--num_test", "2",
        "--max_batch_seconds", "16", "--stats_utterances", "20", "--save_steps", "2", "--eval_steps", "0",
        "--text_frontend", "characters", "--init_from", "none"]  # config.yaml's voice defaults are test_tts.py's


@pytest.mark.slow
def test_phoneme_model_keeps_its_derived_table(tiny_corpus, tmp_path):
    """--symbols auto --text_frontend phonemes: the derived table is in every checkpoint's config and in
    final/, and synthesize.py reads text through it from either."""
    out = tmp_path / "run"
    run("tts", 1, ["--data_dir", str(tiny_corpus / "ljspeech"), "--output_dir", str(out), *TINY, "--max_steps", "2",
                   "--symbols", "auto", "--text_frontend", "phonemes", "--phonemizer_language", "en-us"])
    texts = read_ljspeech(tiny_corpus / "ljspeech")["text"][:-4]  # the training split: all but the last 4 ids
    expected = frontend.Symbols.derived(cfg(text_frontend="phonemes", phonemizer_language="en-us"), texts).chars
    assert "ˈ" in expected and ("ð" in expected or "θ" in expected)  # phonemes, not letters
    for folder in (out / "checkpoints" / "step_00000002", out / "final"):
        assert yaml.safe_load((folder / "config.yaml").read_text())["symbols"] == expected
    for checkpoint in (out / "checkpoints" / "step_00000002", out):
        python([ROOT / "recipes" / "tts" / "synthesize.py", "--checkpoint", checkpoint, "--text", "the farmer wrote",
                "--output", tmp_path / "x.wav", "--griffin_lim_iters", "2"]).check_returncode()
        assert (tmp_path / "x.wav").stat().st_size > 1000
    # score.py checks and splits the data as training did: the texts are letters, not the phoneme table
    python([ROOT / "recipes" / "tts" / "score.py", "--checkpoint", out, "--griffin_lim_iters", "2"]).check_returncode()
    assert (out / "eval" / "final").is_dir()


@pytest.mark.slow
def test_train_refuses_a_test_symbol_absent_from_training(tiny_corpus, tmp_path):
    import shutil

    corpus = tmp_path / "ljspeech"
    shutil.copytree(tiny_corpus / "ljspeech", corpus)
    lines = (corpus / "metadata.csv").read_text().splitlines()
    utt_id, *texts = lines[-1].split("|")  # the last id: a test utterance
    lines[-1] = "|".join([utt_id, *(t + " straße" for t in texts)])
    (corpus / "metadata.csv").write_text("\n".join(lines) + "\n")
    proc = python([ROOT / "recipes" / "tts" / "train.py", "--data_dir", corpus, "--output_dir", tmp_path / "out", *TINY,
                   "--max_steps", "1", "--symbols", "auto"], stderr_to_stdout=True)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"'ß' (U+00DF) in 1 text(s), e.g. {utt_id}" in errors[0], proc.stdout[-3000:]
    assert "ValueError" not in proc.stdout and not (tmp_path / "out" / "checkpoints").exists()

    # --unknown_chars drop trains, and score.py splits as training did: the test text with 'ß' is
    # scored without it, not refused by a check against the derived table.
    run("tts", 1, ["--data_dir", str(corpus), "--output_dir", str(tmp_path / "out"), *TINY, "--max_steps", "1",
                   "--symbols", "auto", "--unknown_chars", "drop"])
    python([ROOT / "recipes" / "tts" / "score.py", "--checkpoint", tmp_path / "out",
            "--griffin_lim_iters", "2"]).check_returncode()
    scored = [json.loads(line) for line in (tmp_path / "out" / "eval" / "final" / "test.jsonl").open()]
    assert utt_id in [r["id"] for r in scored]


def test_symbols_derived_never_refuses_a_resume():
    """`symbols_derived` is written by training, a function of --symbols and the front end that the
    resume compares anyway: a checkpoint written before the field existed (an --symbols auto run)
    resumes instead of being refused for 'symbols_derived: None != True'."""
    from common.config_rules import resume_safe_keys

    assert "symbols_derived" in resume_safe_keys(tts.train.Config)
