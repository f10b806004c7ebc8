import numpy as np
import pytest
import torch

from common.data.loading import DurationBatchSampler, load_audio, read_audio_file, resample, sample_generator
from common.training.faults import UsageError
from common.training.distributed import derive_seed


def durations(n=103, seed=0):
    return np.random.default_rng(seed).uniform(1.0, 8.0, n)


def shard(batches, rank, world):
    return batches[rank::world]  # what accelerate's BatchSamplerShard does with even_batches


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_epoch_covers_once_disjoint_equal_steps(world):
    d = durations()
    s = DurationBatchSampler(d, 20.0, num_buckets=5, seed=1, multiple_of=world)
    for epoch in range(3):
        s.set_epoch(epoch)
        batches = list(s)
        assert len(batches) == len(s) and len(batches) % world == 0
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(d)))  # every utterance exactly once, none dropped
        per_rank = [shard(batches, r, world) for r in range(world)]
        assert len({len(p) for p in per_rank}) == 1  # same number of steps on every rank
        for b in batches:
            assert b and (len(b) == 1 or len(b) * d[b].max() <= 20.0)


def test_pure_function_of_seed_and_epoch():
    d = durations()
    a = DurationBatchSampler(d, 20.0, seed=3, multiple_of=2)
    b = DurationBatchSampler(d, 20.0, seed=3, multiple_of=2)
    b.set_epoch(5)
    list(b)  # a different state before must not matter
    b.set_epoch(1)
    a.set_epoch(1)
    assert list(a) == list(b)
    a.set_epoch(2)
    assert list(a) != list(b)  # epochs differ
    c = DurationBatchSampler(d, 20.0, seed=4, multiple_of=2)
    c.set_epoch(1)
    assert list(c) != list(b)


def test_buckets_group_similar_lengths():
    d = durations(400)
    s = DurationBatchSampler(d, 30.0, num_buckets=10, seed=0)
    spread = np.mean([d[b].max() - d[b].min() for b in s if len(b) > 1])
    assert spread < 1.0  # random batches would spread over ~5 s


def test_no_shuffle_is_fixed():
    s = DurationBatchSampler(durations(), 20.0, shuffle=False, multiple_of=2)
    first = list(s)
    s.set_epoch(7)
    assert list(s) == first


def test_too_few_utterances():
    from common.training.faults import RunError

    with pytest.raises(RunError, match="1 utterances cannot fill 2 batches .* use fewer processes"):  # one line, not a traceback
        DurationBatchSampler([1.0], 10.0, multiple_of=2)


def test_sample_generator_and_seeds():
    x = torch.rand(5, generator=sample_generator(1, 2, "a-b-c"))
    assert torch.equal(x, torch.rand(5, generator=sample_generator(1, 2, "a-b-c")))
    assert not torch.equal(x, torch.rand(5, generator=sample_generator(1, 3, "a-b-c")))
    assert derive_seed(1, "x") == derive_seed(1, "x") != derive_seed(1, "y")
    assert 0 <= derive_seed("big", 10**30) < 2**63


def test_skip_first_batches_loads_no_skipped_sample():
    """Mid-epoch resume through accelerate: skipped batches cost index work only, no loading."""
    from accelerate import Accelerator, skip_first_batches
    from torch.utils.data import DataLoader

    loaded = []

    class Counting(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            loaded.append(i)
            return i

    d = np.linspace(1.0, 4.0, 40)
    sampler = DurationBatchSampler(d, 8.0, seed=0)
    loader = Accelerator(cpu=True).prepare(DataLoader(Counting(), batch_sampler=sampler,
                                                      collate_fn=lambda b: b))
    everything = [b for b in loader]
    loaded.clear()
    resumed = [b for b in skip_first_batches(loader, 3)]
    assert resumed == everything[3:]
    assert sorted(loaded) == sorted(i for b in everything[3:] for i in b)


def test_items_kept_in_memory_are_the_same_and_the_budget_holds():
    from common.data.loading import InMemoryItems, keep_in_memory

    class Reads(torch.utils.data.Dataset):
        def __init__(self):
            self.reads, self.manifest = 0, "rows"

        def __len__(self):
            return 4

        def __getitem__(self, i):
            self.reads += 1
            return f"utt{i}", torch.full((256,), float(i))  # 1 KiB of float32 per item

    inner = Reads()
    kept = InMemoryItems(inner, budget_mb=0)
    kept.budget = 2 * 1024  # bytes: room for two items
    first = [kept[i] for i in range(4)]
    again = [kept[i] for i in range(4)]
    assert inner.reads == 4 + 2  # items 0 and 1 kept; 2 and 3 (over the budget) read again
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    assert kept.nbytes == 2 * 1024 and kept.manifest == "rows"  # other attributes are the dataset's
    assert keep_in_memory(inner, 64, num_workers=2, what="training") is inner  # workers: their own reads
    assert keep_in_memory(inner, 0, num_workers=0, what="training") is inner  # off

    inner.set_epoch = lambda epoch: None  # e.g. speed perturbation: an item of epoch 0 is wrong in epoch 1
    with pytest.raises(ValueError, match="may change with the epoch"):
        keep_in_memory(inner, 64, num_workers=0, what="training")  # refused, never kept stale

    # ...unless the dataset names what its items depend on: kept per key
    inner.epoch, inner.reads = 0, 0
    inner.cache_key = lambda i: (i, inner.epoch % 2)
    kept = keep_in_memory(inner, 64, num_workers=0, what="training")
    assert isinstance(kept, InMemoryItems)
    for inner.epoch in range(4):
        [kept[i] for i in range(4)]
    assert inner.reads == 8  # epochs 0 and 1 read (keys (i, 0) and (i, 1)); 2 and 3 come from RAM


def test_an_audio_file_of_any_rate_and_channels_reads_as_the_data_layer_reads_it(tmp_path):
    """read_audio_file (transcribe.py, predict.py): a 44.1 kHz stereo file is mixed down and
    resampled as load_audio does; what soundfile cannot read, an empty file and non-finite samples
    are one-line refusals (UsageError: exit code 2)."""
    import soundfile as sf

    t = np.arange(44100) / 44100
    stereo = np.stack([0.3 * np.sin(2 * np.pi * 220 * t), 0.1 * np.sin(2 * np.pi * 330 * t)], axis=1)
    sf.write(tmp_path / "stereo.flac", stereo, 44100, subtype="PCM_16")
    wav = read_audio_file(str(tmp_path / "stereo.flac"), 16000)
    assert wav.shape == (16000,) and torch.equal(wav, load_audio(str(tmp_path / "stereo.flac"), 16000))
    (tmp_path / "notes.wav").write_text("not audio")
    sf.write(tmp_path / "empty.wav", np.zeros((0, 1)), 16000)
    sf.write(tmp_path / "nan.wav", np.array([0.0, np.nan, 0.0]), 16000, subtype="FLOAT")
    for name, says in (("notes.wav", "soundfile cannot read it as audio (Error opening"),
                       ("empty.wav", "it holds no samples"), ("nan.wav", "it holds non-finite samples")):
        with pytest.raises(UsageError) as e:
            read_audio_file(str(tmp_path / name), 16000)
        assert str(e.value).startswith(f"{tmp_path / name}: {says}") and "\n" not in str(e.value)


@pytest.mark.parametrize("orig,new", [(16000, 22050), (22050, 16000), (8000, 16000), (15200, 16000), (16000, 16000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_resample_is_torchaudios_bit_for_bit(orig, new, dtype):
    """The kernel made once per (rates, dtype) gives torchaudio.functional.resample's samples exactly
    (the built-in corpus's bytes and every cached item depend on it), for one clip or a batch."""
    import torchaudio

    for shape in [(4001,), (3, 2500)]:
        wav = torch.randn(shape, generator=torch.Generator().manual_seed(orig + new), dtype=dtype)
        for _ in range(2):  # the second call reads the kept kernel
            assert torch.equal(resample(wav, orig, new), torchaudio.functional.resample(wav, orig, new))
