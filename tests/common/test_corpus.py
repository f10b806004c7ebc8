"""Tests for the built-in espeak-ng corpus and the build-once cache helper (common/corpus.py)."""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from common import corpus
from common.corpus import (
    CORPUS_VERSION,
    PROFILES,
    builtin_corpus_dir,
    ensure_builtin_corpus,
    make_sentences,
    prepare_once,
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
        "import hashlib; from common.corpus import synthesize; "
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


def test_generation_is_byte_identical_across_processes(tiny_corpus, tmp_path):
    out = tmp_path / "again"
    proc = subprocess.run(
        [sys.executable, "-m", "common.corpus", "--out", str(out), "--profile", "tiny"],
        cwd=REPO_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout and "train" in proc.stdout
    assert _tree_digest(out) == _tree_digest(tiny_corpus)


# ------------------------------------------------------------------------------------------------
# prepare_once
# ------------------------------------------------------------------------------------------------


def _counting_build(tmp: Path, calls_dir: Path, seconds: float) -> None:
    # One file per call, written *outside* the build folder: counts builds across processes.
    (calls_dir / f"{os.getpid()}-{time.monotonic_ns()}").write_text("")
    time.sleep(seconds)
    (tmp / "data.txt").write_text("payload")


def _contender(final_dir: str, calls_dir: str, delay_s: float, results_dir: str) -> None:
    time.sleep(delay_s)
    build = functools.partial(_counting_build, calls_dir=Path(calls_dir), seconds=1.5)
    # stale_after_s far below the build time: only the builder's heartbeat keeps its lock alive.
    out = prepare_once(Path(final_dir), build, timeout_s=30, poll_s=0.05, stale_after_s=0.6)
    assert (out / ".complete").is_file() and (out / "data.txt").read_text() == "payload"
    Path(results_dir, str(os.getpid())).write_text(str(out))


def test_prepare_once_builds_exactly_once_under_concurrency(tmp_path):
    final_dir, calls, results = tmp_path / "shared" / "data", tmp_path / "calls", tmp_path / "results"
    calls.mkdir()
    results.mkdir()
    ctx = multiprocessing.get_context("spawn")
    # Four contenders starting 150 ms apart: the later ones find the lock held and must wait.
    args = [(str(final_dir), str(calls), 0.15 * i, str(results)) for i in range(4)]
    procs = [ctx.Process(target=_contender, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert len(list(calls.iterdir())) == 1
    assert {r.read_text() for r in results.iterdir()} == {str(final_dir)}
    assert sorted(p.name for p in final_dir.parent.iterdir()) == ["data"]  # no lock, no temp dirs left


def test_prepare_once_failed_build_leaves_nothing(tmp_path):
    final_dir = tmp_path / "data"

    def failing(tmp: Path) -> None:
        (tmp / "half-written").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        prepare_once(final_dir, failing, poll_s=0.05)
    assert list(tmp_path.iterdir()) == []
    # And the next attempt is not blocked by anything left behind.
    assert prepare_once(final_dir, lambda tmp: (tmp / "ok").write_text("1"), poll_s=0.05) == final_dir
    assert (final_dir / "ok").is_file()


def test_prepare_once_takes_over_a_stale_lock(tmp_path):
    final_dir = tmp_path / "data"
    lock = tmp_path / "data.lock"
    # A builder on this host was killed: its lock stopped being touched and its temp dir remains.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    lock.write_text(f"{socket.gethostname()} {dead_pid} 0.0 deadbeef\n")
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    leftover = tmp_path / f"data.tmp-{socket.gethostname()}-{dead_pid}-0123abcd"
    leftover.mkdir()
    start = time.monotonic()
    prepare_once(final_dir, lambda tmp: (tmp / "ok").write_text("1"), poll_s=0.05, stale_after_s=0.3)
    assert (final_dir / ".complete").is_file() and not lock.exists() and not leftover.exists()
    assert time.monotonic() - start < 5


def test_prepare_once_waits_for_a_live_lock_then_times_out(tmp_path):
    final_dir = tmp_path / "data"
    lock = tmp_path / "data.lock"
    lock.write_text("busy-host 1 0.0 cafe\n")
    stop = threading.Event()

    def heartbeat():  # a live builder elsewhere keeps touching its lock
        while not stop.wait(0.05):
            os.utime(lock)

    thread = threading.Thread(target=heartbeat, daemon=True)
    thread.start()
    try:
        with pytest.raises(TimeoutError, match=re.escape(str(lock))):
            prepare_once(final_dir, lambda tmp: None, timeout_s=0.8, poll_s=0.05, stale_after_s=0.3)
    finally:
        stop.set()
        thread.join()
    assert not final_dir.exists() and lock.exists()


def test_prepare_once_never_trusts_a_dir_without_marker(tmp_path):
    final_dir = tmp_path / "data"
    final_dir.mkdir()
    (final_dir / "partial.flac").write_text("truncated")  # an old-style writer crashed here
    out = prepare_once(final_dir, lambda tmp: (tmp / "ok").write_text("1"), poll_s=0.05)
    assert out == final_dir
    assert sorted(p.name for p in final_dir.iterdir()) == [".complete", "ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    # Complete now: a second call returns at once without building.
    assert prepare_once(final_dir, lambda tmp: pytest.fail("rebuilt a complete dir")) == final_dir
