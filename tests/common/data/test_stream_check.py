"""`common.data.stream_check.check_shards`: every row of every parquet shard checked once, its verdicts cached
per shard, bad rows refused in one line or skipped, and a stream with skips still exact."""
import io
import json
import logging

import numpy as np
import pytest
import soundfile as sf

import common.data.stream_check
from common.training.faults import RunError
from common.data.stream import ShardStream, StreamDataset, StreamLoader, open_shards, resolve_shards
from common.data.stream_check import check_shards

COLUMNS = {"audio": "audio", "text": "sentence", "id": "utt", "duration": None}


def wav(samples, subtype="PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.asarray(samples, "float32"), 16000, format="WAV", subtype=subtype)
    return buf.getvalue()


def write(folder, shards: list[list[tuple]]):
    """data/train-*.parquet, one per list of (id, audio bytes, text); row groups of 4 rows."""
    import datasets

    (folder / "data").mkdir(parents=True, exist_ok=True)
    for s, rows in enumerate(shards):
        ds = datasets.Dataset.from_list([{"utt": u, "audio": {"bytes": a, "path": None}, "sentence": t}
                                         for u, a, t in rows])
        ds.cast_column("audio", datasets.Audio(16000, decode=False)).to_parquet(
            str(folder / "data" / f"train-{s:05d}-of-{len(shards):05d}.parquet"), batch_size=4)
    return open_shards(resolve_shards(str(folder)), COLUMNS)


def good(i):
    return (f"u{i:03d}", wav(np.full(800 + 40 * i, 0.1)), "a b")


BAD = {  # id → (audio, text, the reason the check gives)
    "bad-decode": (b"not audio at all", "a b", "unreadable audio"),
    "bad-text": (wav(np.full(900, 0.1)), "  ", "empty transcript"),
    "bad-none": (wav(np.full(900, 0.1)), None, "transcript is not text"),
    "bad-nan": (wav([0.1, np.nan] * 400, "FLOAT"), "a b", "empty audio"),  # found by "full" only
}


@pytest.fixture()
def corpus(tmp_path):
    """3 shards, 40 good rows and the 4 bad ones spread over two of them."""
    bad = [(u, a, t) for u, (a, t, _) in BAD.items()]
    rows = [good(i) for i in range(40)]
    return tmp_path, write(tmp_path, [rows[:10] + bad[:2] + rows[10:14], rows[14:30], rows[30:] + bad[2:]])


def test_a_bad_row_is_named_in_one_line(corpus):
    folder, shards = corpus
    with pytest.raises(RunError) as e:
        check_shards(shards, COLUMNS, folder / "out", mode="header", workers=1)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("3 unusable rows in 2 of 3 shards (1 unreadable audio, 1 empty transcript, "
                              "1 transcript is not text): ")
    assert f"{shards[0].path} row 10: unreadable audio (" in message  # shard + row of the first
    assert message.endswith(", and 2 more (all in " + str(next((folder / "out").glob("stream-check-*")))
                            + "/problems.jsonl); re-encode or remove them, or --on_bad_data skip drops them")


def test_skip_drops_them_with_counts_and_full_mode_finds_non_finite_audio(corpus, caplog):
    folder, shards = corpus
    with caplog.at_level(logging.WARNING, logger="common.data.stream_check"):
        kept = check_shards(shards, COLUMNS, folder / "out", mode="full", on_bad_data="skip", workers=1)
    assert "skipping 4 unusable rows in 2 of 3 shards (1 unreadable audio, 1 empty transcript, 1 transcript is " \
           "not text, 1 empty audio)" in caplog.text
    assert [s.skip for s in kept] == [(10, 11), (), (10, 11)]
    assert [s.rows for s in kept] == [14, 16, 10] and [s.stamp for s in kept] == [s.stamp for s in shards]


def test_each_shard_is_read_once(corpus, monkeypatch):
    """First call: read in a pool of 2. Then neither a second call nor one after the result folder
    was removed reads a shard (per-shard cache); a rewritten shard is read again, alone."""
    folder, shards = corpus
    out = folder / "out"
    first = check_shards(shards, COLUMNS, out, on_bad_data="skip", workers=2)
    read = []
    monkeypatch.setattr(common.data.stream_check, "_check_shard", lambda path, *a: read.append(path) or [])
    assert check_shards(shards, COLUMNS, out, on_bad_data="skip", workers=1) == first
    for folder_made in out.glob("stream-check-*"):
        if folder_made.is_dir():
            __import__("shutil").rmtree(folder_made)
    assert check_shards(shards, COLUMNS, out, on_bad_data="skip", workers=1) == first
    assert read == []
    path = shards[1].path
    data = open(path, "rb").read()
    open(path, "wb").write(data)  # same bytes, rewritten: its stamp (ctime) changes
    check_shards(open_shards(resolve_shards(str(folder)), COLUMNS), COLUMNS, out, on_bad_data="skip", workers=1)
    assert read == [path]


def ident(row):
    return row["id"]


def test_a_stream_with_skips_yields_the_good_rows_once_on_2_ranks_and_2_workers(corpus):
    folder, shards = corpus
    kept = check_shards(shards, COLUMNS, folder / "out", mode="full", on_bad_data="skip", workers=1)
    stream = ShardStream(kept, COLUMNS, seed=0, partitions=4, block_rows=6, batch_size=3)
    assert len(stream) == 4 * 4  # 40 rows: 10 per partition, in 4 batches of ≤ 3
    for epoch in (0, 1):
        seen, steps = [], []
        for rank in range(2):
            loader = StreamLoader(StreamDataset(stream, ident, list, rank, 2), num_workers=2, seed=0)
            loader.set_epoch(epoch)
            got = list(loader)
            steps.append(len(got))
            seen += [i for b in got for i in b]
        assert sorted(seen) == [f"u{i:03d}" for i in range(40)] and steps == [8, 8]
    # Resumed at every position (one process): the batches of an uninterrupted epoch, from there on.
    full = [[r["id"] for r in rows] for _, rows in stream.batches(1, 0, 1)]
    for start in range(len(full)):
        again = ShardStream(kept, COLUMNS, seed=0, partitions=4, block_rows=6, batch_size=3)
        assert [[r["id"] for r in rows] for _, rows in again.batches(1, 0, 1, start)] == full[start:]


def test_audio_cells_that_are_not_bytes_or_a_regular_file_are_named_without_blocking(tmp_path):
    """A path naming a FIFO (opening it blocks until someone writes), the integer 0 (soundfile reads
    file descriptor 0, stdin), a missing path and multi-channel audio: each row refused in the
    report, the check never blocks (an alarm fails the test where it would)."""
    import os
    import signal

    import pyarrow as pa
    import pyarrow.parquet as pq

    fifo = tmp_path / "audio.fifo"
    os.mkfifo(fifo)
    buf = io.BytesIO()
    sf.write(buf, np.full((900, 2), 0.1, "float32"), 16000, format="WAV")
    stereo = buf.getvalue()
    rows = [good(0), ("fifo", None, "a b"), ("gone", None, "a b"), ("stereo", stereo, "a b"), good(1)]
    audio = [{"bytes": a, "path": None} for _, a, _ in rows]
    audio[1], audio[2] = {"bytes": None, "path": str(fifo)}, {"bytes": None, "path": str(tmp_path / "gone.wav")}
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"utt": [u for u, _, _ in rows], "audio": audio, "sentence": ["a b"] * 5}),
                   tmp_path / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"utt": ["zero", "one"], "audio": [0, 1], "sentence": ["a b"] * 2}),
                   tmp_path / "data" / "train-00001-of-00002.parquet")
    shards = open_shards(resolve_shards(str(tmp_path)), COLUMNS)
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the data check blocked"))
    signal.alarm(60)
    try:
        kept = check_shards(shards, COLUMNS, tmp_path / "out", on_bad_data="skip", workers=1)
        with pytest.raises(RunError) as e:
            check_shards(shards, COLUMNS, tmp_path / "out", workers=1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert [s.skip for s in kept] == [(1, 2, 3), (0, 1)]
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        "5 unusable rows in 2 of 2 shards (2 audio is not bytes or a file path, 1 not a regular file, 1 missing file, "
        "1 multi-channel audio): ")
    assert f"{shards[0].path} row 1: not a regular file (a FIFO), and 4 more" in message
    problems = [json.loads(line) for line in next((tmp_path / "out").glob("stream-check-*/problems.jsonl")).open()]
    assert [(p["row"], p["reason"], p["detail"]) for p in problems] == [
        (1, "not a regular file", "a FIFO"), (2, "missing file", str(tmp_path / "gone.wav")),
        (3, "multi-channel audio", "2 channels"), (0, "audio is not bytes or a file path", "int 0"),
        (1, "audio is not bytes or a file path", "int 1")]


def test_a_one_sample_clip_and_a_null_label_are_named_or_skipped(tmp_path, caplog):
    """A clip shorter than the front ends' analysis window (1 sample: a padding traceback mid-run
    before) and a label cell that is null or blank (it trained as the speaker "None") are bad rows
    like the others: named in one line, or skipped with their counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = write(tmp_path, [[good(i) for i in range(6)] + [("short", wav([0.1]), "a b")]])
    with pytest.raises(RunError) as e:
        check_shards(shards, COLUMNS, tmp_path / "out", workers=1)
    assert f"{shards[0].path} row 6: too short (1 samples < 0.05 s)" in str(e.value) and "\n" not in str(e.value)
    table = pq.read_table(shards[0].path)
    pq.write_table(table.append_column("spk", pa.array(["a", None, "b", " ", "c", "d", "e"])), shards[0].path)
    columns = {**COLUMNS, "speaker": "spk"}
    shards = open_shards(resolve_shards(str(tmp_path)), columns)
    with caplog.at_level(logging.WARNING, logger="common.data.stream_check"):
        [kept] = check_shards(shards, columns, tmp_path / "out", on_bad_data="skip", workers=1)
    assert kept.skip == (1, 3, 6) and "(2 no speaker, 1 too short)" in caplog.text
    problems = [json.loads(line) for f in (tmp_path / "out").glob("stream-check-*/problems.jsonl")
                for line in f.read_text().splitlines()]
    assert [p["detail"] for p in problems if p["reason"] == "no speaker"] == [
        "its --speaker_column_name cell is null", "its --speaker_column_name cell is blank"]
