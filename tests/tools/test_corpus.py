"""Tests for the built-in espeak-ng corpus and the build-once cache helper (tools/corpus.py)."""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tools import corpus
from tools.corpus import (
    CORPUS_VERSION,
    PROFILES,
    builtin_corpus_dir,
    ensure_builtin_corpus,
    make_sentences,
    synthesize,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXT = "there were forty two birds in the old garden"


# ------------------------------------------------------------------------------------------------
# synthesize
# ------------------------------------------------------------------------------------------------


def test_synthesize_is_deterministic_and_speech_like():
    a = synthesize(TEXT, "en-us+f3", 170, 50)
    b = synthesize(TEXT, "en-us+f3", 170, 50)
    other = synthesize("she sells sea shells", "en-gb-scotland+m3", 150, 30)  # state must not leak
    c = synthesize(TEXT, "en-us+f3", 170, 50)
    assert a.dtype == np.float32 and a.ndim == 1
    assert a.tobytes() == b.tobytes() == c.tobytes()
    assert other.tobytes() != a.tobytes()
    assert np.sqrt(np.mean(a**2)) > 0.01 and np.abs(a).max() < 1.0
    # 9 words at 170 words/min is about 3.2 s; espeak-ng is roughly on target.
    seconds = len(a) / corpus.ESPEAK_SAMPLE_RATE
    expected = len(TEXT.split()) / 170 * 60
    assert 0.5 * expected < seconds < 1.5 * expected
    # A faster rate gives shorter audio: the parameter is really applied.
    assert len(synthesize(TEXT, "en-us+f3", 300, 50)) < 0.8 * len(a)


def test_synthesize_is_identical_in_a_fresh_process():
    code = (
        "import hashlib; from tools.corpus import synthesize; "
        f"print(hashlib.sha256(synthesize({TEXT!r}, 'en-029+m5', 160, 40).tobytes()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    here = hashlib.sha256(synthesize(TEXT, "en-029+m5", 160, 40).tobytes()).hexdigest()
    assert out.stdout.strip() == here


@pytest.mark.parametrize("voice", ["en-gb", "en-us+nosuchvariant", "xx-yy"])
def test_synthesize_rejects_unknown_voices(voice):
    # espeak-ng silently ignores unknown variants and keeps the previous voice on unknown names.
    with pytest.raises(ValueError):
        synthesize(TEXT, voice, 170, 50)


def test_all_configured_voices_load():
    for accent in corpus.ACCENTS:
        assert len(synthesize("hello", accent, 170, 50)) > 0
    for variant in corpus.VARIANTS:
        assert len(synthesize("hello", f"en-us+{variant}", 170, 50)) > 0


# ------------------------------------------------------------------------------------------------
# sentences
# ------------------------------------------------------------------------------------------------


def test_make_sentences_is_deterministic_with_a_small_charset():
    random.seed(0)
    a = make_sentences(500, seed=7)
    random.seed(1)  # the global RNG must not matter
    assert make_sentences(500, seed=7) == a
    assert make_sentences(500, seed=8) != a
    assert len(set(a)) == len(a)
    for sentence in a:
        assert re.fullmatch(r"[a-z']+( [a-z']+)*", sentence), sentence
        assert 4 <= len(sentence.split()) <= 14, sentence
    assert len({w for s in a for w in s.split()}) > 200  # varied vocabulary


# ------------------------------------------------------------------------------------------------
# the corpus
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory) -> Path:
    return ensure_builtin_corpus(tmp_path_factory.mktemp("cache"), profile="tiny")


def _speakers(root: Path) -> dict[int, tuple[str, str]]:
    rows = {}
    for line in (root / "librispeech" / "SPEAKERS.txt").read_text().splitlines():
        if line.startswith(";"):
            continue
        spk, splits, voice, _rate, _pitch = (field.strip() for field in line.split("|"))
        rows[int(spk)] = (splits, voice)
    return rows


def test_tiny_corpus_librispeech_layout(tiny_corpus):
    cfg = PROFILES["tiny"]
    libri = tiny_corpus / "librispeech"
    speakers = _speakers(tiny_corpus)
    texts = {}
    for split, n_speakers, n_utts in [
        ("train", cfg["train_speakers"], cfg["train_utts"]),
        ("validation", cfg["train_speakers"], cfg["validation_utts"]),
        ("test", cfg["test_speakers"], cfg["test_utts"]),
    ]:
        transcripts = sorted((libri / split).glob("*/*/*.trans.txt"))
        assert len(transcripts) == n_speakers
        texts[split] = set()
        for trans in transcripts:
            spk, chap = trans.name.removesuffix(".trans.txt").split("-")
            assert trans.parent.name == chap and trans.parent.parent.name == spk
            assert split in speakers[int(spk)][0]
            lines = trans.read_text().splitlines()
            assert len(lines) == n_utts
            ids = []
            for line in lines:
                utt_id, text = line.split(" ", 1)
                assert re.fullmatch(rf"{spk}-{chap}-\d{{4}}", utt_id)
                assert re.fullmatch(r"[A-Z']+( [A-Z']+)*", text)
                texts[split].add(text)
                ids.append(utt_id)
            assert sorted(p.stem for p in trans.parent.glob("*.flac")) == sorted(ids)
            info = sf.info(str(trans.parent / f"{ids[0]}.flac"))
            assert (info.samplerate, info.channels, info.subtype) == (16000, 1, "PCM_16")
    # Splits never share a sentence.
    assert not texts["train"] & texts["validation"] and not texts["train"] & texts["test"]
    # validation = the training speakers; test = held-out voice+variant pairs.
    train_spk = {int(p.name) for p in (libri / "train").iterdir()}
    assert {int(p.name) for p in (libri / "validation").iterdir()} == train_spk
    test_spk = {int(p.name) for p in (libri / "test").iterdir()}
    assert not train_spk & test_spk
    assert not {speakers[s][1] for s in train_spk} & {speakers[s][1] for s in test_spk}


def test_tiny_corpus_ljspeech_layout(tiny_corpus):
    lj = tiny_corpus / "ljspeech"
    lines = (lj / "metadata.csv").read_text(encoding="utf-8").splitlines()
    assert len(lines) == PROFILES["tiny"]["ljspeech_utts"]
    assert lines[0].startswith("LJ001-0001|")
    for line in lines:
        utt_id, raw, normalized = line.split("|")
        assert raw.endswith(".") and raw[0].isupper()
        assert raw[:-1].lower() == normalized and re.fullmatch(r"[a-z' ]+", normalized)
        info = sf.info(str(lj / "wavs" / f"{utt_id}.wav"))
        assert (info.samplerate, info.channels, info.subtype) == (22050, 1, "PCM_16")
        assert info.duration > 0.5


def test_complete_marker_and_cache_dir(tiny_corpus, tmp_path, monkeypatch):
    meta = __import__("json").loads((tiny_corpus / ".complete").read_text())
    assert meta["profile"] == "tiny" and meta["corpus_version"] == CORPUS_VERSION
    assert meta["files"] == sum(1 for p in tiny_corpus.rglob("*") if p.is_file() and p.name != ".complete")
    assert "tiny" in tiny_corpus.name and f"v{CORPUS_VERSION}" in tiny_corpus.name
    monkeypatch.setenv("SPEECH_RECIPES_CACHE", str(tmp_path))
    assert builtin_corpus_dir(profile="tiny").parent == tmp_path
    assert builtin_corpus_dir("/x", "default") == Path("/x") / builtin_corpus_dir(tmp_path).name
    with pytest.raises(ValueError):
        builtin_corpus_dir(tmp_path, "huge")


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".complete"  # .complete records who built it and when
    }


@pytest.mark.slow
def test_generation_is_byte_identical_across_processes(tiny_corpus, tmp_path):
    out = tmp_path / "again"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.corpus", "--out", str(out), "--profile", "tiny"],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout and "train" in proc.stdout
    assert _tree_digest(out) == _tree_digest(tiny_corpus)
    # the building process says how far it is (every tenth of the utterances), up to the last one
    progress = [line for line in proc.stderr.splitlines() if line.startswith("building the built-in corpus (tiny)")]
    tiny = corpus.PROFILES["tiny"]
    total = (tiny["train_speakers"] * (tiny["train_utts"] + tiny["validation_utts"])
             + tiny["test_speakers"] * tiny["test_utts"] + tiny["ljspeech_utts"])
    assert len(progress) >= 10 and progress[-1].split(": ")[1].startswith(f"{total}/{total} utterances"), proc.stderr


def test_a_stopped_build_resumes_to_the_same_bytes(tiny_corpus, tmp_path, monkeypatch):
    """The build fails at its 30th utterance: what it finished is kept in `<corpus>.partial`, and the
    next call renders only the rest (and a kept file damaged since) into the corpus made in one go."""
    synthesized, real = [], corpus.synthesize

    def stops_at_30(*args):
        synthesized.append(args)
        if len(synthesized) == 30:
            raise RuntimeError("stopped")
        return real(*args)

    monkeypatch.setattr(corpus, "synthesize", stops_at_30)
    with pytest.raises(RuntimeError, match="stopped"):
        ensure_builtin_corpus(tmp_path, "tiny")
    final = builtin_corpus_dir(tmp_path, "tiny")
    partial = final.with_name(final.name + ".partial")
    assert not final.exists() and partial.is_dir()
    damaged = sorted(partial.glob("librispeech/train/*/*/*.flac"))[0]
    damaged.write_bytes(damaged.read_bytes()[:-1])  # changed after it was journaled: rendered again

    synthesized.clear()
    monkeypatch.setattr(corpus, "synthesize", lambda *args: synthesized.append(args) or real(*args))
    ensure_builtin_corpus(tmp_path, "tiny")
    total = sum(1 for p in tiny_corpus.rglob("*") if p.suffix in (".flac", ".wav"))
    assert len(synthesized) == total - 29 + 1
    assert _tree_digest(final) == _tree_digest(tiny_corpus)  # no journal left in it either
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]  # no .partial, no lock


def test_common_never_imports_tools():
    """Imports run one way (recipes → tools → common): the training toolbox stands without tools/."""
    import ast

    root = Path(__file__).resolve().parents[2] / "common"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n == "tools" or n.startswith("tools.")]
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------------
# SSL profiles: unlabelled-style training audio, the base profile's held-out splits
# ------------------------------------------------------------------------------------------------


def _split_jobs(jobs, root: Path, split: str):
    prefix = str(root / "librispeech" / split) + "/"
    return [job for job in jobs if job[0].startswith(prefix)]


def test_ssl10h_plan_keeps_the_default_test_voices_and_sentences_out(tmp_path):
    """The real profile, planned without audio: its training split is ≥ 10 h worth of utterances
    with none of the default profile's test (or validation) sentences and none of its test voices;
    its validation and test jobs are the default profile's, unchanged."""
    ssl_jobs, ssl_files = corpus._plan_ssl(tmp_path, "ssl10h")
    base_jobs, _, base_sentences = corpus._plan(tmp_path, "default")
    train = _split_jobs(ssl_jobs, tmp_path, "train")
    assert len(train) == 216 * 70 and len({job[1] for job in train}) == len(train)
    assert not {job[1] for job in train} & set(base_sentences)
    held_out = _split_jobs(base_jobs, tmp_path, "test") + _split_jobs(base_jobs, tmp_path, "validation")
    assert not {job[1] for job in train} & {job[1] for job in held_out}
    test_voices = {job[2] for job in _split_jobs(base_jobs, tmp_path, "test")}
    assert len(test_voices) == 8 and not {job[2] for job in train} & test_voices
    assert len({job[2] for job in train}) == 216
    for split in ("validation", "test"):
        assert _split_jobs(ssl_jobs, tmp_path, split) == _split_jobs(base_jobs, tmp_path, split)
    # Words: ~2.5 s per utterance at ~175 words/min → ≥ 10 h.
    words = sum(len(job[1].split()) for job in train)
    assert words / 175 / 60 > 10
    augmentations = [job[5] for job in train]
    clean = sum(a.clean for a in augmentations) / len(train)
    assert 0.15 < clean < 0.3  # ~21 %: (1 - 0.5) (1 - 0.3) (1 - 0.4)
    assert sum(bool(a.noise) for a in augmentations) / len(train) == pytest.approx(0.4, abs=0.03)
    assert "AUGMENTATION.txt" in {p.name for p in ssl_files}


def test_heldout_sentences_are_new_to_every_profile_and_a_folder_is_never_reused_for_another_n(tmp_path):
    """--heldout N: an LJSpeech folder of N sentences in the TTS voice that no profile speaks, the first k
    the same for any N ≥ k; a folder built for another N is refused in one line, never handed back as if it held N."""
    corpus.main(["--heldout", "3", "--out", str(tmp_path / "h3")])
    rows = [line.split("|") for line in (tmp_path / "h3" / "metadata.csv").read_text().splitlines()]
    assert [r[0] for r in rows] == ["HO-0001", "HO-0002", "HO-0003"]
    assert not {r[2] for r in rows} & corpus.corpus_sentences()
    assert all(sf.info(str(tmp_path / "h3" / "wavs" / f"{r[0]}.wav")).samplerate == 22050 for r in rows)
    two = corpus.heldout_ljspeech(tmp_path / "h2", 2)
    assert (two / "metadata.csv").read_text().splitlines() == [("|".join(r)) for r in rows[:2]]
    with pytest.raises(SystemExit) as e:
        corpus.main(["--heldout", "4", "--out", str(tmp_path / "h3")])
    assert e.value.code == 2


@pytest.mark.slow
def test_ssltiny_is_byte_identical_in_another_process_with_one_worker(ssltiny_corpus, tiny_corpus, tmp_path):
    # ensure_builtin_corpus rendered with worker processes (every core); this one renders alone.
    out = tmp_path / "again"
    proc = subprocess.run([sys.executable, "-m", "tools.corpus", "--out", str(out), "--profile", "ssltiny",
                           "--workers", "1"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    digest = _tree_digest(ssltiny_corpus)
    assert _tree_digest(out) == digest
    assert not (ssltiny_corpus / ".jobs.json").exists()
    # validation, test and LJSpeech are tiny's, byte for byte; train is new and larger than tiny's
    base = _tree_digest(tiny_corpus)
    shared = {k: v for k, v in base.items() if not k.startswith("librispeech/train/") and k.endswith((".flac", ".wav",
                                                                                                     ".txt", ".csv"))
              and k != "librispeech/SPEAKERS.txt"}
    assert shared and all(digest.get(k) == v for k, v in shared.items())
    train = sorted(k for k in digest if k.startswith("librispeech/train/") and k.endswith(".flac"))
    assert len(train) == 4 * 6 and not set(train) & set(base)
    speakers = _speakers(ssltiny_corpus)
    test_voices = {voice for splits, voice in speakers.values() if splits == "test"}
    train_voices = {voice for splits, voice in speakers.values() if splits == "train"}
    assert len(train_voices) == 4 and not train_voices & test_voices


def test_augmentation_is_a_function_of_the_utterance_id():
    audio = synthesize(TEXT, "en-us+f3", 170, 50)
    a = corpus.Augmentation(corpus.AUGMENT_SPEED_RATES[0], rt60=0.3, noise="pink", snr_db=10.0, gain_db=-6.0, seed=3)
    once, again = corpus.augment(audio, a), corpus.augment(audio, a)
    assert once.tobytes() == again.tobytes()
    dry = corpus._resample_to_16k(audio)
    assert len(once) > len(dry)  # ×0.907 speed (+ the reverberation tail): longer
    clean = corpus.Augmentation(16000, 0.0, "", 0.0, -6.0, 3)
    assert clean.clean and not a.clean
    assert np.allclose(corpus.augment(audio, clean), dry * 10 ** (-6 / 20))
    noisy = corpus.Augmentation(16000, 0.0, "white", 10.0, 0.0, 3)
    noise = corpus.augment(audio, noisy) - dry
    assert 10 * np.log10(np.mean(dry**2) / np.mean(noise**2)) == pytest.approx(10.0, abs=0.01)
    assert corpus.draw_augmentation("1000-10000-0007") == corpus.draw_augmentation("1000-10000-0007")
    assert len({corpus.draw_augmentation(f"1000-10000-{i:04d}") for i in range(50)}) == 50


def test_labelled_subsets_are_fixed_nested_and_clean(ssltiny_corpus):
    small, large = corpus.labelled_subset_ids(ssltiny_corpus, 4), corpus.labelled_subset_ids(ssltiny_corpus, 8)
    assert small == corpus.labelled_subset_ids(ssltiny_corpus, 4) and set(small) < set(large)
    conditions = {line.split(" | ")[0]: line.split(" | ")[-1].strip() for line in
                  (ssltiny_corpus / "librispeech" / "AUGMENTATION.txt").read_text().splitlines() if line[0] != ";"}
    assert all(conditions[i] == "1" for i in large)
    seconds = sum(sf.info(str(p)).duration for p in (ssltiny_corpus / "librispeech" / "train").glob("*/*/*.flac")
                  if p.stem in large)
    assert seconds >= 8
    proc = subprocess.run([sys.executable, "-m", "tools.corpus", "--out", str(ssltiny_corpus), "--profile", "ssltiny",
                           "--subset", "4"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if not line.startswith("#")] == small
    proc = subprocess.run([sys.executable, "-m", "tools.corpus", "--out", str(ssltiny_corpus), "--profile", "ssltiny",
                           "--subset", "3600"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "fewer than 3600 s" in proc.stderr.strip().splitlines()[-1]
