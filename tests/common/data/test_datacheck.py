import contextlib
import os
import shutil
import signal
import time

import numpy as np
import pytest
import soundfile as sf

from common.data import datacheck
from common.data.datacheck import DataCheckError, audio_facts, check_files, content_digest, list_files, read_cache
from common.data.manifest import DataError, DataPolicy, prepare_manifest

CHAP = "train/999/9990/999-9990-{:04d}.flac"


def tone(seconds, sr=16000):
    return (0.1 * np.sin(np.arange(int(seconds * sr)) * 0.05)).astype("float32")


def test_what_each_mode_finds(bad_corpus, tmp_path):
    """The module docstring's promises: both modes find a truncated file; only `full` finds a
    silent file and a FLAC damaged in the middle whose end still decodes."""
    truncated, silent = str(bad_corpus / CHAP.format(2)), str(bad_corpus / CHAP.format(3))
    damaged = tmp_path / "damaged.flac"
    sf.write(damaged, tone(2.0), 16000)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2: len(data) // 2 + 200] = bytes(200)  # 200 zeroed bytes mid-stream
    damaged.write_bytes(bytes(data))
    for mode in ("header", "full"):
        assert audio_facts(truncated, mode)["error"] == "unreadable audio"
        assert audio_facts(str(tmp_path / "absent.flac"), mode) == {"error": "missing file"}
    digest = audio_facts(silent, "header")["digest"]
    assert audio_facts(silent, "header") == {"frames": 32000, "sample_rate": 16000, "channels": 1, "digest": digest}
    assert audio_facts(silent, "full") == {"frames": 32000, "sample_rate": 16000, "channels": 1, "silent": True,
                                           "digest": digest}
    assert "error" not in audio_facts(str(damaged), "header")
    assert audio_facts(str(damaged), "full")["error"] == "unreadable audio"


@pytest.fixture
def corpus(tiny_corpus, tmp_path):
    """A writable copy of the tiny corpus' 48 training files."""
    root = tmp_path / "corpus"
    shutil.copytree(tiny_corpus / "librispeech" / "train", root / "train")
    return root


def flacs(root):
    listing = list_files([root / "train"])
    return listing, [p for p in listing if p.endswith(".flac")]


def test_a_killed_check_resumes_where_it_stopped(corpus, tmp_path):
    listing, paths = flacs(corpus)
    cache = tmp_path / "facts.jsonl"
    facts, n_read, n_cached = check_files(paths, "header", stats=listing, cache=cache, workers=2)
    assert (n_read, n_cached) == (48, 0) and len(paths) == 48
    lines = cache.read_bytes().split(b"\n")
    cache.write_bytes(b"\n".join(lines[:20]) + b"\n" + lines[20][:15])  # killed while writing line 21
    assert check_files(paths, "header", stats=listing, cache=cache, workers=2) == (facts, 28, 20)
    assert len(read_cache(cache)) == 48 and len(cache.read_bytes().splitlines()) == 49  # + the torn one
    assert check_files(paths, "header", stats=listing, cache=cache, workers=1) == (facts, 0, 48)
    # another mode is another cache: header facts never answer a full check
    assert check_files(paths, "full", cache=tmp_path / "full.jsonl", workers=1)[1] == 48


def test_changed_added_and_removed_files_are_seen(corpus, tmp_path, caplog):
    out, policy = tmp_path / "out", DataPolicy(16000)
    caplog.set_level("INFO", logger="common.data.manifest")

    def prepare(expected_log):
        caplog.clear()
        ds = prepare_manifest(out, "train", corpus, policy, "train", workers=2)
        assert expected_log in caplog.text
        return {r["id"]: r for r in ds}

    first = prepare("read 48 of 48 audio files (0 known from the cache)")
    changed = sorted(first)[5]
    path = first[changed]["path"]
    mtime = os.stat(path).st_mtime_ns
    sf.write(path, tone(1.0), 16000)  # rewritten in place: another duration
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))  # coarse file-system clocks could keep the mtime
    assert first[changed]["duration"] != 1.0
    assert prepare("read 1 of 48 audio files (47 known from the cache)")[changed]["duration"] == 1.0

    os.utime(path, ns=(mtime + 2 * 10**9, mtime + 2 * 10**9))  # same bytes, same size, newer mtime
    prepare("read 1 of 48 audio files (47 known from the cache)")  # a new manifest, not the previous one reused

    chapter = os.path.dirname(path)
    spk_chap = os.path.basename(chapter)
    spk = os.path.basename(os.path.dirname(chapter))
    trans = os.path.join(chapter, f"{spk}-{spk_chap}.trans.txt")
    new_id = f"{spk}-{spk_chap}-9999"
    sf.write(os.path.join(chapter, f"{new_id}.flac"), tone(1.5), 16000)
    with open(trans, "a") as f:
        f.write(f"{new_id} A NEW ONE\n")
    added = prepare("read 1 of 49 audio files (48 known from the cache)")
    assert added[new_id]["duration"] == 1.5 and len(added) == 49

    gone = sorted(first)[-1]
    os.unlink(first[gone]["path"])
    trans = first[gone]["path"].rsplit("-", 1)[0] + ".trans.txt"
    lines = [line for line in open(trans).read().splitlines(True) if not line.startswith(gone + " ")]
    open(trans, "w").write("".join(lines))
    removed = prepare("read 0 of 48 audio files (48 known from the cache)")
    assert gone not in removed and len(removed) == 48
    # the cache holds the current files only (the removed one and the old version of the changed one dropped)
    cache = read_cache(out / "data" / f"train.check-header-v{datacheck.CACHE_VERSION}.jsonl")
    assert sorted(k[0] for k in cache) == sorted(r["path"] for r in removed.values())
    assert len([d for d in (out / "data").iterdir() if d.is_dir()]) == 5  # one manifest per corpus state


def test_a_dead_worker_is_named_and_its_neighbours_stay_cached(corpus, tmp_path, monkeypatch):
    listing, paths = flacs(corpus)
    real = datacheck.audio_facts

    def crash_on_last(path, mode):  # the forked workers inherit the patched module
        if path == paths[-1]:
            os._exit(1)  # what a segfault in libsndfile or the OOM killer looks like to the pool
        return real(path, mode)

    monkeypatch.setattr(datacheck, "audio_facts", crash_on_last)
    cache = tmp_path / "facts.jsonl"
    with pytest.raises(DataCheckError, match=f"worker died while reading one of .* … {paths[-1]}"):
        check_files(paths, "header", stats=listing, cache=cache, workers=2)
    monkeypatch.setattr(datacheck, "audio_facts", real)
    facts, n_read, _ = check_files(paths, "header", stats=listing, cache=cache, workers=2)
    assert 0 < n_read < 48 and facts == check_files(paths, "header", workers=1)[0]


@pytest.mark.parametrize("cut", [1, 64, 2000, "half"])
def test_header_mode_finds_a_file_cut_anywhere(tmp_path, cut):
    """Header mode decodes only the file's last block; a FLAC cut short by one byte or by half fails there."""
    path = tmp_path / "cut.flac"
    sf.write(path, tone(3.0), 16000)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if cut == "half" else len(data) - cut])
    assert audio_facts(str(path), "header")["error"] == "unreadable audio"


@contextlib.contextmanager
def deadline(seconds: int):
    """Turn a hang into a failure (opening a FIFO for reading blocks until a writer comes)."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_a_non_regular_file_is_refused_without_reading_it(corpus, tmp_path, kind):
    """A FIFO in place of an audio file used to hang the check (opening it waits for a writer)."""
    victim = sorted(corpus.glob("train/*/*/*.flac"))[3]
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    elif kind == "directory":
        victim.mkdir()
    else:
        victim.symlink_to("/dev/zero")
    detail = {"fifo": "a FIFO", "directory": "a directory", "device": "a character device"}[kind]
    out = tmp_path / "out"
    with deadline(30):  # in this process (workers=1): a hang is interrupted, not left in a pool worker
        for mode in ("header", "full"):
            assert audio_facts(str(victim), mode) == {"error": "not a regular file", "detail": detail}
        with pytest.raises(DataError, match="1 not a regular file") as refused:
            prepare_manifest(out, "train", corpus, DataPolicy(16000), "train", workers=1)
        assert f".trans.txt:4: not a regular file ({detail})" in str(refused.value)
        skipped = prepare_manifest(out, "train", corpus, DataPolicy(16000, on_bad_data="skip"), "train", workers=1)
    assert len(skipped) == 47 and victim.stem not in skipped["id"]


def test_the_content_digest_sees_other_audio_of_the_same_length(tmp_path):
    """Same size, same duration, same mtime, other samples: the digest differs; a copy keeps it."""
    a, b = tmp_path / "a.flac", tmp_path / "b.flac"
    sf.write(a, tone(2.0), 16000)
    sf.write(b, tone(2.0)[::-1].copy(), 16000)  # the same samples, reversed: another FLAC of the same length
    assert sf.info(a).frames == sf.info(b).frames
    shutil.copy(a, tmp_path / "copy.flac")
    assert content_digest(str(a)) == content_digest(str(tmp_path / "copy.flac")) != content_digest(str(b))


def test_a_replaced_file_with_the_old_size_and_mtime_is_read_again(tmp_path):
    """The cache key holds the ctime: a file swapped for other audio of the same size with its
    mtime copied over (cp -p, rsync -t, touch -r) is not answered from the cache."""
    path, cache = tmp_path / "a.wav", tmp_path / "facts.jsonl"
    sf.write(path, tone(2.0), 16000)
    (before,), n_read, _ = check_files([str(path)], "header", cache=cache, workers=1)
    st = os.stat(path)
    time.sleep(0.01)  # a ctime tick apart
    sf.write(path, tone(2.0)[::-1].copy(), 16000)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    (after,), n_read, _ = check_files([str(path)], "header", cache=cache, workers=1)
    assert n_read == 1 and after["frames"] == before["frames"] and after["digest"] != before["digest"]
