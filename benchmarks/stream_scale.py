"""Does streaming stay flat as the corpus grows? `common/data/stream.py` on generated corpora the shape of a
50 000-hour set, and its throughput against the map-style loader on the built-in corpus.

    python benchmarks/stream_scale.py           # 1×, 10×, 100× + throughput
    python benchmarks/stream_scale.py --scales 1,10 --repeats 1 --no_throughput   # a quick look

(On the shared 2-core VM at load average ~10, `--no_throughput` took 17 min of wall time, 4 of them
writing the 100× shards, for ~1 min of CPU; `--keep` keeps the shards for the next run.)

Scale. 100× is the shape of a 50 000-hour set: 18 000 000 utterances of 10 s on average, in 10 000
parquet shards of 1 800 rows (a Hub shard of ~500 MB holds ~1 800 10-s 16-bit WAVs), row groups of
100 rows (what `datasets` writes for audio). 10× and 1× have 1 000 and 100 such shards: a larger
corpus has more shards, not larger ones. Each row holds 64 random bytes of "audio" (never decoded:
what is measured is the stream's planning, reading and restoring, not a decoder; a real row is
~5 000× larger, which changes the bytes read per block, the same at every scale) and its duration
(1–19 s), so the 100× corpus takes ~1.8 GB of disk. The shards are written once under `--work_dir`
(generation is not measured) and removed at the end unless `--keep`.

Each scale is measured in a fresh process (its peak RSS is its own), in CPU seconds of that process
(its wall time on a shared machine measures the neighbours), one process, no DataLoader workers, after
one untimed warm-up of each first-batch variant, with the same plan (16 partitions, blocks of 1 024 rows, batches of 32 utterances):
- opening: `resolve_shards` + `open_shards` (every shard's footer and head/tail digest: O(shards));
- the first batch of epoch 0 from a fresh plan, resumed at its start, and resumed before its last
  batch (`StreamLoader.resume_at`, as `common.training.loop.train_batches` does), interleaved, medians;
- reading: milliseconds per batch over the epoch's first 1 024 batches;
- peak RSS of the process, and its growth over the process's RSS after the imports;
- the checkpoint's data state: `TrainState` (position + `ShardStream.summary()`) as JSON, bytes.
Ratios are to 1×; flat means ≈ 1.

Throughput: audio-seconds per CPU-second (all reading happens in the measuring process, so on an
idle machine this is the wall-clock rate times the threads it keeps busy) of data loading only (decode, log-mel, collation: BEST-RQ's
items and `MaskingCollator`, no model) over one epoch of the built-in corpus's training split, read
map-style (`DurationBatchSampler` over the FLAC files, RAM cache off) and streamed from the same
audio written as parquet shards, with the map-style epoch's mean utterances per batch; the stream
without a duration column (each row's duration read from its audio header, as for a Hub dataset
that has none) and with one. Interleaved, `--repeats` epochs each, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS_PER_SHARD = 1800  # ~500 MB of 10-s 16-bit 16 kHz WAVs per shard, as a Hub parquet shard
ROW_GROUP = 100  # rows per row group: what `datasets` writes for audio columns
SHARDS_AT_1X = 100  # 100× = 10 000 shards = 18 M utterances ≈ 50 000 h of 10 s
AUDIO_BYTES = 64  # per row (never decoded)
PLAN = dict(partitions=16, block_rows=1024, batch_size=32)
READ_BATCHES = 1024  # batches timed for the reading rate
COLUMNS = {"audio": "audio", "text": None, "id": None, "duration": "duration"}


# ---- the synthetic corpus --------------------------------------------------------------------------


def write_corpus(folder: Path, shards: int) -> None:
    """`shards` parquet files data/train-*.parquet, written once (a marker says the folder is whole)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    marker = folder / f"complete-{shards}"
    if marker.exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "data").mkdir(parents=True)
    rng = np.random.default_rng(0)
    templates = []  # 8 distinct shard contents, written in turn
    for _ in range(8):
        n = ROWS_PER_SHARD
        data = pa.py_buffer(rng.bytes(n * AUDIO_BYTES))
        offsets = pa.py_buffer(np.arange(0, (n + 1) * AUDIO_BYTES, AUDIO_BYTES, dtype=np.int32).tobytes())
        audio = pa.StructArray.from_arrays(
            [pa.Array.from_buffers(pa.binary(), n, [None, offsets, data]), pa.nulls(n, pa.string())],
            names=["bytes", "path"])
        templates.append(pa.table({"audio": audio, "duration": rng.uniform(1.0, 19.0, n)}))
    for s in range(shards):
        pq.write_table(templates[s % 8], folder / "data" / f"train-{s:05d}-of-{shards:05d}.parquet",
                       row_group_size=ROW_GROUP, use_dictionary=["duration"])
    marker.touch()


# ---- one scale, in its own process -----------------------------------------------------------------


def cpu() -> float:
    """CPU seconds of this process: on a shared machine its wall time measures the neighbours (the
    shards are in the page cache, so there is no I/O wait to miss)."""
    return time.process_time()


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(folder: Path, repeats: int) -> dict:
    """What the module docstring lists, for the corpus in `folder` (run in a fresh process)."""
    from common.training.state import TrainState
    from common.data.stream import ShardStream, StreamDataset, StreamLoader, open_shards, resolve_shards

    import pyarrow.parquet  # noqa: F401 — imported by the first read otherwise: not a cost of the position
    from accelerate.utils import send_to_device  # noqa: F401 — likewise (StreamLoader.__iter__)

    base_rss = rss_mb()
    t = cpu()
    paths = resolve_shards(str(folder))
    t_resolve = cpu() - t
    t = cpu()
    shards = open_shards(paths, COLUMNS)
    t_open = cpu() - t

    def loader() -> StreamLoader:
        stream = ShardStream(shards, COLUMNS, seed=0, **PLAN)
        item = lambda row: (row["id"], len(row["audio"]["bytes"]))  # noqa: E731
        return StreamLoader(StreamDataset(stream, item, list, 0, 1), num_workers=0, seed=0)

    def first_batch(at_end: bool) -> float:
        t = cpu()
        ld = loader()
        ld.set_epoch(0)
        if at_end:
            ld.resume_at(len(ld) - 1)
        next(iter(ld))
        return cpu() - t

    first_batch(False), first_batch(True)  # warm-up: first calls of numpy/pyarrow paths
    start, end = [], []
    for rep in range(repeats):
        for at_end in ((False, True) if rep % 2 == 0 else (True, False)):
            (end if at_end else start).append(first_batch(at_end))
    ld = loader()
    ld.set_epoch(0)
    t, n = cpu(), 0
    for _ in ld:
        n += 1
        if n == READ_BATCHES:
            break
    t_batch = (cpu() - t) / n
    stream = ld.dataset.stream
    state = TrainState(epoch=0, batches_in_epoch=len(stream) - 1, data=stream.summary())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return dict(shards=len(shards), rows=stream.rows, batches=len(stream), resolve_s=t_resolve, open_s=t_open,
                first_start_s=statistics.median(start), first_end_s=statistics.median(end), batch_s=t_batch,
                peak_rss_mb=peak, rss_growth_mb=peak - base_rss, state_bytes=len(json.dumps(state.state_dict())))


def scale_table(args) -> None:
    rows = {}
    for scale in args.scales:
        folder = args.work_dir / f"scale-{scale}"
        t = time.perf_counter()
        write_corpus(folder, SHARDS_AT_1X * scale)
        size = sum(p.stat().st_size for p in (folder / "data").iterdir()) / 2**30
        print(f"  {scale}×: {SHARDS_AT_1X * scale} shards, {size:.2f} GiB on disk "
              f"(made or found in {time.perf_counter() - t:.0f} s); measuring", flush=True)
        out = subprocess.run([sys.executable, __file__, "--_measure", str(folder), "--repeats", str(args.repeats)],
                             check=True, capture_output=True, text=True).stdout
        rows[scale] = json.loads(out.strip().splitlines()[-1])
    one = rows[args.scales[0]]
    cols = [("shards", "shards", "{:.0f}"), ("rows", "utterances", "{:.0f}"),
            ("resolve_s", "resolve s", "{:.3f}"), ("open_s", "open s", "{:.3f}"),
            ("first_start_s", "1st batch, start s", "{:.4f}"), ("first_end_s", "1st batch, end s", "{:.4f}"),
            ("batch_s", "ms/batch", "{:.4f}"), ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
            ("rss_growth_mb", "RSS growth MB", "{:.0f}"), ("state_bytes", "state bytes", "{:.0f}")]
    print(f"\n{'scale':>6} | " + " | ".join(f"{name:>18}" for _, name, _ in cols))
    for scale, r in rows.items():
        cells = []
        for key, _, fmt in cols:
            value = r[key] * (1e3 if key == "batch_s" else 1)
            ratio = r[key] / one[key] if one[key] else float("nan")
            cells.append(f"{fmt.format(value)} ({ratio:.2f})")
        print(f"{scale:>5}× | " + " | ".join(f"{c:>18}" for c in cells))
    for scale, r in rows.items():
        print(f"  {scale}×: first batch resumed at the end / at the start of the epoch: "
              f"{r['first_end_s'] / r['first_start_s']:.2f}")
    print("(value (ratio to the first scale); times in CPU seconds of the process; 1st batch: from a fresh plan "
          "over opened shards, resumed at batch 0 or before the epoch's last batch; state: TrainState JSON "
          "with the data summary)")


# ---- throughput on the built-in corpus -----------------------------------------------------------


def throughput(args) -> None:
    import datasets

    from benchmarks.recipe import load_recipe
    from common.data.loading import load_audio, make_loader
    from common.training.distributed import set_threads
    from common.data.stream import ShardStream, StreamDataset, StreamLoader, audio_source, open_shards, resolve_shards

    set_threads(0)
    r = load_recipe("best_rq", ["--memory_cache_mb", "0"])
    cfg, train = r.cfg, r.train_set
    seconds = dict(zip(train["id"], train["duration"]))
    map_loader, sampler = make_loader(r.dataset, train["duration"], r.collator, max_batch_seconds=cfg.max_batch_seconds,
                                      num_buckets=cfg.num_buckets, seed=cfg.seed, multiple_of=1, shuffle=True)
    sampler.set_epoch(0)
    per_batch = len(train) / len(sampler)
    folder = args.work_dir / "builtin"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "data").mkdir(parents=True)
    rows = [{"id": i, "audio": {"bytes": Path(p).read_bytes(), "path": None}, "duration": d}
            for i, p, d in zip(train["id"], train["path"], train["duration"])]
    ds = datasets.Dataset.from_list(rows).cast_column("audio", datasets.Audio(cfg.sample_rate, decode=False))
    n_shards = 8
    for s in range(n_shards):
        ds.shard(n_shards, s, contiguous=True).to_parquet(
            str(folder / "data" / f"train-{s:05d}-of-{n_shards:05d}.parquet"))
    logmel = r.dataset.logmel

    def item(row):  # FeatureDataset.__getitem__, on the row's bytes instead of its file
        return row["id"], logmel(load_audio(audio_source(row["audio"]), cfg.sample_rate))

    def stream_loader(duration_column: bool) -> StreamLoader:
        columns = {"audio": "audio", "text": None, "id": "id", "duration": "duration" if duration_column else None}
        shards = open_shards(resolve_shards(str(folder)), columns)
        stream = ShardStream(shards, columns, seed=cfg.seed, partitions=4, block_rows=512,
                             batch_size=round(per_batch))
        return StreamLoader(StreamDataset(stream, item, r.collator, 0, 1), num_workers=0, seed=cfg.seed)

    def epoch(loader) -> float:
        """Audio-seconds per CPU-second of one epoch 0 (all in this process: no workers)."""
        loader_epoch = getattr(loader, "set_epoch", None) or sampler.set_epoch
        loader_epoch(0)
        t, audio = cpu(), 0.0
        for batch in loader:
            audio += sum(seconds[i] for i in batch["ids"])
        return audio / (cpu() - t)

    variants = {"map-style (FLAC files)": lambda: epoch(map_loader),
                "stream, no duration column": lambda: epoch(stream_loader(False)),
                "stream, duration column": lambda: epoch(stream_loader(True))}
    rates = {k: [] for k in variants}
    for rep in range(args.repeats):
        for name, f in (variants.items() if rep % 2 == 0 else reversed(variants.items())):
            rates[name].append(f())
    ref = statistics.median(rates["map-style (FLAC files)"])
    print(f"\nthroughput, data loading only (BEST-RQ items + collator), built-in corpus: {len(train)} utterances, "
          f"{sum(train['duration']) / 3600:.2f} h; map-style {len(sampler)} batches of {per_batch:.1f} utterances "
          f"on average, stream {round(per_batch)} per batch; {args.repeats} epochs each, interleaved, medians")
    for name, v in rates.items():
        print(f"  {name:28s} {statistics.median(v):8.0f} audio-s per CPU-s  ({statistics.median(v) / ref:.2f}× map-style)"
              f"  runs: {', '.join(f'{x:.0f}' for x in v)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="1,10,100", help="comma-separated multiples of 100 shards × 1 800 rows "
                                                         "('': none, the throughput alone)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions (medians reported)")
    ap.add_argument("--work_dir", type=Path, default=Path("/tmp/stream_scale"), help="where the shards are written")
    ap.add_argument("--keep", action="store_true", help="keep the generated shards for the next run")
    ap.add_argument("--no_throughput", action="store_true", help="skip the built-in corpus throughput comparison")
    ap.add_argument("--_measure", type=Path, help=argparse.SUPPRESS)  # one scale, in a fresh process
    args = ap.parse_args()
    if args._measure:
        print(json.dumps(measure(args._measure, args.repeats)))
        return
    args.scales = [int(s) for s in args.scales.split(",") if s]  # --scales '': the throughput alone
    print(f"stream_scale: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; plan {PLAN}; {args.repeats} repetitions")
    try:
        if args.scales:
            scale_table(args)
        if not args.no_throughput:
            throughput(args)
    finally:
        if not args.keep:
            shutil.rmtree(args.work_dir, ignore_errors=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
