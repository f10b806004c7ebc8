"""Streaming training data from `datasets` parquet shards: read in order, resumable in O(1).

Where the shards come from: `resolve_shards(dataset_name, config_name, split)` asks `datasets` which
files make the split (`load_dataset_builder(...).config.data_files`), the resolution a Hub name, a
local folder (`data/train-*.parquet`) or `--dataset_name parquet --data_files ...` all go through.
The shards must be local files for now (a Hub name resolving to hf:// files is refused in one line).
The files are then read with pyarrow, row group by row group: a shard is never copied whole to local
disk and no row before the position is ever read again. Only parquet is streamed (what the Hub
serves every dataset as); other formats are refused in one line naming it.

The design, and why (every property below is tested in tests/common/data/test_stream.py):

- **Canonical partitions.** An epoch is the concatenation of all shards' rows in a per-epoch shard
  order (a permutation from (seed, epoch)), cut into `partitions` P contiguous row ranges of equal
  size (±1 row; a shard may be split between two neighbours, so uneven shard counts and sizes do
  not matter). P does not depend on the number of processes or workers: the same P on 2 processes
  or 1 gives the same batches (as MosaicML Streaming's "canonical nodes").
- **Bounded shuffle, duration bucketing.** Each partition is read in blocks of `block_rows`
  consecutive rows (the shuffle buffer). A block's rows are permuted from (seed, epoch, partition,
  block), sorted by duration (stable: the permutation breaks ties), cut into batches of similar
  length, and the batches' order inside the block is permuted too (MosaicML's block shuffle, "py1b").
  Memory: one block per partition a process (or worker) reads, P / (processes × workers) blocks.
- **A fixed batch count.** Every partition is cut into the same number K of batches of at most
  `batch_size` utterances (sizes differ by at most one), so an epoch has exactly K·P global
  batches, known before the first row is read: every rank takes the same number of steps and
  reaches the end of the epoch together (no rank waits for a batch another rank never gets, no
  padding that repeats utterances). Batches are counted in utterances, not seconds: an exact count
  per partition is what makes the end of an epoch agreed without a collective; with
  `batch_size × max_seconds ≤ max_batch_seconds` a batch never exceeds a padded-seconds budget.
- **Global batch k = batch k // P of partition k mod P**, whatever the world size. Accelerate's
  convention deals global batch i·W + r to rank r (`common.training.loop.train_batches`), so rank r reads
  only the partitions p ≡ r (mod W), and worker j of its DataLoader only p ≡ (start + j)·W + r
  (mod W·workers): every utterance is read once per epoch over all ranks × workers. P must be a
  multiple of processes × workers and of the global batch (processes × accumulation); otherwise the
  run is refused in one line naming the partition counts that work.
- **The state is the position.** The batches of an epoch are a pure function of (seed, epoch, the
  shards), so the resume state is (epoch, global batches consumed), which `TrainState` already
  holds: O(1) in size. Restoring it computes, for each partition, its block and the batches to drop
  in that block, and reads that one block (O(block), not O(position)): nothing consumed is read
  again. The same position converts to any W that divides P (elastic N → M gives the same global
  batches). Changed shards (their content digest, `shard_stamp`: size and sampled bytes, not file
  times, so a copied folder resumes; their row counts) change `summary()['fingerprint']`, and a
  resume on them is refused like a changed folder, naming the shard that appeared, vanished or
  changed (`summary()['shard_files']`).
- **Partitions by default.** --stream_partitions unset: 64, or fewer where a small split would
  leave batches short of the batch size (`auto_partitions`); a resume keeps its checkpoint's value.
  A run whose batches fall short (a P given) says so at start, naming the P that would fill them.

`ShardStream` is the plan (what every rank computes alike), `StreamDataset` the per-rank
`IterableDataset` (items and collated batches made in the DataLoader's workers), `StreamLoader` what
`train_batches` iterates (`set_epoch`, `resume_at`, `__len__`).

The recipes take a stream through `common.data.source` (--dataset_name ... --streaming true; every
recipe). Rows are checked by `common.data.stream_check.check_shards` (once per shard, cached;
`common.data.source.open_streams` runs it before training): with --on_bad_data error a bad row is refused in one line naming its shard
and row, with skip it is left out (`Shard.skip`) by a rule of the shard's content alone, so the
batches stay the same on every launch and rank.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import soundfile as sf
import torch

from common.training.distributed import derive_seed
from common.training.faults import RunError, UsageError

logger = logging.getLogger(__name__)
HEAD_TAIL_BYTES = 64 * 1024  # bytes of a shard's start and end in its content digest
SAMPLE_PAGES, PAGE_BYTES = 16, 4096  # pages sampled between them: 192 KiB read per shard and launch


@dataclass(frozen=True)
class Shard:
    path: str
    rows: int  # rows the stream reads: the file's rows less `skip`
    stamp: str  # content digest (`shard_stamp`): changes when the file's content does, not its times
    skip: tuple[int, ...] = ()  # rows of the file the data check drops (`check_shards`), ascending


def split_files(dataset_name: str, config_name: str | None, split: str,
                data_files: str | list | None = None) -> tuple[Any, list[str]]:
    """(the `datasets` builder, the files of `split`, sorted) as `datasets` resolves them: a Hub name,
    a local folder, or a builder name such as "parquet" with `data_files`. The one resolver of a
    source's files, streamed or loaded whole; one line naming the splits there are when `split` is
    not one of them."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(dataset_name, config_name,
                                                data_files={split: data_files} if data_files else None)
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:  # OSError: not found, offline
        raise UsageError(f"--dataset_name {dataset_name}: {str(e).splitlines()[0]}") from None
    files = builder.config.data_files or {}
    if split not in files:
        raise UsageError(f"--dataset_name {dataset_name} has no split {split!r} (it has {', '.join(files) or 'none'}): "
                         f"set --train_split_name / --eval_split_name to one of them")
    return builder, sorted(str(f) for f in files[split])


def resolve_shards(dataset_name: str, config_name: str | None = None, split: str = "train",
                   data_files: str | list | None = None) -> list[str]:
    """The files of `split` (`split_files`), refusing remote and non-parquet files in one line each."""
    _, paths = split_files(dataset_name, config_name, split, data_files)
    remote = [p for p in paths if "://" in p]
    if remote:  # shard_stamp and pyarrow read local files; remote ones need an fsspec path through both
        raise RunError(f"--streaming reads local shards; {dataset_name} split {split} resolves to {remote[0]}: "
                       f"download the parquet files (huggingface-cli download) and pass their folder")
    other = [p for p in paths if not p.endswith(".parquet")]
    if other:
        raise RunError(f"--streaming reads parquet shards; {dataset_name} split {split} has {other[0]} "
                       f"({len(other)} such files): convert with datasets' Dataset.to_parquet, or use --streaming false")
    return paths


def shard_stamp(path: str) -> str:
    """A digest of a shard's content, not of its file times: its size, its first and last
    HEAD_TAIL_BYTES (the parquet header and the footer, which holds every row group's offsets,
    sizes and row counts) and SAMPLE_PAGES pages of PAGE_BYTES evenly spaced between them. A copy
    (`cp -r`, `rsync` without -t, a download) keeps it; a shard rewritten with other rows changes it.
    Not seen: a same-size edit in place that touches none of the 192 KiB sampled (a cell's bytes
    overwritten inside the file); such a shard is not re-checked either while its size, mtime and
    ctime are unchanged (`common.data.stream_check.local_key`)."""
    size = os.stat(path).st_size
    h = hashlib.blake2b(f"{size}\0".encode(), digest_size=8)
    with open(path, "rb") as f:
        h.update(f.read(HEAD_TAIL_BYTES))
        middle = size - 2 * HEAD_TAIL_BYTES
        for i in range(SAMPLE_PAGES if middle > 0 else 0):
            f.seek(HEAD_TAIL_BYTES + middle * i // SAMPLE_PAGES)
            h.update(f.read(PAGE_BYTES))
        f.seek(max(0, size - HEAD_TAIL_BYTES))
        h.update(f.read())
    return h.hexdigest()


def shard_names(paths: list[str]) -> list[str]:
    """Each shard's name relative to the shards' common folder (`data/train-00000-of-00002.parquet`
    stays `train-00000-of-00002.parquet` wherever the folder is copied): what a checkpoint records."""
    if len(paths) == 1:
        return [os.path.basename(paths[0])]
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    return [os.path.relpath(os.path.abspath(p), root) for p in paths]


def shard_files(paths: list[str], stamps: list[str] | None = None) -> dict[str, str]:
    """{shard name (`shard_names`): content digest (`shard_stamp`)}: what a checkpoint records of a
    `datasets` source's files (streamed or map-style), so that a refused resume names the shard
    that appeared, vanished or changed (`common.data.manifest.data_change`)."""
    stamps = [shard_stamp(p) for p in paths] if stamps is None else stamps
    return dict(zip(shard_names(paths), stamps))


def open_shards(paths: list[str], columns: dict[str, str | None]) -> list[Shard]:
    """`Shard`s with their row counts (parquet footers only). `columns` maps our names ("audio",
    "text", "id", "duration") to the dataset's; a missing one (None: optional) is one line naming
    the columns the shard has."""
    import pyarrow.parquet as pq

    shards = []
    for path in paths:
        meta = parquet_footer(path)
        have = meta.schema.to_arrow_schema().names
        for ours, theirs in columns.items():
            if theirs is not None and theirs not in have:
                if ours == "id":  # not a flag: the split's first shard has an `id` column, this one none
                    raise UsageError(f"{path} has no id column, which {paths[0]} has (it has {', '.join(have)}): "
                                     f"every shard of a split needs the same columns; add it, or drop it from all")
                raise UsageError(f"--{ours}_column_name {theirs}: no such column in {path} (it has {', '.join(have)})")
        shards.append(Shard(path, meta.num_rows, shard_stamp(path)))
    return shards


def parquet_footer(path: str):
    """The parquet metadata of `path`, or one line naming the file when it is not a parquet file
    (0 bytes, cut short, something else named .parquet)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.data.manifest import DataError

    try:
        return pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError) as e:
        size = os.path.getsize(path) if os.path.isfile(path) else None
        raise DataError(f"{path}: not a readable parquet file ({'0 bytes' if size == 0 else str(e).splitlines()[0][:120]}): "
                        f"re-download or re-write it, or remove it from the split") from None


AUTO_PARTITIONS = 64  # the most partitions an unset --stream_partitions gives
FULL_BATCH = 0.9  # batches "hold what was asked" when the smallest holds ≥ this share of the batch size (rounded down)


def batch_sizes(rows: int, partitions: int, batch_size: int) -> tuple[int, int, float]:
    """(smallest, largest, mean) utterances per batch of `rows` rows in `partitions` partitions of
    K batches each (`ShardStream`): a partition of fewer than `batch_size` rows is one short batch."""
    per = math.ceil(rows / partitions)
    k = max(1, math.ceil(per / batch_size))
    return rows // partitions // k, math.ceil(per / k), rows / (k * partitions)


def full_batches(rows: int, partitions: int, batch_size: int) -> bool:
    """Whether every batch holds what was asked: at least 90 % of `batch_size` (rounded down; 7 of 8)."""
    return batch_sizes(rows, partitions, batch_size)[0] >= math.floor(FULL_BATCH * batch_size)


def auto_partitions(rows: int, batch_size: int, multiple_of: int = 1) -> int:
    """--stream_partitions unset: the most of 64, 32, …, 1 partitions whose batches hold what was
    asked (`full_batches`: large splits get 64, a split of 200 rows in batches of 8 gets 4: 7–8
    utterances a batch), as a multiple of `multiple_of` (processes × data workers and the global batch:
    every partition has one reader). A function of the source and the launch's shape: a resume
    takes the checkpoint's value instead (`common.data.source.open_streams`)."""
    p = AUTO_PARTITIONS
    while p > 1 and not full_batches(rows, p, batch_size):
        p //= 2
    return math.lcm(p, multiple_of)


def batch_shortfall(rows: int, partitions: int, batch_size: int, multiple_of: int = 1) -> str | None:
    """One line saying why batches of `rows` in `partitions` partitions hold fewer utterances than
    `batch_size` and which --stream_partitions would fill them, or None when they hold what was asked."""
    if full_batches(rows, partitions, batch_size):
        return None
    lo, hi, _ = batch_sizes(rows, partitions, batch_size)
    why = (f"streamed batches hold {lo}–{hi} utterances, not --per_device_train_batch_size {batch_size}: "
           f"{rows} rows in {partitions} partitions are {rows // partitions}–{math.ceil(rows / partitions)} a "
           f"partition, cut into batches of equal count")
    fits = [p for p in range(multiple_of, partitions, multiple_of) if full_batches(rows, p, batch_size)]
    if fits:
        lo, hi, _ = batch_sizes(rows, fits[-1], batch_size)
        return (f"{why}; --stream_partitions {fits[-1]} would give batches of {lo}–{hi} (in a new --output_dir: "
                f"the partitions decide the batches)")
    return (f"{why}; even {multiple_of} partitions (one per reader) would not fill them: a smaller "
            f"--per_device_train_batch_size, or more rows")


class ShardStream:
    """The plan of every epoch: which rows make global batch k. Identical on every rank."""

    def __init__(self, shards: list[Shard], columns: dict[str, str | None], *, seed: int, partitions: int,
                 block_rows: int, batch_size: int, too_few: str = "lower --stream_partitions"):
        """`too_few`: what a user does when the rows cannot fill the partitions (the training
        split's are --stream_partitions; a validation split's are its readers, `common.data.source`)."""
        self.shards, self.columns, self.seed = shards, columns, seed
        self.partitions, self.block_rows, self.batch_size = partitions, block_rows, batch_size
        self.rows = sum(s.rows for s in shards)
        per = self.rows // partitions  # rows of the smallest partition
        # K batches per partition: enough that the largest (per + 1 rows) has batches of ≤ batch_size.
        self.batches_per_partition = math.ceil(math.ceil(self.rows / partitions) / batch_size)
        if per < self.batches_per_partition or per == 0:
            raise UsageError(f"{self.rows} rows cannot fill {partitions} partitions of {self.batches_per_partition} "
                             f"batches: {too_few}")
        # Batches per block: the block (shuffle buffer) holds whole batches.
        self.block_batches = max(1, block_rows // batch_size)
        self.reads = 0  # rows read by this process (tests: restore cost)

    def __len__(self) -> int:
        """Global batches per epoch (the same every epoch)."""
        return self.batches_per_partition * self.partitions

    def check_world(self, processes: int, workers: int, global_batch: int) -> None:
        """Refuse (one line) a launch whose processes × workers or global batch does not divide P."""
        for what, n in (("processes × data workers", processes * max(1, workers)), ("the global batch", global_batch)):
            if self.partitions % n:
                ok = [m for m in range(1, self.partitions + 1) if self.partitions % m == 0]
                raise RunError(f"--stream_partitions {self.partitions} is not a multiple of {what} ({n}): every "
                               f"partition must belong to one reader; use counts dividing it ({ok}) or another "
                               f"--stream_partitions in a new --output_dir (it decides the batches)")

    def summary(self) -> dict:
        """What a checkpoint records (`TrainState.data`): the fingerprint of every shard's name, rows
        read and content digest, and each shard's digest by name (`shard_files`: a refused resume
        names the shard that appeared, vanished or changed)."""
        files = shard_files([s.path for s in self.shards], [s.stamp for s in self.shards])
        h = hashlib.blake2b(digest_size=8)
        for (name, stamp), s in zip(files.items(), self.shards):
            h.update(f"{name}\0{s.rows}\0{stamp}\n".encode())
        return {"utterances": self.rows, "fingerprint": h.hexdigest(), "shards": len(self.shards),
                "shard_files": files}

    # ---- the epoch's layout ------------------------------------------------------------------

    def shard_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(derive_seed(self.seed, "shards", epoch)).permutation(len(self.shards))

    def epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, each ordered shard's first row in the epoch): (shards,) each, kept for the
        last epoch asked (made once per epoch, not once per block read)."""
        if getattr(self, "_layout", (None,))[0] != epoch:
            order = self.shard_order(epoch)
            rows = np.array([s.rows for s in self.shards], dtype=np.int64)[order]
            self._layout = (epoch, order, np.concatenate([[0], np.cumsum(rows)[:-1]]))
        return self._layout[1], self._layout[2]

    def partition_range(self, p: int) -> tuple[int, int]:
        """Partition p's rows [start, stop) in the epoch's concatenated shard order."""
        return p * self.rows // self.partitions, (p + 1) * self.rows // self.partitions

    def batch_offsets(self, p: int, first: int = 0, last: int | None = None) -> np.ndarray:
        """Row offsets of partition p's batches first … last (K if None), relative to its start:
        (last - first + 1,). Sizes differ by ≤ 1, the larger first (as np.array_split cuts), computed
        in O(last - first): a resume near the end of a partition of millions of rows costs a block."""
        start, stop = self.partition_range(p)
        size, extra = divmod(stop - start, self.batches_per_partition)
        b = np.arange(first, self.batches_per_partition if last is None else last) + 1
        return np.concatenate([[first * size + min(first, extra)], b * size + np.minimum(b, extra)])

    def read_rows(self, epoch: int, start: int, stop: int) -> list[dict]:
        """Rows [start, stop) of the epoch's concatenated order, read by row groups, in order."""
        import pyarrow.parquet as pq

        order, starts = self.epoch_layout(epoch)
        out = []
        cols = [c for c in self.columns.values() if c is not None]
        # The shards holding [start, stop): found by bisection, not by walking the shards before them.
        for i in range(int(np.searchsorted(starts, start, side="right")) - 1, len(order)):
            if starts[i] >= stop:
                break
            si, base = int(order[i]), int(starts[i])
            shard = self.shards[si]
            lo, hi = max(start, base), min(stop, base + shard.rows)
            if lo < hi:
                out += _read_range(pq.ParquetFile(shard.path), cols, lo - base, hi - base, si, self.columns,
                                   shard.skip)
        self.reads += len(out)
        return out

    def partition_batches(self, epoch: int, p: int, first: int = 0) -> Iterator[list[dict]]:
        """Partition p's batches from its batch `first` on; reads from the block holding it."""
        start, _ = self.partition_range(p)
        K, kb = self.batches_per_partition, self.block_batches
        for b0 in range(first // kb * kb, K, kb):
            b1 = min(b0 + kb, K)
            offsets = self.batch_offsets(p, b0, b1)  # (b1 - b0 + 1,) the block's batches
            rows = self.read_rows(epoch, start + int(offsets[0]), start + int(offsets[-1]))
            rng = np.random.default_rng(derive_seed(self.seed, "block", epoch, p, b0 // kb))
            perm = rng.permutation(len(rows))
            durations = np.array([_duration(rows[i], self.columns) for i in perm])
            ranked = perm[np.argsort(durations, kind="stable")]  # shortest first; ties in random order
            cuts = offsets - offsets[0]
            batches = [[rows[i] for i in ranked[cuts[j] : cuts[j + 1]]] for j in range(b1 - b0)]
            for position, j in enumerate(rng.permutation(b1 - b0), start=b0):
                if position >= first:  # the partition's first `first` batches were consumed
                    yield batches[j]

    def batches(self, epoch: int, rank: int, world: int, start: int = 0, worker: int = 0,
                workers: int = 1) -> Iterator[tuple[int, list[dict]]]:
        """(global batch index, rows) of rank `rank`'s local batches start, start + workers·1, ...
        taken by `worker` (its `worker`-th from `start`): local batch i is global batch i·world + rank."""
        readers: dict[int, Iterator] = {}
        for i in range(start + worker, len(self) // world, workers):
            k = i * world + rank
            p = k % self.partitions
            if p not in readers:
                readers[p] = self.partition_batches(epoch, p, k // self.partitions)
            yield k, next(readers[p])


def _read_range(f, cols: list[str], lo: int, hi: int, shard_index: int, columns: dict,
                skip: tuple[int, ...] = ()) -> list[dict]:
    """Rows [lo, hi) of one parquet file as dicts (our column names), reading only the row groups
    that hold them. With `skip` (file rows, ascending), lo and hi count the rows kept."""
    if skip:  # the kept rows lo … hi - 1 are file rows keep[lo] … keep[hi - 1]
        keep = np.delete(np.arange(f.metadata.num_rows), skip)
        lo, hi, skip = int(keep[lo]), int(keep[hi - 1]) + 1, frozenset(skip)
    out, base = [], 0
    for g in range(f.metadata.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        a, b = max(lo, base), min(hi, base + n)
        if a < b:
            table = f.read_row_group(g, columns=cols).slice(a - base, b - a).to_pylist()
            for r, row in enumerate(table, start=a):
                if r in skip:
                    continue
                item = {ours: row[theirs] for ours, theirs in columns.items() if theirs is not None}
                item.setdefault("id", f"{shard_index:06d}-{r:08d}")  # a shard's row: stable while the shard is
                out.append(item)
        base += n
        if base >= hi:
            break
    return out


class BadAudioCell(ValueError):
    """An audio cell that is neither encoded bytes nor the path of a regular file: (reason, detail)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason} ({detail})")
        self.reason, self.detail = reason, detail


def audio_source(cell) -> io.BytesIO | str:
    """An audio cell as soundfile may open it: its encoded bytes (a BytesIO), or the path of a
    regular file, from a datasets `Audio` struct {"bytes", "path"}, bytes or a path. Anything else
    raises `BadAudioCell`, before soundfile sees it: soundfile reads an integer as a file descriptor
    (0 is stdin: the reader blocks), and opening a FIFO's path blocks until someone writes to it."""
    if isinstance(cell, dict):
        cell = cell.get("bytes") or cell.get("path")
    if isinstance(cell, (bytes, bytearray)):
        return io.BytesIO(cell)
    if isinstance(cell, str) and cell:
        from common.data.datacheck import regular_file

        st = regular_file(cell)
        if isinstance(st, dict):
            raise BadAudioCell(st["error"], st.get("detail") or cell[:120])
        return cell
    raise BadAudioCell("audio is not bytes or a file path", f"{type(cell).__name__} {repr(cell)[:40]}")


def audio_struct(cell) -> dict:
    """An audio cell as `datasets.Audio(decode=False)` stores it, {"bytes", "path"}, whatever the
    column held (that struct, encoded bytes, or a path)."""
    if isinstance(cell, dict):
        return cell
    return {"bytes": cell, "path": None} if isinstance(cell, bytes) else {"bytes": None, "path": cell}


def _duration(row: dict, columns: dict) -> float:
    if "duration" in row:
        return float(row["duration"])
    info = sf.info(audio_source(row["audio"]))
    row["duration"] = info.frames / info.samplerate
    return row["duration"]


class StreamDataset(torch.utils.data.IterableDataset):
    """One rank's batches of an epoch, from `start` (local batches) on: `item(row)` per row, then
    `collate(items)`, both inside the DataLoader's workers (their epoch: `set_epoch` on them, as
    `train_batches`' `epoch_objects`, before the epoch's iterator is made)."""

    def __init__(self, stream: ShardStream, item: Callable[[dict], Any], collate: Callable, rank: int,
                 world: int):
        self.stream, self.item, self.collate, self.rank, self.world = stream, item, collate, rank, world
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return len(self.stream) // self.world

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for _, rows in self.stream.batches(self.epoch, self.rank, self.world, self.start, worker, workers):
            yield self.collate([self.item(row) for row in rows])


class StreamLoader:
    """What `common.training.loop.train_batches` iterates for a stream: its epoch set by `set_epoch`, a
    resumed epoch started by `resume_at(local batches done)` (no skipped batch is read), batches
    moved to `device`. Not given to `accelerator.prepare`: the stream shards itself by rank."""

    def __init__(self, dataset: StreamDataset, *, num_workers: int, seed: int, device=None, pin_memory: bool = False):
        self.dataset, self.device = dataset, device
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers,
                                                  generator=torch.Generator().manual_seed(seed),
                                                  persistent_workers=False, pin_memory=pin_memory)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.epoch, self.dataset.start = epoch, 0

    def resume_at(self, done: int) -> None:
        self.dataset.start = done

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self):
        from accelerate.utils import send_to_device

        try:
            for batch in self.loader:
                yield send_to_device(batch, self.device) if self.device is not None else batch
        finally:
            self.dataset.start = 0
