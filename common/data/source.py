"""A run's training data, from wherever the config says: `Source.open` makes the one choice between a
corpus folder (--data_dir or the built-in corpus: checked manifests, `common.data.manifest`), a `datasets`
source loaded whole (map-style) and one streamed (--streaming), and offers what a recipe needs
whichever it is: the rows and transcripts of each split, the loaders over the recipe's items and
collators (as one `RecipeData`), and the summary a checkpoint compares (the data's fingerprint).
A recipe's `build_data` holds only what is its own: the folder's layout, its items and collators.

The flags are `common.config.DatasetConfig`'s, named as in transformers' run_speech_recognition_ctc.py:
--dataset_name (a local folder of data files, or a name `datasets` resolves), --dataset_config_name,
--train_split_name, --eval_split_name, --audio_column_name, --text_column_name, --streaming; and a
recipe's own columns (`DatasetConfig.EXTRA_COLUMNS`, e.g. a label: --speaker_column_name).

- **Map-style** (`load_split`): `datasets` builds the split once into its cache (`HF_DATASETS_CACHE`),
  the audio column is kept undecoded (`Audio(decode=False)`: `datasets` 5 decodes with torchcodec, not
  a requirement here; the recipes decode the bytes with soundfile), and the columns are renamed to the
  manifest's: `audio`, `text`, `id` (the source's `id` column, else the row number, zero-padded),
  `duration` (seconds, from the audio headers, cached by `datasets`). The recipe's duration-bucketed
  loaders take it as they take a folder's manifest: batches sized in seconds, the same resume. Its
  summary (what a checkpoint compares) adds `shard_files`, each data file's content digest by name
  (`common.data.stream.shard_files`: size and sampled bytes, not file times): a copied folder resumes, a
  rewritten file refuses the resume, named. Its fingerprint is the manifest's, as a folder's
  (`common.data.manifest.manifest_summary`); a stream's is its shards' (`ShardStream.summary`): both are
  made in `Source.summary`, and what they hash is what checkpoints already recorded.
- **Streamed** (`open_stream`, `build_stream_loaders`; --streaming true): `common.data.stream` reads the
  split's parquet shards in place. Batches hold --per_device_train_batch_size utterances, not seconds
  (a fixed count per partition is what lets every rank end the epoch together); the validation split is
  streamed too, each utterance once over the processes. The resume is the position (epoch, global
  batches), restored without reading what was consumed; changed shards refuse it.

The data check: a stream's rows are checked before training as a folder's files are
(`common.data.stream_check.check_shards`, once per shard, cached in <output_dir>/data), and a map-style
source's rows as `datasets` reads them for their durations (`_checked_row`, cached by `datasets`): with
--on_bad_data error (the default) a row whose audio does not decode, has no samples or is shorter than
`common.data.stream_check.MIN_SECONDS` (0.05 s), whose transcript (recipes that read one) is empty, or whose
label (`EXTRA_COLUMNS`, e.g. a speaker) is null or blank, refuses the run in one line naming its shard or
split and row (`DataError`, exit code 2); with skip the bad rows are left out with counts logged (a
map-style source's rows keep their row-number ids); --data_check full decodes every sample (also finds
silent and NaN audio). An audio cell must be encoded bytes or the path of a regular file (checked
before soundfile opens it: an integer would be read as a file descriptor, 0 = stdin, and a FIFO blocks
its opener); multi-channel audio is refused, as from a folder. A 0-byte parquet file and data files
whose columns disagree stop a map-style run in one line too. Neither kind has the folder check's
duration and sample-rate rules (--min_seconds, --max_seconds, --wrong_sample_rate refused); audio at
another rate is resampled on load, as from a folder with the default --wrong_sample_rate resample.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import soundfile as sf

from common.data.loading import build_loaders
from common.training.faults import UsageError
from common.training.logs import get_logger
from common.data.manifest import DataError, DataPolicy, manifest_summary, prepare_manifest, read_manifest
from common.training.sealing import MARKER, seal_export, verify_checkpoint
from common.training.prepare import COMPLETE_MARKER
from common.data.datacheck import decoded_facts
from common.data.stream import (BadAudioCell, ShardStream, StreamDataset, StreamLoader, audio_source, audio_struct,
                                auto_partitions, batch_shortfall, batch_sizes, open_shards, parquet_footer,
                                resolve_shards, shard_files, split_files)
from common.data.stream_check import MIN_SECONDS, check_shards, label_problem

logger = get_logger(__name__)  # main process only


# ---------------------------------------------------------------------------------------------
# The one data seam: where the rows come from, and what a recipe builds on them
# ---------------------------------------------------------------------------------------------


class Source:
    """The training and validation rows of a run, from a folder, a `datasets` source loaded whole, or
    a stream (`kind`: "folder", "map", "stream"). `splits` holds "train" and "validation" (and, from
    a folder, what the recipe held out, e.g. "test"): manifests (`datasets.Dataset`: id, duration,
    path or audio, text where read), or `ShardStream`s when streamed."""

    def __init__(self, kind: str, splits: dict, data_dir, *, contents: dict | None = None, cfg=None,
                 accelerator=None, global_batch: int = 1, num_workers: int = 0):
        self.kind, self.splits, self.data_dir, self.contents = kind, splits, data_dir, contents
        self.cfg, self.accelerator, self.global_batch, self.num_workers = cfg, accelerator, global_batch, num_workers

    @classmethod
    def open(cls, cfg, accelerator, out: Path, *, global_batch: int, num_workers: int,
             corpus: Callable[[], str], splits: Callable[[str, Callable], dict], charset: str | None = None) -> Source:
        """The source `cfg` names, its rows checked: --dataset_name streamed (--streaming; rows checked
        once into <out>/data, --on_bad_data) or loaded whole into the `datasets` cache (audio kept
        undecoded); else the folder `corpus()` (--data_dir, or the built-in corpus, made once), read
        by the recipe's `splits(data_dir, check)` into {"train", "validation", ...} manifests, where
        `check(name, subfolder)` is the checked manifest of <data_dir>/<subfolder> (the whole folder
        for None) kept as <out>/data/<name> (the data check: once per output_dir; `charset`: the
        characters transcripts may hold, None: any). Transcripts are read where `cfg.READS_TEXT`, and
        from a --dataset_name source each column of `cfg.EXTRA_COLUMNS` too (a label: a row's `key`
        from the column --<key>_column_name names; a folder's rows have none: the recipe derives them).
        `global_batch` and `num_workers` size the stream's partitions and the loaders (`loaders`)."""
        text, extra = cfg.READS_TEXT, tuple(cfg.EXTRA_COLUMNS)
        launch = dict(cfg=cfg, accelerator=accelerator, global_batch=global_batch, num_workers=num_workers)
        if cfg.streaming:  # parquet shards read in place, their rows checked once
            train, valid = open_streams(cfg, accelerator, out, text=text, extra=extra, num_workers=num_workers,
                                        global_batch=global_batch)
            return cls("stream", {"train": train, "validation": valid}, cfg.dataset_name, **launch)
        if cfg.dataset_name:  # built once into the `datasets` cache, audio kept undecoded
            train, valid, contents = load_splits(cfg, accelerator, text=text, extra=extra)
            return cls("map", {"train": train, "validation": valid}, cfg.dataset_name, contents=contents, **launch)
        data_dir = corpus()
        policy = DataPolicy(cfg.sample_rate, cfg.min_seconds, cfg.max_seconds, cfg.wrong_sample_rate, charset=charset,
                            on_bad_data=cfg.on_bad_data, data_check=cfg.data_check)

        def check(name: str, subfolder: str | None):
            return prepare_manifest(out, name, data_dir, policy, subfolder, is_main_process=accelerator.is_main_process,
                                    seal=seal_export, text=text)  # sealed: other tools read it back (`run_manifests`)

        found = splits(data_dir, check)
        for name in found.keys() - {"train", "validation"}:
            logger.info(f"{len(found[name])} {name} utterances held out")
        return cls("folder", found, data_dir, **launch)

    @property
    def streamed(self) -> bool:
        return self.kind == "stream"

    def texts(self, split: str) -> tuple[list[str], list]:
        """(ids, transcripts) of a split's rows; a stream's read without the audio (`stream_column`)."""
        return self.column(split, "text")

    def column(self, split: str, name: str) -> tuple[list[str], list]:
        """(ids, values) of a split's rows' column `name` ("text", or a key of `cfg.EXTRA_COLUMNS`); a
        stream's read without the audio (`stream_column`)."""
        rows = self.splits[split]
        return stream_column(rows, name) if self.streamed else (rows["id"], rows[name])

    def select(self, choose: Callable) -> None:
        """The manifests' splits replaced by `choose(splits)` (a subset of the utterances, chosen by
        id): before `loaders`, which summarizes the training split as it is then. A stream keeps its
        rows (choosing by id would read it all)."""
        if not self.streamed:
            self.splits = choose(self.splits)

    def summary(self) -> dict:
        """What a checkpoint records about the training data (`TrainState.data`), compared on resume:
        a stream's shards (`ShardStream.summary`), or the manifest's rows (`manifest_summary`) and,
        from a `datasets` source, each data file's content digest (`shard_files`)."""
        train = self.splits["train"]
        if self.streamed:
            return train.summary()
        return manifest_summary(train) if self.contents is None else with_contents(train, self.contents)

    def size(self, split: str) -> int:
        """Rows in a split (a stream's: those its data check kept)."""
        rows = self.splits[split]
        return rows.rows if self.streamed else len(rows)

    def rows(self, split: str, positions) -> list:
        """The rows at `positions` of a split (a stream's in epoch 0's order), audio cells as
        {"bytes", "path"} structs where the source has them."""
        rows = self.splits[split]
        if self.streamed:
            return [{**row, "audio": audio_struct(row["audio"])}
                    for row in (rows.read_rows(0, i, i + 1)[0] for i in positions)]
        return rows.select(positions)

    def loaders(self, *, train: tuple, valid: tuple, tokenizer=None, recorded: dict | None = None) -> RecipeData:
        """The recipe's data on these rows: `train` and `valid` are each (items, collator), `items(rows)`
        the recipe's dataset over a split's manifest (`rows` None when streamed: its `item(row)` makes
        an item from a row). Duration-bucketed loaders over manifests (`common.data.loading.build_loaders`:
        batches in seconds), stream loaders over streams (batches in utterances). `tokenizer` and
        `recorded`: RecipeData's fields of those names."""
        (make_train, collate), (make_valid, valid_collate) = train, valid
        cfg = self.cfg
        shape = dict(global_batch=self.global_batch, num_workers=self.num_workers)
        rows = {name: (None if self.streamed else self.splits[name]) for name in ("train", "validation")}
        train_items, valid_items = make_train(rows["train"]), make_valid(rows["validation"])
        if self.streamed:
            train_loader, valid_loader = build_stream_loaders(
                cfg, self.accelerator, **shape, train=(self.splits["train"], train_items, collate),
                valid=(self.splits["validation"], valid_items, valid_collate))
            train_sampler, durations = train_loader, {}  # a stream's batches carry their durations
        else:
            train_loader, train_sampler, valid_loader = build_loaders(
                cfg, self.accelerator, **shape, train=(rows["train"], train_items, collate),
                valid=(rows["validation"], valid_items, valid_collate))
            durations = dict(zip(rows["train"]["id"], rows["train"]["duration"]))
        return RecipeData(self, train_items, valid_items, collate, train_loader, train_sampler, valid_loader,
                          summary=self.summary(), durations=durations, tokenizer=tokenizer, recorded=recorded or {})


@dataclass
class RecipeData:
    """What every recipe's `build_data` returns (`Source.loaders`), whatever the source: its train.py,
    the benchmarks and the tests read the same fields (the seams: README.md, "Adapt a recipe")."""

    source: Source  # the rows: `source.splits` (manifests or streams), `source.texts(split)`, `source.data_dir`
    train_items: Any  # the training dataset, before the RAM cache: `item(row)`, or item i as the collator takes it
    valid_items: Any
    collate: Any  # the training collator
    train_loader: Any  # for accelerator.prepare; its batches: a multiple of the global batch per epoch
    train_sampler: Any  # the object whose epoch `train_batches` sets: the DurationBatchSampler, or the StreamLoader
    valid_loader: Any  # every validation utterance once, over all processes
    summary: dict  # what a checkpoint records about the training data (TrainState.data)
    durations: dict  # utterance id → seconds (Throughput; a stream's batches carry their own)
    tokenizer: Any = None  # what the items encode transcripts with, where it sizes the model (ASR; TTS: its Symbols)
    # Settings the data decided, which the run records in its config (config.yaml, checkpoints, final/):
    # TTS's symbol table read off the transcripts (--symbols auto) and its --phonemizer_language. The
    # seams read them here; main applies them to the run's config where it records it.
    recorded: dict = field(default_factory=dict)
    # Whether the run resumes from a checkpoint (main sets it from start_run's choice): `build_models`
    # then leaves --init_from unread, the checkpoint's weights being loaded over the models anyway.
    resumes: bool = False

    @property
    def epoch_objects(self) -> tuple:
        """What gets `set_epoch(epoch)` at each epoch (`train_batches`' epoch_objects): the training
        sampler, and the training items and collator where they define it (per-epoch randomness:
        speed perturbation, masks, segments): accelerate's sharded DDP loader calls no set_epoch on
        them, so main, the benchmarks and the tests reach the same objects through here."""
        return (self.train_sampler, *(o for o in (self.train_items, self.collate) if hasattr(o, "set_epoch")))

    def set_epoch(self, epoch: int) -> None:
        """`set_epoch(epoch)` on every one of `epoch_objects` (what the benchmarks call before iterating)."""
        for obj in self.epoch_objects:
            obj.set_epoch(epoch)

    @property
    def data_dir(self):
        """The corpus folder or --dataset_name these were read from (the model card names it)."""
        return self.source.data_dir

    def sample_rows(self, n: int):
        """About `n` training rows evenly spaced (the feature statistics' sample): every (len // n)-th
        of the manifest (sorted by id), or of a stream's rows in epoch 0's order."""
        total = self.source.size("train")
        return self.source.rows("train", range(0, total, max(1, total // n)))

    def valid_rows(self, n: int):
        """The first `n` validation rows (the samples a recipe logs at each validation)."""
        return self.source.rows("validation", range(min(n, self.source.size("validation"))))


def run_manifests(run_dir, prefix: str, by_folder: bool = False) -> list[dict] | list[list[dict]] | None:
    """Every row of the checked manifests a run's data check wrote for the splits whose names start
    with `prefix` (<run_dir>/data/<name>-<fingerprint>/: all of them, a run resumed on changed data has
    several; `by_folder`: one list of rows per folder, oldest name first), or None when it wrote none (a
    `datasets` source, a copied final/). Only published folders
    count (not a builder's temporary one); each must match its COMPLETE marker (`verify_checkpoint`:
    a manifest edited or emptied since is refused; a folder from before the marker has its lines
    checked only), and its lines must be rows (`read_manifest`). `DataError` (one line) otherwise."""
    name = re.compile(re.escape(prefix) + r".*-[0-9a-f]{16}")  # `prepare_manifest`'s <name>-<fingerprint>
    folders = sorted(f for f in (Path(run_dir) / "data").glob(f"{prefix}*")
                     if name.fullmatch(f.name) and (f / COMPLETE_MARKER).is_file())
    if not folders:
        return None
    rows = []
    for folder in folders:
        problem = verify_checkpoint(folder) if (folder / MARKER).exists() else None
        if problem:
            raise DataError(f"{folder}: does not match its {MARKER} marker ({problem}): it changed since the data "
                            f"check wrote it; delete {folder} and re-launch the run that wrote it (it is rebuilt)")
        folder_rows = read_manifest(folder)
        if by_folder:
            rows.append(folder_rows)
        else:
            rows += folder_rows
    return rows


def audio_seconds(audio) -> float:
    """Duration of an audio cell, from its header."""
    info = sf.info(audio_source(audio))
    return info.frames / info.samplerate


def _checked_row(cfg, split: str, text: bool, extra: tuple[str, ...] = ()):
    """A `datasets.map` function (audio, text?, labels..., row index) → {"duration", "problem"} that finds
    what the streamed check finds: an audio cell that is not encoded bytes or a regular file's path,
    audio that does not decode, has no frames or several channels (refused as from a folder, not
    averaged), is shorter than `MIN_SECONDS`, or (--data_check full: every sample decoded) is silent or
    non-finite; (`text`) a transcript that is not a non-empty string; a label (`extra`) that is null or
    blank. With --on_bad_data error the first such row stops the run in one line naming split and row;
    with skip its `problem` says why, and `load_split` leaves it out."""
    where, mode, skip = f"--dataset_name {cfg.dataset_name} split {split}", cfg.data_check, cfg.on_bad_data == "skip"

    def check(audio, *rest):
        *values, row = rest
        transcript, labels = values[:int(text)], dict(zip(extra, values[int(text):]))
        problem, seconds = _audio_problem(audio, mode), 0.0
        if isinstance(problem, float):
            problem, seconds = None, problem
        found = label_problem(labels)
        if problem is None and found:
            problem = f"{found[0]} ({found[1]})"
        if problem is None and transcript and not (isinstance(transcript[0], str) and transcript[0].strip()):
            problem = "empty transcript" if isinstance(transcript[0], str) else \
                f"transcript is not text ({type(transcript[0]).__name__})"
        if problem and not skip:
            raise DataError(f"{where} row {row}: {problem}; re-encode or remove it, or --on_bad_data skip drops such rows"
                            + ("" if mode == "full" else " (--data_check full also finds silent and NaN audio)"))
        return {"duration": seconds, "problem": problem or ""}

    return check


def _audio_problem(audio, mode: str) -> str | float:
    """Why an audio cell is unusable (`_checked_row`), or its duration in seconds."""
    try:
        source = audio_source(audio)
        if mode == "full":  # every sample decoded: also finds silent and non-finite audio
            facts = decoded_facts(source, "full")
        else:  # the header only, as loading the split always did
            info = sf.info(source)
            facts = {"frames": info.frames, "sample_rate": info.samplerate, "channels": info.channels}
    except BadAudioCell as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 — libsndfile raises several types for bad audio
        facts = {"error": "unreadable audio", "detail": str(e)}
    if "error" in facts:  # the message names a BytesIO at an address that changes every run
        detail = re.sub(r"<_io\.BytesIO object at 0x[0-9a-f]+>", "its bytes", facts.get("detail", ""))[:120]
        return f"{facts['error']} ({detail})" if detail else facts["error"]
    frames, sample_rate = facts["frames"], facts["sample_rate"]
    if facts["channels"] != 1:
        return f"multi-channel audio ({facts['channels']} channels)"
    if frames == 0:
        return "empty audio"
    if facts.get("silent"):
        return "empty audio (silent or non-finite samples)"
    if frames < MIN_SECONDS * sample_rate:
        return f"too short ({frames} samples < {MIN_SECONDS} s)"
    return frames / sample_rate


def _odd_schema(paths: list[str]) -> str:
    """", in <file> (columns …, where <first file> has …)" for the first parquet file whose columns
    differ from the first one's, or "" (what a failed `datasets` build does not say; it builds every
    split with one schema)."""
    import pyarrow.parquet as pq

    parquet = [p for p in paths if p.endswith(".parquet")]
    schemas = [pq.read_schema(p).remove_metadata() for p in parquet]
    for path, schema in zip(parquet[1:], schemas[1:]):
        if not schema.equals(schemas[0]):
            show = lambda sc: ", ".join(f"{f.name}: {f.type}" for f in sc)[:200]  # noqa: E731
            return f", in {path} ({show(schema)}, where {parquet[0]} has {show(schemas[0])})"
    return ""


def load_split(cfg, split: str, *, text: bool = True, extra: tuple[str, ...] = ()):
    """(the split as a manifest, `datasets.Dataset`: id, audio, text, duration; the digest of its data
    files: the training summary's `contents`, `with_contents`);
    `text` False: no transcript column is read (self-supervised recipes); `extra`: further columns
    kept, each `key` read from the column `cfg.<key>_column_name` (e.g. a speaker label). Under several processes,
    call it main process first (`accelerator.main_process_first()`): `datasets` builds its cache once."""
    import datasets

    builder, paths = split_files(cfg.dataset_name, cfg.dataset_config_name, split)
    local = [p for p in paths if "://" not in p]
    every = sorted(str(f) for files in builder.config.data_files.values() for f in files if "://" not in str(f))
    for path in local:
        if path.endswith(".parquet"):
            parquet_footer(path)
    try:
        builder.download_and_prepare()
    except datasets.exceptions.DatasetGenerationError as e:  # its cause is what went wrong, in which file
        cause = e.__cause__ or e
        raise DataError(f"--dataset_name {cfg.dataset_name}: `datasets` cannot build its splits: "
                        f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
                        f"{_odd_schema(every)} (every data file of a split needs the same columns and types)") from None
    ds = builder.as_dataset(split=split)
    ours = {"audio": cfg.audio_column_name, **({"text": cfg.text_column_name} if text else {}),
            **{key: getattr(cfg, f"{key}_column_name") for key in extra}}
    for name, theirs in ours.items():
        if theirs not in ds.column_names:
            raise UsageError(f"--{name}_column_name {theirs}: no such column in {cfg.dataset_name} split {split} "
                             f"(it has {', '.join(ds.column_names)})")
    keep = list(ours.values()) + (["id"] if "id" in ds.column_names and "id" not in ours.values() else [])
    ds = ds.select_columns(keep)
    ds = ds.rename_columns({theirs: name for name, theirs in ours.items() if theirs != name})
    feature = ds.features["audio"]
    if not (isinstance(feature, (datasets.Audio, dict)) or getattr(feature, "dtype", "") in (
            "binary", "large_binary", "string", "large_string")):
        raise DataError(f"--audio_column_name {cfg.audio_column_name} of --dataset_name {cfg.dataset_name} split "
                        f"{split} holds {getattr(feature, 'dtype', type(feature).__name__)}, not audio (encoded "
                        f"bytes, a file path, or a datasets Audio column): name the audio column")
    ds = ds.cast_column("audio", datasets.Audio(decode=False))  # also from a column of bytes or paths
    ds = ds.map(_checked_row(cfg, split, text, extra), input_columns=["audio"] + (["text"] if text else []) + list(extra),
                with_indices=True, desc=f"{split}: durations from the audio headers")
    if "id" not in ds.column_names:  # the row numbers before any row is skipped: the same rows keep their ids
        ds = ds.add_column("id", [f"{i:08d}" for i in range(len(ds))])
    return _without_bad_rows(ds, f"--dataset_name {cfg.dataset_name} split {split}"), shard_files(local)


def _without_bad_rows(ds, where: str):
    """`ds` without the rows `_checked_row` found unusable (--on_bad_data skip), their counts logged."""
    problems = ds["problem"]
    bad = [i for i, problem in enumerate(problems) if problem]
    if bad:
        counts = Counter(problems[i].split(" (")[0] for i in bad)
        logger.warning(f"skipping {len(bad)} of {len(ds)} rows of {where} ("
                       + ", ".join(f"{n} {reason}" for reason, n in counts.most_common())
                       + f"), e.g. row {bad[0]}: {problems[bad[0]]}")
        keep = set(bad)
        ds = ds.select([i for i in range(len(ds)) if i not in keep])
    return ds.remove_columns("problem")


def with_contents(manifest, contents: dict[str, str]) -> dict:
    """What a checkpoint records about training data loaded by `load_split` (then subset or
    filtered): the manifest's summary, and each data file's content digest by name (`shard_files`)."""
    return {**manifest_summary(manifest), "shard_files": contents}


def load_splits(cfg, accelerator, *, text: bool, extra: tuple[str, ...] = ()):
    """(training manifest, validation manifest, the training files' digest) of --train_split_name and
    --eval_split_name (`load_split`), built by the main process first (`datasets` caches them once)."""
    with accelerator.main_process_first():
        (train_set, contents), (valid_set, _) = (load_split(cfg, split, text=text, extra=extra)
                                                 for split in (cfg.train_split_name, cfg.eval_split_name))
    return train_set, valid_set, contents


# ---------------------------------------------------------------------------------------------
# Streamed
# ---------------------------------------------------------------------------------------------


def open_stream(cfg, split: str, *, text: bool, partitions: int | None, check_dir=None, extra: tuple[str, ...] = (),
                is_main_process: bool = True, too_few: str = "lower --stream_partitions",
                multiple_of: int = 1) -> ShardStream:
    """The split's parquet shards as a `ShardStream` of --per_device_train_batch_size batches; the
    source's `id` column names the utterances where it has one. With `check_dir`, its rows are
    checked first (`check_shards`, --data_check, --on_bad_data; the result cached there).
    `partitions` None: `auto_partitions` of the rows read, a multiple of `multiple_of`."""
    import pyarrow.parquet as pq

    paths = resolve_shards(cfg.dataset_name, cfg.dataset_config_name, split)
    if not paths:
        raise UsageError(f"--dataset_name {cfg.dataset_name}: split {split} has no data files")
    has_id = "id" in pq.read_schema(paths[0]).names
    columns = {"audio": cfg.audio_column_name, "text": cfg.text_column_name if text else None,
               "id": "id" if has_id else None, "duration": None,
               **{key: getattr(cfg, f"{key}_column_name") for key in extra}}
    shards = open_shards(paths, columns)
    if check_dir is not None:
        shards = check_shards(shards, columns, check_dir, mode=cfg.data_check, on_bad_data=cfg.on_bad_data,
                              is_main_process=is_main_process)
    if partitions is None:
        partitions = auto_partitions(sum(s.rows for s in shards), cfg.per_device_train_batch_size, multiple_of)
    return ShardStream(shards, columns, seed=cfg.seed, partitions=partitions,
                       block_rows=cfg.stream_block_rows, batch_size=cfg.per_device_train_batch_size,
                       too_few=too_few)


def open_streams(cfg, accelerator, out, *, text: bool, num_workers: int, extra: tuple[str, ...] = (),
                 global_batch: int = 1) -> tuple[ShardStream, ShardStream]:
    """(training, validation) streams of --train_split_name and --eval_split_name, their rows checked
    once into <out>/data (one process checks, the others wait for its result).

    --stream_partitions unset (None) is resolved here, and `cfg.stream_partitions` set to it (what
    the checkpoint records and a resume compares): the value a checkpoint of <out> recorded (a
    resume keeps its batches: 64 for a run from before the automatic value), else, for a fresh run,
    `auto_partitions` of the checked training rows, a multiple of the readers (processes × data
    workers) and of `global_batch`."""
    check = dict(text=text, extra=extra, check_dir=Path(out) / "data", is_main_process=accelerator.is_main_process)
    auto = cfg.stream_partitions is None
    if auto:
        cfg.stream_partitions = recorded_partitions(out)
    readers = accelerator.num_processes * max(1, num_workers)
    train = open_stream(cfg, cfg.train_split_name, partitions=cfg.stream_partitions, **check,
                        multiple_of=math.lcm(readers, global_batch),
                        **({} if not auto else dict(too_few=(
                            f"the fewest partitions this launch can read ({readers} processes × data workers and a "
                            f"global batch of {global_batch}) need more rows: launch fewer processes "
                            f"(--num_processes) or data workers (--num_workers), or train on more rows"))))
    cfg.stream_partitions = train.partitions
    return (train,
            open_stream(cfg, cfg.eval_split_name, partitions=validation_partitions(accelerator, num_workers), **check,
                        too_few=f"the validation split (--eval_split_name {cfg.eval_split_name}) is read in one "
                                f"partition per process × data worker ({accelerator.num_processes} × "
                                f"{max(1, num_workers)}), each needing a row: give it more rows, or launch "
                                f"fewer processes (--num_processes) or data workers (--num_workers)"))


def recorded_partitions(out) -> int | None:
    """--stream_partitions as the newest complete checkpoint of <out> recorded it (every checkpoint of
    a run has the same: a changed value is refused on resume), or None (no checkpoint)."""
    import json

    from common.training.sealing import list_checkpoints

    for ckpt in reversed(list_checkpoints(out)):
        try:
            value = json.loads((ckpt / "train_state.json").read_text())["config"].get("stream_partitions")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # a damaged checkpoint: the resume chooses (and names) another
        if isinstance(value, int):
            return value
    return None


def stream_column(stream: ShardStream, name: str) -> tuple[list[str], list]:
    """(ids, values of our column `name`) of every row the stream reads (not those the data check
    left out), shard by shard, reading that column (and the ids) only: e.g. the transcripts a
    tokenizer is built from, without the audio."""
    import pyarrow.parquet as pq

    ids, values = [], []
    id_col, col = stream.columns.get("id"), stream.columns[name]
    for s, shard in enumerate(stream.shards):
        table = pq.read_table(shard.path, columns=[col] + ([id_col] if id_col else []))
        skip = frozenset(shard.skip)
        rows = [r for r in range(table.num_rows) if r not in skip]
        column = table.column(col).to_pylist()
        values += [column[r] for r in rows]
        if id_col:
            named = table.column(id_col).to_pylist()
            ids += [named[r] for r in rows]
        else:
            ids += [f"{s:06d}-{r:08d}" for r in rows]
    return ids, values


class RowItem:
    """A stream row → (its duration in s, `items.item(row)`), the audio cell as a {"bytes", "path"}
    struct. `items`: the recipe's dataset; DataLoader workers get a copy with the epoch it had when
    the epoch's iterator was made (`train_batches` sets it first)."""

    def __init__(self, items):
        self.items = items

    def __call__(self, row: dict):
        row["audio"] = audio_struct(row["audio"])
        return row["duration"], self.items.item(row)


class WithDurations:
    """`collate` of the items, plus the batch's `durations` (s; what `Throughput` counts for a stream)."""

    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, pairs):
        batch = self.collate([item for _, item in pairs])
        batch["durations"] = [d for d, _ in pairs]
        return batch


def build_stream_loaders(cfg, accelerator, *, global_batch: int, num_workers: int, train: tuple, valid: tuple
                         ) -> tuple[StreamLoader, StreamLoader]:
    """(training, validation) stream loaders over `train` and `valid`, each (ShardStream, the recipe's
    dataset, whose `item(row)` makes an item from a row, collator); refuses a
    launch whose processes × workers or global batch does not divide the partitions. The training
    loader is also the epoch object `train_batches` sets (`RecipeData.train_sampler`): it is not given
    to accelerator.prepare's sharding, it reads this rank's partitions itself."""
    (train_stream, train_item, collate), (valid_stream, valid_item, valid_collate) = train, valid
    rank, world = accelerator.process_index, accelerator.num_processes
    train_stream.check_world(world, num_workers, global_batch)
    valid_stream.check_world(world, num_workers, world)
    summary = train_stream.summary()
    lo, hi, _ = batch_sizes(train_stream.rows, train_stream.partitions, train_stream.batch_size)
    logger.info(f"streamed: {summary['utterances']} training utterances in {summary['shards']} shards, "
                f"{len(train_stream)} batches of {lo}–{hi} an epoch in "
                f"{train_stream.partitions} partitions; {valid_stream.rows} validation, {world} process(es)")
    short = batch_shortfall(train_stream.rows, train_stream.partitions, train_stream.batch_size,
                            math.lcm(world * max(1, num_workers), global_batch))
    if short:
        logger.warning(short)
    options = dict(num_workers=num_workers, seed=cfg.seed, device=accelerator.device,
                   pin_memory=accelerator.device.type == "cuda")
    train_loader = StreamLoader(StreamDataset(train_stream, RowItem(train_item), WithDurations(collate), rank, world),
                                **options)
    valid_loader = StreamLoader(StreamDataset(valid_stream, RowItem(valid_item), WithDurations(valid_collate), rank,
                                              world), **options)
    return train_loader, valid_loader


def validation_partitions(accelerator, num_workers: int) -> int:
    """Partitions of a streamed validation split: one per reader (process × data worker)."""
    return accelerator.num_processes * max(1, num_workers)
