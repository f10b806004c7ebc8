"""`common.data.source` on tiny local sources: a map-style split's bad rows and files refused in one line
(exit code 2) naming the split and row or the file, never a traceback or a blocked read; what a
checkpoint records of the files follows their contents; stream messages name the fix."""
import contextlib
import io
import json
import os
import shutil
import signal
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile as sf

from common.training.faults import RunError
from common.data.manifest import DataError, data_change, manifest_summary
from common.data.source import load_split, run_manifests, with_contents
from common.training.sealing import seal_export, verify_checkpoint
from common.training.prepare import COMPLETE_MARKER
from common.data.stream import ShardStream, open_shards, resolve_shards

AUDIO = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def wav(channels=1, frames=900) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.full((frames, channels), 0.1, "float32"), 16000, format="WAV")
    return buf.getvalue()


def source(folder, train: list, sentences=None, audio_type=AUDIO):
    """<folder>/data/{train,validation}-00000-of-00001.parquet: `train`'s audio cells (structs unless
    `audio_type` says otherwise) and one validation row (good audio; of another type, the first of `train`)."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    sentences = sentences or ["a b"] * len(train)
    pq.write_table(pa.table({"audio": pa.array(train, audio_type), "sentence": sentences}),
                   folder / "data" / "train-00000-of-00001.parquet")
    valid = [{"bytes": wav(), "path": None}] if audio_type == AUDIO else train[:1]
    pq.write_table(pa.table({"audio": pa.array(valid, audio_type), "sentence": ["a"]}),
                   folder / "data" / "validation-00000-of-00001.parquet")
    return folder


def cfg(folder, **changes):
    return SimpleNamespace(**{"dataset_name": str(folder), "dataset_config_name": None, "audio_column_name": "audio",
                              "text_column_name": "sentence", "data_check": "header", "on_bad_data": "error", **changes})


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def refused(folder, text=True) -> str:
    with pytest.raises(DataError) as e:
        load_split(cfg(folder), "train", text=text)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    return str(e.value)


def good():
    return {"bytes": wav(), "path": None}


def test_a_corrupt_row_is_named_in_one_line(tmp_path):
    folder = source(tmp_path, [good(), {"bytes": b"not audio at all", "path": None}])
    assert refused(folder).startswith(f"--dataset_name {folder} split train row 1: unreadable audio (Error opening "
                                      "its bytes: Format not recognised.); re-encode or remove it")


def test_multi_channel_audio_is_refused_as_from_a_folder(tmp_path):
    folder = source(tmp_path, [good(), good(), {"bytes": wav(channels=2), "path": None}])
    assert refused(folder).startswith(f"--dataset_name {folder} split train row 2: multi-channel audio (2 channels)")


def test_an_empty_transcript_is_named_where_transcripts_are_read(tmp_path):
    folder = source(tmp_path, [good(), good()], sentences=["a b", "  "])
    assert refused(folder).startswith(f"--dataset_name {folder} split train row 1: empty transcript")
    ds, _ = load_split(cfg(folder), "train", text=False)  # a recipe that reads no transcripts takes it
    assert len(ds) == 2


def test_a_fifo_path_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "audio.fifo"
    os.mkfifo(fifo)
    folder = source(tmp_path / "src", [good(), {"bytes": None, "path": str(fifo)}])
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading the source blocked"))
    signal.alarm(60)
    try:
        message = refused(folder)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert message.startswith(f"--dataset_name {folder} split train row 1: not a regular file (a FIFO)")


def test_an_audio_column_of_integers_is_one_line(tmp_path):
    folder = source(tmp_path, [0, 1], audio_type=pa.int64())
    assert refused(folder) == (f"--audio_column_name audio of --dataset_name {folder} split train holds int64, not "
                               "audio (encoded bytes, a file path, or a datasets Audio column): name the audio column")


def test_files_that_disagree_or_are_empty_are_named(tmp_path):
    folder = source(tmp_path / "mixed", [good()])
    odd = folder / "data" / "train-00001-of-00001.parquet"
    pq.write_table(pa.table({"audio": [0], "sentence": ["a"]}), odd)
    message = refused(folder)
    assert "`datasets` cannot build its splits: " in message and f", in {odd} (audio: int64, sentence: string, " \
        f"where {folder}/data/train-00000-of-00001.parquet has audio: struct<bytes: binary, path: string>" in message
    odd.write_bytes(b"")
    assert refused(folder) == (f"{odd}: not a readable parquet file (0 bytes): re-download or re-write it, or "
                               "remove it from the split")
    with pytest.raises(DataError, match=r"^.*train-00001-of-00001\.parquet: not a readable parquet file \(0 bytes\)"):
        open_shards(resolve_shards(str(folder)), {"audio": "audio", "text": None, "id": None, "duration": None})


def test_what_a_checkpoint_records_follows_the_files_contents(tmp_path):
    """A plain copy of the source (new file times) records the same; another file's content is named."""
    folder = source(tmp_path / "a", [good(), good()])
    ds, files = load_split(cfg(folder), "train")
    copy = tmp_path / "b"
    shutil.copytree(folder, copy, copy_function=shutil.copyfile)
    ds2, files2 = load_split(cfg(copy), "train")
    assert files2 == files == {"train-00000-of-00001.parquet": files["train-00000-of-00001.parquet"]}
    assert data_change(with_contents(ds, files), with_contents(ds2, files2), tmp_path) is None
    changed = {"train-00000-of-00001.parquet": "0" * 16}
    assert data_change(with_contents(ds, files), with_contents(ds2, changed), tmp_path) == (
        "training data changed: 1 shard changed (its content digest differs): train-00000-of-00001.parquet")


COLUMNS = {"audio": "audio", "text": None, "id": None, "duration": None}


def test_a_validation_split_too_small_for_its_readers_names_what_fixes_it(tmp_path):
    """Its partitions are one per process × data worker, not --stream_partitions."""
    from common.data.source import open_streams

    folder = source(tmp_path, [good()] * 8)
    settings = SimpleNamespace(**vars(cfg(folder)), train_split_name="train", eval_split_name="validation",
                               seed=0, stream_partitions=2, stream_block_rows=8, per_device_train_batch_size=2)
    accelerator = SimpleNamespace(num_processes=2, is_main_process=True)
    with pytest.raises(RunError) as e:
        open_streams(settings, accelerator, tmp_path / "out", text=False, num_workers=0)
    assert str(e.value) == (
        "1 rows cannot fill 2 partitions of 1 batches: the validation split (--eval_split_name validation) is read "
        "in one partition per process × data worker (2 × 1), each needing a row: give it more rows, or launch fewer "
        "processes (--num_processes) or data workers (--num_workers)")
    assert e.value.exit_code == 2


def test_a_shard_without_the_id_column_the_others_have_names_no_flag(tmp_path):
    folder = source(tmp_path, [good()])
    pq.write_table(pa.table({"id": ["x"], "audio": pa.array([good()], AUDIO), "sentence": ["a"]}),
                   folder / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"audio": pa.array([good()], AUDIO), "sentence": ["a"]}),
                   folder / "data" / "train-00001-of-00001.parquet")
    paths = resolve_shards(str(folder))
    with pytest.raises(RunError) as e:
        open_shards(paths, {**COLUMNS, "id": "id"})
    assert str(e.value) == (f"{paths[1]} has no id column, which {paths[0]} has (it has audio, sentence): every "
                            "shard of a split needs the same columns; add it, or drop it from all")
    assert "--id_column_name" not in str(e.value)


def stream_settings(folder, partitions):
    return SimpleNamespace(**vars(cfg(folder)), train_split_name="train", eval_split_name="validation", seed=0,
                           stream_partitions=partitions, stream_block_rows=1000, per_device_train_batch_size=8)


def test_streamed_batches_hold_what_was_asked_or_the_run_says_which_partitions_would(tmp_path, caplog):
    """200 rows in batches of 8: unset, --stream_partitions becomes 4 (batches of 7–8, not 3–4 in the
    old 64) and is set on the config (the checkpoint records it); a resume keeps the value its
    checkpoint recorded (64 before the automatic value); 64 asked for is said in one line."""
    import json
    import logging

    from common.data.source import build_stream_loaders, open_streams

    folder = source(tmp_path / "src", [good()] * 200)
    accelerator = SimpleNamespace(num_processes=1, is_main_process=True, process_index=0,
                                  device=SimpleNamespace(type="cpu"))
    settings = stream_settings(folder, None)
    train, valid = open_streams(settings, accelerator, tmp_path / "fresh", text=False, num_workers=0)
    assert settings.stream_partitions == train.partitions == 4 and len(train) == 4 * 7

    def loaders(partitions, out):
        settings = stream_settings(folder, partitions)
        streams = open_streams(settings, accelerator, out, text=False, num_workers=0)
        with caplog.at_level(logging.INFO):
            build_stream_loaders(settings, accelerator, global_batch=1, num_workers=0,
                                 train=(streams[0], None, list), valid=(streams[1], None, list))
        return settings.stream_partitions

    caplog.clear()
    assert loaders(None, tmp_path / "fresh") == 4
    assert "800 batches" not in caplog.text and "28 batches of 7–8 an epoch in 4 partitions" in caplog.text
    assert "streamed batches hold" not in caplog.text

    ckpt = tmp_path / "old" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text(json.dumps({"config": {"stream_partitions": 64}}))
    (ckpt / "COMPLETE").write_text("")
    caplog.clear()
    assert loaders(None, tmp_path / "old") == 64  # a resume: the checkpoint's partitions, its batches
    short = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert short == ["streamed batches hold 3–4 utterances, not --per_device_train_batch_size 8: 200 rows in 64 "
                     "partitions are 3–4 a partition, cut into batches of equal count; --stream_partitions 28 would "
                     "give batches of 7–8 (in a new --output_dir: the partitions decide the batches)"]


class Ids:
    """A recipe's items at their smallest: a row's id (`item(row)`; `dataset[i]` over a manifest)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.item(self.rows[i])

    def item(self, row):
        return row["id"]


def collate_ids(items):
    return {"ids": list(items)}


def open_settings(folder, streaming: bool, **changes):
    """A recipe's Config as `Source.open` and `Source.loaders` read it."""
    return SimpleNamespace(**{**vars(cfg(folder)), "streaming": streaming, "READS_TEXT": True, "EXTRA_COLUMNS": (), "train_split_name": "train",
                              "eval_split_name": "validation", "seed": 0, "stream_partitions": 2 if streaming else None,
                              "stream_block_rows": 8, "per_device_train_batch_size": 2 if streaming else None,
                              "max_batch_seconds": 1.0,
                              "num_buckets": 2, "memory_cache_mb": 0, **changes})


ACCELERATOR = SimpleNamespace(num_processes=1, is_main_process=True, process_index=0, device=SimpleNamespace(type="cpu"),
                              main_process_first=contextlib.nullcontext)


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streamed"])
def test_a_source_offers_the_same_whatever_it_is(tmp_path, streaming):
    """`Source.open` makes the map-style / stream choice once; the rows, transcripts, loaders and
    summary come out in one shape (`RecipeData`), and only a manifest is subset by id."""
    from common.data.source import RecipeData, Source

    folder = source(tmp_path / "src", [{"bytes": wav(frames=900 + 100 * i), "path": None} for i in range(8)],
                    sentences=[f"s{i}" for i in range(8)])
    settings = open_settings(folder, streaming)
    src = Source.open(settings, ACCELERATOR, tmp_path / "out", global_batch=1, num_workers=0,
                      corpus=lambda: pytest.fail("a --dataset_name source reads no folder"), splits=None)
    assert (src.kind, src.streamed) == (("stream", True) if streaming else ("map", False))
    ids, texts = src.texts("train")
    assert sorted(texts) == [f"s{i}" for i in range(8)] and len(set(ids)) == 8
    src.select(lambda splits: {**splits, "train": splits["train"].select(range(4))})
    data = src.loaders(train=(Ids, collate_ids), valid=(Ids, collate_ids))
    assert isinstance(data, RecipeData) and data.source is src and data.recorded == {} and not data.resumes
    assert data.data_dir == str(folder) and data.summary == src.summary()
    assert data.summary["utterances"] == (8 if streaming else 4)  # a stream keeps its rows
    assert list(data.summary["shard_files"]) == ["train-00000-of-00001.parquet"]
    epoch = [i for batch in data.train_loader for i in batch["ids"]]
    assert sorted(epoch) == sorted(ids if streaming else ids[:4])
    assert (data.durations == {}) == streaming  # a stream's batches carry their durations
    [row] = data.valid_rows(5)  # the split has one row
    assert row["audio"]["bytes"][:4] == b"RIFF" and data.valid_items.item(row) == row["id"]
    assert len(data.sample_rows(2)) == 2


def test_a_folder_source_reads_the_recipes_splits_once_checked(tiny_corpus, tmp_path, caplog):
    """No --dataset_name: the folder `corpus()` gives, read by the recipe's `splits` through the
    data check; what the recipe holds out is logged and kept, not loaded."""
    import logging

    from common.data.source import Source

    folder = tiny_corpus / "librispeech"
    settings = SimpleNamespace(dataset_name=None, streaming=False, READS_TEXT=False, EXTRA_COLUMNS=(), sample_rate=16000,
                               min_seconds=0.5, max_seconds=30.0, wrong_sample_rate="resample", on_bad_data="error",
                               data_check="header", seed=0, max_batch_seconds=8.0, num_buckets=2, memory_cache_mb=0)
    with caplog.at_level(logging.INFO):
        src = Source.open(settings, ACCELERATOR, tmp_path / "out", global_batch=1, num_workers=0,
                          corpus=lambda: str(folder),
                          splits=lambda data_dir, check: {"train": check("train", "train"),
                                                          "validation": check("valid", "validation"),
                                                          "test": check("test", "test")})
    assert src.kind == "folder" and src.data_dir == str(folder)
    assert sorted(p.name for p in (tmp_path / "out" / "data").iterdir() if p.is_dir()) >= ["test", "train", "valid"]
    assert f"{len(src.splits['test'])} test utterances held out" in caplog.text
    # each checked manifest is sealed: what another tool reads back of it is what the check wrote
    assert len(run_manifests(tmp_path / "out", "train")) == len(src.splits["train"])
    [train_dir] = (tmp_path / "out" / "data").glob("train-*[0-9a-f]")
    assert verify_checkpoint(train_dir) is None and "manifest.jsonl" in json.loads((train_dir / "COMPLETE").read_text())["files"]
    data = src.loaders(train=(Ids, collate_ids), valid=(Ids, collate_ids))
    assert data.summary == manifest_summary(src.splits["train"])
    assert data.durations == dict(zip(src.splits["train"]["id"], src.splits["train"]["duration"]))


class Labels(Ids):
    def item(self, row):
        return row["id"], row["speaker"]


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streamed"])
def test_a_recipe_reads_a_label_column_as_it_reads_transcripts(tmp_path, streaming):
    """EXTRA_COLUMNS = ("speaker",) and --speaker_column_name spk: each row carries `speaker`, in the
    loaders' items, in `Source.column`, whichever the source; a missing column is one line naming its flag."""
    from common.data.source import Source

    folder = source(tmp_path / "src", [{"bytes": wav(frames=900 + 100 * i), "path": None} for i in range(6)])
    for split, n in (("train", 6), ("validation", 1)):  # add the label column to each split's file
        path = folder / "data" / f"{split}-00000-of-00001.parquet"
        table = pq.read_table(path)
        pq.write_table(table.append_column("spk", pa.array([f"s{i % 3}" for i in range(n)])), path)
    settings = open_settings(folder, streaming, READS_TEXT=False, EXTRA_COLUMNS=("speaker",), speaker_column_name="spk")
    src = Source.open(settings, ACCELERATOR, tmp_path / "out", global_batch=1, num_workers=0,
                      corpus=lambda: pytest.fail("a --dataset_name source reads no folder"), splits=None)
    ids, speakers = src.column("train", "speaker")
    assert sorted(speakers) == ["s0", "s0", "s1", "s1", "s2", "s2"]
    data = src.loaders(train=(Labels, collate_ids), valid=(Labels, collate_ids))
    items = [item for batch in data.train_loader for item in batch["ids"]]
    assert sorted(map(tuple, items)) == sorted(zip(ids, speakers))
    [row] = data.valid_rows(1)
    assert row["speaker"] == "s0"

    settings.speaker_column_name = "speaker_id"
    with pytest.raises(RunError) as e:
        Source.open(settings, ACCELERATOR, tmp_path / "out2", global_batch=1, num_workers=0, corpus=None, splits=None)
    assert str(e.value).startswith("--speaker_column_name speaker_id: no such column in ")
    assert "(it has audio, sentence, spk)" in str(e.value)


@pytest.mark.parametrize("damage,message", [
    (lambda f: (f / "manifest.jsonl").write_text(""), "does not match its COMPLETE marker (manifest.jsonl has 0 bytes"),
    (lambda f: (f / "manifest.jsonl").write_text('{"id": "a", "text": "same words"}\n'), "manifest.jsonl is corrupted"),
    (lambda f: (f / "COMPLETE").unlink() or (f / "manifest.jsonl").write_text(""), "no rows (a training manifest never"),
    (lambda f: (f / "COMPLETE").unlink() or (f / "manifest.jsonl").write_text('{"id": "a", "text": "x"}\n\n'),
     "manifest.jsonl:2: not a JSON object (''); it is not as the data check wrote it: delete"),
    (lambda f: (f / "COMPLETE").unlink() or (f / "manifest.jsonl").write_text("[1]\n"), "manifest.jsonl:1: not a JSON object"),
    (lambda f: (f / "COMPLETE").unlink() or (f / "manifest.jsonl").write_text('{"id": "a"}\n'), "its 'text' is missing"),
    (lambda f: (f / "COMPLETE").unlink() or (f / "manifest.jsonl").write_text('{"id": "a", "text": null}\n'),
     "its 'text' is null, not text"),
    (lambda f: (f / "COMPLETE").unlink() or (f / "manifest.jsonl").unlink() or (f / "manifest.jsonl").mkdir(),
     "manifest.jsonl: a folder, not the manifest"),
], ids=["emptied", "edited", "empty-unsealed", "blank-line", "not-an-object", "no-text", "null-text", "a-folder"])
def test_a_runs_manifests_are_read_back_checked_in_one_line(tmp_path, damage, message):
    """What another tool reads of a run's checked manifests (the TTS score: its ASR judge's training
    sentences): a manifest changed since its seal, or (a folder from before seals) with a line that is
    not a row, or none, is one `DataError` line naming the file; a builder's unpublished folder is not read."""
    folder = tmp_path / "data" / "train-0123456789abcdef"
    folder.mkdir(parents=True)
    (folder / "manifest.jsonl").write_text('{"id": "a", "text": "some words"}\n')
    seal_export(folder)
    (folder / COMPLETE_MARKER).write_text("{}")
    unpublished = tmp_path / "data" / "train-0123456789abcdef.tmp-host-1-abcd"
    shutil.copytree(folder, unpublished)
    (unpublished / "manifest.jsonl").write_text("torn")
    assert run_manifests(tmp_path, "train") == [{"id": "a", "text": "some words"}]
    assert run_manifests(tmp_path, "valid") is None
    damage(folder)
    with pytest.raises(DataError) as e:
        run_manifests(tmp_path, "train")
    assert message in str(e.value) and "\n" not in str(e.value) and e.value.exit_code == 2


def nan_wav() -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.array([0.1, np.nan] * 450, "float32"), 16000, format="WAV", subtype="FLOAT")
    return buf.getvalue()


def test_a_map_style_source_skips_bad_rows_and_full_mode_finds_nan_audio(tmp_path, caplog):
    """--on_bad_data skip and --data_check full work on a map-style source as on a stream and a folder:
    NaN audio (which the header check cannot see) is refused in full mode, or left out under skip with
    the other bad rows, their counts logged; the rows kept keep their ids (row numbers in the source)."""
    import logging

    rows = [good(), {"bytes": nan_wav(), "path": None}, {"bytes": b"not audio", "path": None}, good(),
            {"bytes": wav(frames=1), "path": None}]
    folder = source(tmp_path, rows)
    with pytest.raises(DataError) as e:
        load_split(cfg(folder, data_check="full"), "train")
    assert str(e.value).startswith(f"--dataset_name {folder} split train row 1: empty audio (silent or non-finite "
                                   "samples); re-encode or remove it, or --on_bad_data skip drops such rows")
    with caplog.at_level(logging.WARNING):
        ds, _ = load_split(cfg(folder, data_check="full", on_bad_data="skip"), "train")
    assert ds["id"] == ["00000000", "00000003"] and "problem" not in ds.column_names
    assert "skipping 3 of 5 rows of --dataset_name" in caplog.text
    assert "(1 empty audio, 1 unreadable audio, 1 too short), e.g. row 1: empty audio" in caplog.text
    with pytest.raises(DataError) as e:  # the header check cannot see NaN: the first bad row it sees
        load_split(cfg(folder), "train")
    assert f"split train row 2: unreadable audio (" in str(e.value) and "--data_check full also finds" in str(e.value)


def test_a_one_sample_clip_and_a_null_label_are_one_line_from_a_map_style_source(tmp_path):
    """A 1-sample clip (a padding traceback in the feature statistics before) is "too short"; a null
    or blank label cell (it trained as the speaker "None") is "no speaker"; skip leaves them out."""
    folder = source(tmp_path, [good(), {"bytes": wav(frames=1), "path": None}])
    assert refused(folder).startswith(f"--dataset_name {folder} split train row 1: too short (1 samples < 0.05 s)")
    folder = source(tmp_path / "labels", [good(), good(), good()])
    path = folder / "data" / "train-00000-of-00001.parquet"
    pq.write_table(pq.read_table(path).append_column("spk", pa.array(["a", None, " "])), path)
    settings = cfg(folder, speaker_column_name="spk")
    with pytest.raises(DataError) as e:
        load_split(settings, "train", text=False, extra=("speaker",))
    assert str(e.value).startswith(f"--dataset_name {folder} split train row 1: no speaker (its --speaker_column_name "
                                   f"cell is null)")
    settings.on_bad_data = "skip"
    ds, _ = load_split(settings, "train", text=False, extra=("speaker",))
    assert ds["speaker"] == ["a"] and ds["id"] == ["00000000"]


def test_recipe_data_sets_the_epoch_of_its_sampler_and_of_the_items_and_collator_that_draw_per_epoch():
    """`data.epoch_objects` (what every main hands train_batches) and `data.set_epoch` (what the
    benchmarks call): the sampler always, the training items and collator where they define set_epoch."""
    from common.data.source import RecipeData

    class Epoch:
        def __init__(self):
            self.epoch = 0

        def set_epoch(self, epoch):
            self.epoch = epoch

    sampler, items, plain = Epoch(), Epoch(), object()
    data = RecipeData(None, items, None, plain, None, sampler, None, summary={}, durations={})
    assert data.epoch_objects == (sampler, items) and not data.resumes and data.recorded == {}
    data.set_epoch(3)
    assert sampler.epoch == items.epoch == 3
    collator = Epoch()
    assert RecipeData(None, plain, None, collator, None, sampler, None, summary={}, durations={}).epoch_objects == (
        sampler, collator)
