import os
import shutil
import time

import numpy as np
import pytest
import soundfile as sf

from common.data.manifest import (DataError, DataPolicy, data_change, manifest_summary, prepare_manifest,
                             scan_librispeech, validate)

ENTRY = "999-9990.trans.txt:{}"


def reasons(problems):
    return {p["entry"].rsplit("/", 1)[1]: p["reason"] for p in problems}


def manifest_dirs(output_dir, name):
    return [p for p in (output_dir / "data").iterdir() if p.is_dir() and p.name.startswith(f"{name}-")]


@pytest.mark.parametrize("mode", ["header", "full"])
def test_every_kind_of_bad_entry_is_named(bad_corpus, mode):
    rows, problems = scan_librispeech(bad_corpus, "train")
    policy = DataPolicy(16000, min_seconds=0.5, max_seconds=8.0, wrong_sample_rate="refuse",
                        charset="ABCDEFGHIJKLMNOPQRSTUVWXYZ' ", data_check=mode)
    good, problems = validate(rows, problems, policy, workers=1)
    silent = {ENTRY.format(4): "empty audio"} if mode == "full" else {}  # 2 s of zeros: only a full decode sees it
    assert reasons(problems) == {
        ENTRY.format(1): "missing file",
        ENTRY.format(2): "unreadable audio",
        ENTRY.format(3): "unreadable audio",  # truncated FLAC: the header alone looks fine, its end fails
        **silent,
        ENTRY.format(5): "too short",
        ENTRY.format(6): "too long",
        ENTRY.format(7): "wrong sample rate",
        ENTRY.format(8): "multi-channel audio",
        ENTRY.format(10): "duplicate utterance id",
        ENTRY.format(11): "malformed line",
        ENTRY.format(12): "empty transcript",
        ENTRY.format(13): "characters outside the symbol table",
    }
    # the tiny corpus + the first copy of the duplicate (+ the silent file in header mode)
    assert len(good) == 48 + 1 + (mode == "header")
    assert [r["id"] for r in good] == sorted(r["id"] for r in good)
    if mode == "header":
        assert "truncated" in next(p["detail"] for p in problems if p["entry"].endswith(ENTRY.format(3)))


@pytest.mark.parametrize("mode", ["header", "full"])
def test_result_does_not_depend_on_the_pool_size(bad_corpus, mode):
    policy = DataPolicy(16000, max_seconds=8.0, charset="ABCDEFGHIJKLMNOPQRSTUVWXYZ' ", data_check=mode)
    scanned = scan_librispeech(bad_corpus, "train")
    serial = validate(*scanned, policy, workers=1)
    for workers in (2, 3):  # 3: chunks finish in another order than they were submitted
        assert validate(*scanned, policy, workers=workers) == serial
    assert len(serial[1]) == 10 + (mode == "full")


def test_resample_policy_and_unused_transcripts(bad_corpus):
    rows, problems = scan_librispeech(bad_corpus, "train")
    good, problems = validate(rows, problems, DataPolicy(16000, max_seconds=8.0))  # no charset
    found = reasons(problems)
    assert ENTRY.format(7) not in found  # 8 kHz accepted: resampled on load
    assert ENTRY.format(12) not in found and ENTRY.format(13) not in found
    assert {r["id"]: r["sample_rate"] for r in good}["999-9990-0006"] == 8000


def test_prepare_manifest_error_report_and_skip(bad_corpus, tmp_path, caplog, monkeypatch):
    from common.data import manifest

    monkeypatch.setattr(manifest, "REPORT_GRACE_S", 0.0)  # the non-main call below exits at once
    policy = DataPolicy(16000, max_seconds=8.0, data_check="full")
    with pytest.raises(DataError) as e:
        prepare_manifest(tmp_path, "train", bad_corpus, policy, "train")
    text = str(e.value)
    assert "9 unusable entries" in text
    for n in (1, 2, 3, 4, 5, 6, 8, 10, 11):
        assert ENTRY.format(n) in text
    with pytest.raises(SystemExit):  # other ranks exit quietly; the main process reports
        prepare_manifest(tmp_path, "train", bad_corpus, policy, "train", is_main_process=False)
    skip = DataPolicy(16000, max_seconds=8.0, on_bad_data="skip", data_check="full")
    with caplog.at_level("INFO"):
        ds = prepare_manifest(tmp_path, "train", bad_corpus, skip, "train")
    assert len(ds) == 48 + 4  # + the 8 kHz file, one copy of the duplicate, 2 transcripts not checked
    assert "skipping 9 of 61 entries" in caplog.text and "2 unreadable audio" in caplog.text
    # the facts do not depend on the policy: only the 2 unreadable files are read again (errors are
    # never cached: a transient NFS error must not stick), the missing one is neither read nor cached
    assert "read 2 of 59 audio files (56 known from the cache)" in caplog.text
    assert len(manifest_dirs(tmp_path, "train")) == 2  # one validated manifest per policy


def test_prepare_manifest_header_mode_is_the_default(bad_corpus, tmp_path):
    assert DataPolicy(16000).data_check == "header"
    with pytest.raises(DataError) as e:
        prepare_manifest(tmp_path, "train", bad_corpus, DataPolicy(16000, max_seconds=8.0), "train", workers=2)
    assert "8 unusable entries" in str(e.value) and "2 unreadable audio" in str(e.value)
    assert ENTRY.format(4) not in str(e.value)  # the silent file: header mode does not decode samples
    with pytest.raises(ValueError, match="data_check must be one of header, full, not 'fast'"):
        DataPolicy(16000, data_check="fast")


def test_manifest_is_reused_and_refreshed_when_files_change(tiny_corpus, tmp_path):
    policy = DataPolicy(16000)
    root = tiny_corpus / "librispeech"
    a = prepare_manifest(tmp_path, "valid", root, policy, "validation")
    b = prepare_manifest(tmp_path, "valid", root, policy, "validation")
    assert a["id"] == b["id"] and len(manifest_dirs(tmp_path, "valid")) == 1


def test_input_that_used_to_slip_through_is_named(tmp_path):
    """Invalid UTF-8 in a transcript, audio files no transcript line names (a 0-byte trans.txt),
    LJSpeech ids that are paths; a byte-order mark in metadata.csv is accepted."""
    import soundfile as sf

    from common.data.manifest import scan_ljspeech

    tone = np.sin(np.arange(16000) * 0.05).astype("float32") * 0.1
    chap = tmp_path / "libri" / "train" / "1" / "2"
    chap.mkdir(parents=True)
    for i in range(3):
        sf.write(chap / f"1-2-{i:04d}.flac", tone, 16000)
    (chap / "1-2.trans.txt").write_bytes(b"1-2-0000 HELLO\n1-2-0001 CAF\xe9\n")
    empty = tmp_path / "libri" / "train" / "3" / "4"
    empty.mkdir(parents=True)
    sf.write(empty / "3-4-0000.flac", tone, 16000)
    (empty / "3-4.trans.txt").write_bytes(b"")
    rows, problems = scan_librispeech(tmp_path / "libri", "train")
    assert [r["id"] for r in rows] == ["1-2-0000"]
    assert reasons(problems) == {"1-2.trans.txt:2": "invalid UTF-8 in transcript",  # its audio: not twice
                                 "1-2-0002.flac": "audio without a transcript line",
                                 "3-4-0000.flac": "audio without a transcript line"}

    lj = tmp_path / "lj"
    (lj / "wavs").mkdir(parents=True)
    (lj / "metadata.csv").write_bytes("\ufeffLJ001|Raw one.|raw one\n../../etc/passwd|x|x\n/abs/path|y|y\n"
                                      "LJ002|Bad \xff|bad\n".encode("utf-8").replace(b"\xc3\xbf", b"\xff"))
    rows, problems = scan_ljspeech(lj)
    assert [r["id"] for r in rows] == ["LJ001"]  # the BOM is not part of the first id
    assert sorted(p["reason"] for p in problems) == ["id is a path (outside wavs/)"] * 2 + ["invalid UTF-8 in transcript"]


def test_other_audio_of_the_same_length_changes_the_summary_and_is_named(tiny_corpus, tmp_path):
    """A file replaced by other audio with the same size and duration (and its mtime copied back):
    the ids, durations and transcripts are the same, the contents fingerprint is not, and the
    change names the file. An older summary without `contents` still compares equal."""
    root = tmp_path / "corpus"
    shutil.copytree(tiny_corpus / "librispeech" / "train", root / "train")
    out = tmp_path / "out"
    before = manifest_summary(prepare_manifest(out, "train", root, DataPolicy(16000), "train", workers=1))
    assert data_change(before, before, out / "data") is None
    victim = sorted(root.glob("train/*/*/*.flac"))[7]
    replace_keeping_size(victim)
    after = manifest_summary(prepare_manifest(out, "train", root, DataPolicy(16000), "train", workers=1))
    assert {k: v for k, v in after.items() if k != "contents"} == {k: v for k, v in before.items() if k != "contents"}
    assert after["contents"] != before["contents"]
    assert data_change(before, after, out / "data") == (
        f"training data changed: 1 files' contents changed, e.g. {victim} (same ids, durations and transcripts; "
        f"content fingerprint {before['contents']} != now {after['contents']})")
    # the manifests are gone: the change is still refused, without a count
    assert "the audio files' contents changed" in data_change(before, after, tmp_path / "elsewhere")
    old = {k: v for k, v in before.items() if k != "contents"}  # a checkpoint from before the key
    assert data_change(old, after, out / "data") is None


def replace_keeping_size(path):
    """Rewrite the FLAC `path` with other audio of the same duration, padded to its old size, with
    its old mtime (what `cp -p` of another take of the utterance does)."""
    st = os.stat(path)
    audio, sr = sf.read(path, dtype="int16")
    time.sleep(0.01)
    sf.write(path, audio // 2, sr)  # 6 dB quieter: other samples, a smaller FLAC
    with open(path, "ab") as f:
        f.write(bytes(st.st_size - os.path.getsize(path)))  # zeros after the last frame: the decoder ignores them
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and sf.info(path).frames == len(audio)


def test_a_folder_in_another_layout_is_refused_naming_the_expected_one(tmp_path):
    """An empty --data_dir or an audiofolder-style one: one line saying what was expected and what
    the folder holds (was a FileNotFoundError traceback / 'no usable entries')."""
    from common.data.manifest import DataError, scan_librispeech, scan_ljspeech

    with pytest.raises(DataError, match=r"train not found \(it is empty\); expected the LibriSpeech layout"):
        scan_librispeech(tmp_path, "train")
    (tmp_path / "a.wav").write_bytes(b"")
    (tmp_path / "metadata.jsonl").write_text("{}\n")
    with pytest.raises(DataError) as e:
        scan_ljspeech(tmp_path)
    assert "metadata.csv not found (it holds a.wav, metadata.jsonl); expected the LJSpeech layout" in str(e.value)
    assert "\n" not in str(e.value)
    # `datasets` shards are read, by --dataset_name (was: "datasets shards are not read: convert them")
    assert "is read with --dataset_name <it> instead of --data_dir; convert any other layout" in str(e.value)
    assert "not read: convert" not in str(e.value)


def test_a_librispeech_folder_given_to_an_ljspeech_recipe_is_named(tmp_path):
    """The vocoder (LJSpeech layout) given a LibriSpeech folder says which layout it got and the flag that reads shards."""
    from common.data.manifest import DataError, scan_ljspeech

    (tmp_path / "train-clean-100" / "19" / "198").mkdir(parents=True)
    (tmp_path / "train-clean-100" / "19" / "198" / "19-198.trans.txt").write_text("19-198-0000 HELLO\n")
    with pytest.raises(DataError) as e:
        scan_ljspeech(tmp_path)
    assert ("metadata.csv not found (it holds train-clean-100/: the LibriSpeech layout, which this recipe does not "
            "read from --data_dir); expected the LJSpeech layout") in str(e.value)
    assert "--dataset_name" in str(e.value) and "\n" not in str(e.value)


# ---- audiofolder: `datasets`' convention, read by --data_dir with the same data check -------------

def audiofolder(folder, metadata: str, files=("a.wav", "clips/b.wav", "c.flac"), name="metadata.csv"):
    """`folder` with 1 s files of 16 kHz audio and `metadata` as its metadata file."""
    for f in files:
        (folder / f).parent.mkdir(parents=True, exist_ok=True)
        sf.write(folder / f, np.full(16000, 0.1, "float32"), 16000)
    (folder / name).write_text(metadata)
    return folder


GOOD_CSV = "file_name,transcription,speaker\na.wav,hello there,s1\n./clips/b.wav,\"well, yes\",s2\nc.flac,no,s1\n"


def test_an_audiofolder_is_read_by_data_dir_for_a_folder_or_a_split(tmp_path):
    """<data_dir>/metadata.csv (a recipe that reads one folder: TTS, vocoder) or <data_dir>/<split>/metadata.csv
    (one that reads splits: ASR, speaker ID), CSV or JSON lines: rows with ids from the paths, the data
    check's columns, and a manifest folder re-used until a file changes."""
    policy = DataPolicy(16000)
    root = audiofolder(tmp_path / "voice", GOOD_CSV)
    ds = prepare_manifest(tmp_path / "out", "all", root, policy, None)
    assert ds["id"] == ["a", "c", "clips-b"] and ds["text"] == ["hello there", "no", "well, yes"]
    assert ds["speaker"] == ["s1", "s1", "s2"] and ds["path"][2] == str(root / "clips" / "b.wav")
    assert ds["duration"] == [1.0, 1.0, 1.0] and all(ds["digest"])
    assert len(manifest_dirs(tmp_path / "out", "all")) == 1
    jsonl = "".join(f'{{"file_name": "{f}", "text": "{t}"}}\n' for f, t in (("a.wav", "one"), ("clips/b.wav", "two")))
    split = audiofolder(tmp_path / "corpus" / "train", jsonl, name="metadata.jsonl")
    ds = prepare_manifest(tmp_path / "out", "train", tmp_path / "corpus", policy, "train")
    assert ds["id"] == ["a", "clips-b"] and ds["speaker"] == ["train", "train"]  # no speaker column: the folder's name
    sf.write(split / "a.wav", np.full(8000, 0.1, "float32"), 16000)  # changed: checked again
    assert prepare_manifest(tmp_path / "out", "train", tmp_path / "corpus", policy, "train")["duration"] == [0.5, 1.0]


@pytest.mark.parametrize("metadata,message", [
    ("path,text\na.wav,x\n", "its columns (path, text) have no file_name; expected one (the audiofolder layout"),
    ("file_name,speaker\na.wav,s\n", "its columns (file_name, speaker) have no text or transcription; expected one"),
    ("file_name,text,transcription\na.wav,x,y\n", "have both text and transcription; expected one"),
    ("", "metadata.csv: empty, not even a header line"),
], ids=["no-file_name", "no-text", "two-texts", "empty"])
def test_an_audiofolder_header_it_cannot_read_is_one_line(tmp_path, metadata, message):
    root = audiofolder(tmp_path, metadata, files=("a.wav",))
    with pytest.raises(DataError) as e:
        prepare_manifest(tmp_path / "out", "all", root, DataPolicy(16000), None)
    assert message in str(e.value) and "\n" not in str(e.value) and e.value.exit_code == 2


def test_an_audiofolder_without_transcripts_serves_a_recipe_that_reads_none(tmp_path):
    root = audiofolder(tmp_path, "file_name,speaker\na.wav,s\n", files=("a.wav",))
    ds = prepare_manifest(tmp_path / "out", "all", root, DataPolicy(16000), None, text=False)
    assert ds["text"] == [""] and ds["speaker"] == ["s"]


def test_an_audiofolders_bad_lines_are_named_or_skipped(tmp_path, caplog):
    """A path that leaves the folder (refused unread, as `datasets` does), a file named twice, an empty
    transcript or speaker, a line of the wrong shape, a missing file: named with their lines, or skipped."""
    (tmp_path / "outside.wav").write_bytes(b"")
    lines = ["file_name,text,speaker", "a.wav,fine,s", "../outside.wav,x,s", "/etc/passwd,x,s", "clips/../a.wav,again,s",
             "c.flac,,s", "clips/b.wav,x,", "a.wav", "gone.wav,x,s"]
    root = audiofolder(tmp_path / "voice", "\n".join(lines) + "\n")
    with pytest.raises(DataError) as e:
        prepare_manifest(tmp_path / "out", "all", root, DataPolicy(16000), None)
    found = {line.split(": ", 1)[0].rsplit(":", 1)[1]: line.split(": ", 1)[1] for line in str(e.value).splitlines()[1:-1]}
    assert found == {"3": "file_name outside the folder (../outside.wav)", "4": "file_name outside the folder (/etc/passwd)",
                     "5": f"duplicate file (clips/../a.wav (also {root / 'metadata.csv'}:2))", "6": "empty transcript (c.flac)",
                     "7": "no speaker (clips/b.wav)", "8": "malformed line (expected file_name, text, speaker)",
                     "9": found["9"]}
    assert found["9"].startswith("missing")
    ds = prepare_manifest(tmp_path / "out", "all", root, DataPolicy(16000, on_bad_data="skip"), None)
    assert ds["id"] == ["a"] and "skipping 7 of 8 entries" in caplog.text


def test_a_layout_mistake_with_an_audiofolder_says_which_folder_to_give(tmp_path):
    """A recipe that reads splits given one audiofolder for the whole corpus, and one that reads a
    folder given a corpus of split audiofolders: one line naming what to give."""
    audiofolder(tmp_path / "voice", GOOD_CSV)
    with pytest.raises(DataError) as e:
        prepare_manifest(tmp_path / "out", "train", tmp_path / "voice", DataPolicy(16000), "train")
    assert "one audiofolder for the whole corpus, and this recipe reads splits: give each its own folder, " \
           "<data_dir>/<split>/metadata.csv" in str(e.value)
    audiofolder(tmp_path / "corpus" / "train", GOOD_CSV)
    with pytest.raises(DataError) as e:
        prepare_manifest(tmp_path / "out", "all", tmp_path / "corpus", DataPolicy(16000), None)
    assert f"train/ is an audiofolder; this recipe reads one folder: give --data_dir {tmp_path / 'corpus' / 'train'}" \
           in str(e.value) and "\n" not in str(e.value)
