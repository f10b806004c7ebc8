"""`common.data.stream` on tiny parquet shards written by `datasets` itself and resolved by the same
`load_dataset_builder` call a Hub name goes through."""
import io
import shutil
import time

import numpy as np
import pytest
import soundfile as sf
import torch

from common.training.faults import RunError
from common.data.manifest import data_change
from common.data.stream import ShardStream, StreamDataset, StreamLoader, open_shards, resolve_shards

COLUMNS = {"audio": "audio", "text": "sentence", "id": "utt", "duration": None}


def write_shards(folder, sizes):
    """Shards data/train-*.parquet of `sizes` rows (uneven on purpose), ids u0000, u0001, ..."""
    import datasets

    rng = np.random.default_rng(0)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    n = 0
    for s, size in enumerate(sizes):
        rows = []
        for _ in range(size):
            buf = io.BytesIO()
            sf.write(buf, np.zeros(int(rng.integers(800, 8000)), "float32"), 16000, format="WAV")
            rows.append({"utt": f"u{n:04d}", "audio": {"bytes": buf.getvalue(), "path": None}, "sentence": "a b"})
            n += 1
        ds = datasets.Dataset.from_list(rows).cast_column("audio", datasets.Audio(16000, decode=False))
        ds.to_parquet(str(folder / "data" / f"train-{s:05d}-of-{len(sizes):05d}.parquet"), batch_size=4)
    return n


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    n = write_shards(folder, [5, 13, 2, 9, 7, 11, 1])  # 48 rows in 7 uneven shards, row groups of 4
    return folder, n


def ident(row):
    return row["id"]


SHARDS = {}  # folder → Shards: resolved once (each resolution imports and asks `datasets`)


def make(folder, partitions=4, block_rows=6, batch_size=3, seed=0, fresh=False):
    if fresh or folder not in SHARDS:
        SHARDS[folder] = open_shards(resolve_shards(str(folder)), COLUMNS)
    return ShardStream(SHARDS[folder], COLUMNS, seed=seed, partitions=partitions, block_rows=block_rows,
                       batch_size=batch_size)


def ids(batches):
    return [[r["id"] for r in rows] for _, rows in batches]


def global_order(stream, epoch, world, start=0):
    """Global batches (index → ids) as `world` ranks read them from local batch `start` on."""
    out = {}
    for rank in range(world):
        for k, rows in stream.batches(epoch, rank, world, start):
            out[k] = [r["id"] for r in rows]
    return [out[k] for k in sorted(out)]


def test_every_utterance_once_per_epoch_across_ranks_and_workers(shards):
    """Real DataLoader workers (2 per rank) on 2 ranks and 1: every id exactly once, equal steps."""
    folder, n = shards
    stream = make(folder)
    for world in (1, 2):
        seen, steps = [], []
        for rank in range(world):
            ds = StreamDataset(stream, ident, list, rank, world)
            loader = StreamLoader(ds, num_workers=2, seed=0)
            loader.set_epoch(3)
            got = [b for b in loader]
            assert len(got) == len(loader)
            steps.append(len(got))
            seen += [i for b in got for i in b]
        assert sorted(seen) == [f"u{i:04d}" for i in range(n)]  # once each, none dropped
        assert len(set(steps)) == 1  # every rank ends the epoch at the same step


def test_world_size_free_global_batches(shards):
    """The same global batches on 1 and 2 processes (elastic N → M), batch sizes ≤ batch_size."""
    stream = make(shards[0])
    one, two = global_order(stream, 1, 1), global_order(stream, 1, 2)
    assert one == two and len(one) == len(stream) and max(map(len, one)) <= 3


def test_pure_function_of_seed_and_epoch(shards):
    folder, _ = shards
    a, b = make(folder), make(folder)
    assert global_order(a, 2, 1) == global_order(b, 2, 1)
    assert global_order(a, 2, 1) != global_order(a, 3, 1)  # another epoch: another order
    assert global_order(make(folder, seed=1), 2, 1) != global_order(a, 2, 1)


def test_buckets_group_similar_durations(shards):
    stream = make(shards[0], block_rows=12, batch_size=3)
    spread = []
    for _, rows in stream.batches(0, 0, 1):
        d = [r["duration"] for r in rows]
        spread.append(max(d) - min(d))
    rng = np.random.default_rng(0)
    random = [np.ptp(rng.uniform(800, 8000, 3) / 16000) for _ in range(200)]
    assert np.mean(spread) < 0.5 * np.mean(random)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_exact_and_reads_one_block_per_partition(shards, world):
    """Resumed at every position: the same remaining batches; the rows read to restore do not grow
    with the position (one block per partition this rank reads, never what was consumed)."""
    folder, _ = shards
    full = global_order(make(folder), 4, world)
    per_rank = len(full) // world
    cost = []
    for start in range(per_rank):
        stream = make(folder)
        assert global_order(stream, 4, world, start) == full[start * world:]
        stream = make(folder)
        for rank in range(world):
            next(iter(stream.batches(4, rank, world, start)))
        cost.append(stream.reads)
    # First batch of every rank: one block of one partition (≤ block_rows + a batch's rounding).
    assert max(cost) <= world * (6 + 3)


def test_state_and_restore_time_do_not_grow_with_the_position(tmp_path, monkeypatch):
    """At the start and near the end of a 10× larger epoch, the first batch costs the same work:
    rows read, row ranges asked of the shards, batch offsets computed (nothing walks the position);
    the state is the position, two integers."""
    import common.data.stream

    n = write_shards(tmp_path, [60] * 8)
    stream = make(tmp_path, partitions=8, block_rows=6, batch_size=3)
    work = {"ranges": 0, "offsets": 0}
    read_range, batch_offsets = common.data.stream._read_range, stream.batch_offsets

    def counted_range(*args, **kwargs):
        work["ranges"] += 1
        return read_range(*args, **kwargs)

    def counted_offsets(*args, **kwargs):
        out = batch_offsets(*args, **kwargs)
        work["offsets"] += len(out)
        return out

    monkeypatch.setattr(common.data.stream, "_read_range", counted_range)
    monkeypatch.setattr(stream, "batch_offsets", counted_offsets)
    costs = []
    for start in (0, len(stream) - 2):
        stream.reads, work["ranges"], work["offsets"] = 0, 0, 0
        next(iter(stream.batches(0, 0, 1, start)))
        costs.append((stream.reads, work["ranges"], work["offsets"]))
    assert n == 480 and costs[0] == costs[1] and costs[0][0] <= 6, costs


def test_the_fingerprint_follows_contents_and_a_refusal_names_the_shard(tmp_path):
    """A plain copy of unchanged shards (`cp -r`: new file times) and the same bytes rewritten keep
    the fingerprint (the resume goes on); a shard rewritten with other rows, one added and one
    removed change it, and the refusal names each."""
    folder, copy = tmp_path / "a", tmp_path / "b"
    write_shards(folder, [4, 4])
    before = make(folder, partitions=2, batch_size=2, fresh=True).summary()
    time.sleep(0.01)
    shutil.copytree(folder, copy, copy_function=shutil.copyfile)  # as `cp -r`: mtimes are the copy's
    shard = copy / "data" / "train-00001-of-00002.parquet"
    assert shard.stat().st_mtime_ns != (folder / "data" / shard.name).stat().st_mtime_ns
    shard.write_bytes(shard.read_bytes())  # the same bytes rewritten: ctime and mtime move
    copied = make(copy, partitions=2, batch_size=2, fresh=True).summary()
    assert copied == before and data_change(before, copied, tmp_path) is None

    write_shards(tmp_path / "c", [4, 4, 3])  # other rows in shard 1 (other random audio), a third shard
    for name in ("train-00000-of-00002.parquet", "train-00001-of-00003.parquet"):
        shutil.copyfile(tmp_path / "c" / "data" / ("train-00001-of-00003.parquet" if "00003" not in name else
                                                   "train-00002-of-00003.parquet"), copy / "data" / name)
    shard.unlink()
    after = make(copy, partitions=2, batch_size=2, fresh=True).summary()
    assert after["fingerprint"] != before["fingerprint"]
    assert data_change(before, after, tmp_path) == (
        "training data changed: 1 shard appeared: train-00001-of-00003.parquet; 1 shard vanished: "
        "train-00001-of-00002.parquet; 1 shard changed (its content digest differs): train-00000-of-00002.parquet")
    # A checkpoint of a stream from before content digests (its fingerprint followed file times) resumes.
    old = {"utterances": 8, "fingerprint": "0123456789abcdef", "shards": 2}
    assert data_change(old, before, tmp_path) is None
    assert data_change({**old, "utterances": 9}, before, tmp_path).startswith("training data changed: checkpoint 9")


def test_column_name_mistake_is_one_line(shards):
    with pytest.raises(RunError, match=r"^--text_column_name text: no such column in .*\(it has utt, audio, sentence\)$"):
        open_shards(resolve_shards(str(shards[0])), {**COLUMNS, "text": "text"})


def test_missing_split_and_world_mistakes_are_one_line(shards):
    with pytest.raises(RunError, match="has no split 'validation'"):
        resolve_shards(str(shards[0]), split="validation")
    stream = make(shards[0], partitions=4)
    stream.check_world(2, 2, 2)
    with pytest.raises(RunError, match=r"--stream_partitions 4 is not a multiple of processes × data workers \(6\)"):
        stream.check_world(3, 2, 3)
    with pytest.raises(RunError, match=r"not a multiple of the global batch \(8\)"):
        stream.check_world(2, 0, 8)


def test_train_batches_resumes_a_stream_mid_epoch_without_reading_what_was_consumed(shards):
    """`common.training.loop.train_batches` over a `StreamLoader`, accumulation 2: stopped after step 10
    (inside epoch 1) and resumed with fresh objects, the micro-batches equal an uninterrupted run's."""
    from types import SimpleNamespace

    from common.training.state import TrainState
    from common.training.loop import end_step, train_batches

    acc = SimpleNamespace(process_index=0, num_processes=1)

    def run(state, stop_at=None):
        stream = make(shards[0])
        # a batch as the loop takes it: a dict with its ids (common.training.logs.batch_ids)
        loader = StreamLoader(StreamDataset(stream, ident, lambda rows: {"ids": list(rows)}, 0, 1), num_workers=0, seed=0)
        got = []
        for batch, micro in train_batches(acc, loader, state, max_steps=12, accumulation=2, seed=0):
            got.append(batch)
            if micro.sync:
                end_step(state)
                if state.step == stop_at:
                    break
        return got

    def started():
        state = TrainState(gradient_accumulation_steps=2, global_batch=2)
        state.stage = "boundary"
        return state

    full = run(started())
    state = started()
    first = run(state, stop_at=10)
    assert state.epoch == 1 and state.batches_in_epoch > 0  # 16 micro-batches an epoch: stopped inside epoch 1
    saved = TrainState(**state.state_dict())
    saved.stage = "boundary"
    rest = run(saved)
    assert first + rest == full
    assert len(full) == 24


def test_batch_offsets_are_array_splits_computed_for_one_block_only():
    """The cuts equal np.array_split's; a late block of a partition of 10^11 rows is cut without
    materializing the partition's offsets (which would need 400 GB: a resume there must cost a block)."""
    from common.data.stream import Shard

    cols = {"audio": "audio", "text": None, "id": None, "duration": "duration"}
    huge = ShardStream([Shard(f"s{i}", 10**9, "") for i in range(100)], cols, seed=0, partitions=2,
                       block_rows=64, batch_size=32)
    huge.read_rows = lambda epoch, a, b: [{"id": str(i), "duration": 1.0} for i in range(a, b)]
    K = huge.batches_per_partition
    batch = next(huge.partition_batches(0, 1, K - 1))  # the partition's last batch
    start, stop = huge.partition_range(1)
    assert len(batch) == 32 and all(stop - 64 <= int(r["id"]) < stop for r in batch)
    small = ShardStream([Shard("a", 47, ""), Shard("b", 30, "")], cols, seed=0, partitions=4, block_rows=6,
                        batch_size=3)
    for p in range(4):
        start, stop = small.partition_range(p)
        split = np.concatenate([[0], np.cumsum([len(a) for a in np.array_split(np.arange(stop - start), 7)])])
        assert small.batches_per_partition == 7 and list(small.batch_offsets(p)) == list(split)
        assert list(small.batch_offsets(p, 2, 5)) == list(split[2:6])


def test_reading_a_block_touches_only_the_shards_that_hold_it(tmp_path):
    """Rows at the end of an epoch of 20 000 shards are found by bisection over the epoch's shard
    starts, not by walking every shard before them (a cost growing with the corpus at every block)."""
    from common.data.stream import Shard

    write_shards(tmp_path, [8])
    real = open_shards(resolve_shards(str(tmp_path)), COLUMNS)[0]

    class Counted(list):
        touched = 0

        def __getitem__(self, i):
            Counted.touched += 1
            return super().__getitem__(i)

    shards = Counted(Shard(real.path, 8, real.stamp) for _ in range(20_000))
    stream = ShardStream(shards, COLUMNS, seed=0, partitions=4, block_rows=6, batch_size=3)
    rows = stream.read_rows(0, stream.rows - 10, stream.rows)
    assert [r["id"] for r in rows] == [f"u{i:04d}" for i in range(6, 8)] + [f"u{i:04d}" for i in range(8)]
    assert Counted.touched <= 2


def test_unset_partitions_adapt_to_a_small_split_and_a_short_batch_is_explained():
    from common.data.stream import auto_partitions, batch_shortfall, batch_sizes

    assert auto_partitions(100_000, 8) == 64 and batch_sizes(100_000, 64, 8)[:2] == (7, 8)
    assert auto_partitions(200, 8) == 4 and batch_sizes(200, 4, 8)[:2] == (7, 8)  # 64 would give 3–4
    assert auto_partitions(200, 8, multiple_of=8) == 8  # one partition per reader at least
    assert batch_shortfall(200, 4, 8) is None
    assert batch_shortfall(200, 8, 8, multiple_of=8) == (
        "streamed batches hold 6–7 utterances, not --per_device_train_batch_size 8: 200 rows in 8 partitions are "
        "25–25 a partition, cut into batches of equal count; even 8 partitions (one per reader) would not fill "
        "them: a smaller --per_device_train_batch_size, or more rows")
