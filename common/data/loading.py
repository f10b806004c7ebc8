"""Audio loading, the duration-bucketing batch sampler, and the training/validation DataLoader.

(Manifests, i.e. reading a corpus folder into rows and checking them, are in `common.data.manifest`.)
Data contract that makes resume exact and DDP honest:
- a manifest is sorted by utterance id, so its order never depends on the file system;
- the batch sampler is a pure function of (seed, epoch, multiple_of): every rank builds the same
  global list of batches, whose length is a multiple of the global batch G (micro-batches per
  optimizer step, = processes × accumulation, fixed at a run's first launch). Accelerate then deals
  batch i to rank i % world_size, so ranks see disjoint samples and the same number of steps, its
  `even_batches` padding (which re-serves the first batches, duplicating samples) never triggers,
  and optimizer step s consumes global batches [sG, (s+1)G) whatever the number of processes;
- per-sample randomness (masking, augmentation) comes from `sample_generator(seed, epoch, id)`,
  so worker count, sharding and `skip_first_batches` cannot change it.
"""

from __future__ import annotations

import functools

import numpy as np
import soundfile as sf
import torch
import torchaudio
from torch.utils.data import DataLoader

from common.training.distributed import derive_seed
from common.training.faults import RunError, UsageError
from common.training.logs import get_logger

logger = get_logger(__name__)  # main process only


@functools.lru_cache(maxsize=32)
def _resampler(orig: int, new: int, dtype: torch.dtype, device: torch.device) -> torchaudio.transforms.Resample:
    return torchaudio.transforms.Resample(orig, new, dtype=dtype).to(device)


def resample(wav: torch.Tensor, orig: int, new: int) -> torch.Tensor:
    """`torchaudio.functional.resample(wav, orig, new)`, bit for bit, with its windowed-sinc kernel made
    once per (orig, new, dtype, device): the functional rebuilds it on every call, which costs more than the
    filtering itself for co-prime rates (16000 -> 22050 Hz: ~0.1 s per clip on a CPU core)."""
    if orig == new:
        return wav
    return _resampler(int(orig), int(new), wav.dtype, wav.device)(wav)


def load_audio(path: str, sample_rate: int) -> torch.Tensor:
    """Mono float32 waveform in [-1, 1] at `sample_rate` Hz, shape (samples,)."""
    wav, sr = sf.read(path, dtype="float32", always_2d=True)  # (samples, channels)
    return resample(torch.from_numpy(wav).mean(dim=1), sr, sample_rate)


def read_audio_file(path: str, sample_rate: int) -> torch.Tensor:
    """`load_audio` of a file named on a tool's command line (transcribe.py, predict.py): any sample
    rate and channel count, mixed down and resampled as the training data were. A file soundfile
    cannot read, or one without samples or with non-finite ones, is a UsageError of one line."""
    try:
        wav = load_audio(path, sample_rate)
    except (RuntimeError, OSError) as e:  # soundfile's LibsndfileError is a RuntimeError
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise UsageError(f"{path}: soundfile cannot read it as audio ({reason}): give a file in a format it reads "
                         f"(WAV, FLAC, OGG, ...: python -c 'import soundfile; print(soundfile.available_formats())')"
                         ) from None
    if not len(wav):
        raise UsageError(f"{path}: it holds no samples: give a file with speech in it")
    if not torch.isfinite(wav).all():
        raise UsageError(f"{path}: it holds non-finite samples (NaN or Inf): give a file of finite samples")
    return wav


def sample_generator(seed: int, epoch: int, sample_id: str) -> torch.Generator:
    """The only source of per-sample randomness: a pure function of (seed, epoch, sample id)."""
    return torch.Generator().manual_seed(derive_seed(seed, epoch, sample_id))


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------


class DurationBatchSampler:
    """Dynamic batches of similar-length utterances, sized in seconds of (padded) audio.

    Each epoch: sort utterances by duration (random tie-break), cut into `num_buckets` buckets of
    equal count, shuffle inside each bucket, then pack greedily so that
    `len(batch) * max(duration in batch) <= max_batch_seconds` (the padded size, which is what
    costs memory and compute); finally shuffle the batch order. An utterance longer than
    `max_batch_seconds` gets a batch of its own.

    The result is identical on every rank. Its length is made a multiple of `multiple_of` (the
    global batch in micro-batches, or the world size for evaluation) by splitting the largest
    batches, so Accelerate's round-robin sharding covers every utterance exactly once with equal
    step counts, and no accumulation window is ever short. Do not shard it again (accelerate #4075).
    """

    def __init__(
        self,
        durations: list[float] | np.ndarray,
        max_batch_seconds: float,
        *,
        num_buckets: int = 10,
        shuffle: bool = True,
        seed: int = 0,
        multiple_of: int = 1,
    ):
        self.durations = np.asarray(durations, dtype=np.float64)
        if len(self.durations) < multiple_of:
            raise RunError(f"{len(self.durations)} utterances cannot fill {multiple_of} batches (every process "
                           f"needs one per step, or per evaluation pass): use fewer processes (or a smaller "
                           f"--gradient_accumulation_steps), or a larger split")
        self.max_batch_seconds = max_batch_seconds
        self.num_buckets = max(1, min(num_buckets, len(self.durations)))
        self.shuffle = shuffle
        self.seed = seed
        self.multiple_of = multiple_of
        self.epoch = 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        rng = np.random.default_rng(derive_seed(self.seed, "batches", self.epoch))
        n = len(self.durations)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        order = order[np.argsort(self.durations[order], kind="stable")]
        batches: list[list[int]] = []
        for bucket in np.array_split(order, self.num_buckets):
            if self.shuffle:
                bucket = rng.permutation(bucket)
            batch: list[int] = []
            longest = 0.0
            for idx in bucket.tolist():
                d = float(self.durations[idx])
                fits = (len(batch) + 1) * max(longest, d) <= self.max_batch_seconds
                if batch and not fits:
                    batches.append(batch)
                    batch, longest = [], 0.0
                batch.append(idx)
                longest = max(longest, d)
            if batch:
                batches.append(batch)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        # Make the count a multiple of multiple_of by halving the largest batches (never dropping).
        while len(batches) % self.multiple_of:
            big = max(range(len(batches)), key=lambda i: (len(batches[i]), -i))
            b = batches[big]
            if len(b) < 2:
                raise ValueError(
                    f"cannot split {n} utterances into a multiple of {self.multiple_of} batches; "
                    "raise max_batch_seconds"
                )
            batches[big : big + 1] = [b[: len(b) // 2], b[len(b) // 2 :]]
        self._cache = (self.epoch, batches)
        return batches

    def __iter__(self):
        yield from self.batches()

    def __len__(self) -> int:
        return len(self.batches())


class InMemoryItems(torch.utils.data.Dataset):
    """`dataset[i]` kept in RAM after its first read, while the kept tensors stay under `budget_mb`.

    On CPU, reading a batch in the training process (decode, log-mel) costs ~0.13 × a BEST-RQ step
    and cannot overlap it (the compute threads use every core; benchmarks/README.md): epochs after
    the first then skip it. Items are returned as stored, so consumers (collators) must not modify
    them in place; the ones here copy them into the padded batch. Items beyond the budget are read
    every time (no eviction: random access would only churn). Each process keeps its own copy.

    An item must be a pure function of its key: the index, or `dataset.cache_key(i)` when the
    dataset has one (ASR: (index, speed factor), the one thing its epoch changes). A dataset with a
    `set_epoch` (its items may change with the epoch) and no key is refused."""

    def __init__(self, dataset, budget_mb: int):
        if hasattr(dataset, "set_epoch") and not hasattr(dataset, "cache_key"):
            raise ValueError(f"{type(dataset).__name__} items may change with the epoch (it has set_epoch) "
                             f"and it gives no cache_key(i): they cannot be kept")
        self.dataset, self.budget = dataset, budget_mb * 2**20  # bytes
        self.key = getattr(dataset, "cache_key", lambda i: i)
        self.items: dict = {}
        self.nbytes = 0

    def __getattr__(self, name):  # everything else is the wrapped dataset's (its manifest, ...)
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        key = self.key(i)
        item = self.items.get(key)
        if item is None:
            item = self.dataset[i]
            size = sum(t.nbytes for t in item if isinstance(t, torch.Tensor))
            if self.nbytes + size <= self.budget:
                self.items[key], self.nbytes = item, self.nbytes + size
        return item


def keep_in_memory(dataset, budget_mb: int, num_workers: int, what: str):
    """`InMemoryItems(dataset, budget_mb)` when the training process itself reads the data
    (`num_workers` 0: the CPU default); unchanged with workers (non-persistent workers would fill a
    copy each epoch and drop it) or a budget of 0."""
    if budget_mb <= 0 or num_workers > 0:
        return dataset
    logger.info(f"{what} set: items kept in RAM after their first read, up to {budget_mb} MB per process")
    return InMemoryItems(dataset, budget_mb)


def auto_workers(requested: int | None, cuda: bool) -> int:
    """DataLoader worker processes per training process; `requested` None means automatic.

    On CPU: 0. The compute threads already use every core (`common.training.distributed.set_threads`), and a
    worker takes one from them: on 2 cores, 2 threads + 1 worker ran at 0.84× the speed of 2 threads
    alone, although 1 worker helps a 1-thread run (1.11×); see benchmarks/README.md. On a GPU: this
    process's share of the cores minus one for its own thread, at most 4, so that decoding and
    log-mels overlap the GPU's step. Results do not depend on it (per-sample RNG)."""
    if requested is not None:
        return requested
    return min(4, max(1, torch.get_num_threads() - 1)) if cuda else 0


def make_loader(dataset, durations, collate_fn, *, max_batch_seconds: float, num_buckets: int, seed: int,
                multiple_of: int, shuffle: bool, num_workers: int = 0,
                pin_memory: bool = False) -> tuple[DataLoader, DurationBatchSampler]:
    """A DataLoader over `DurationBatchSampler` batches (to be passed to `accelerator.prepare`);
    `multiple_of`: the global batch in micro-batches (training) or the number of processes.

    The loader gets its own generator: creating an iterator draws one int64 from it, and from the
    global torch RNG if it had none, so a resumed run (which creates its iterator at another point)
    would otherwise shift the global RNG (dropout) from its first step on (docs/resume.md).
    Workers are not persistent: each epoch's workers get fresh copies of the dataset and collator,
    so the epoch given to their `set_epoch` reaches them. `pin_memory` (GPU runs): page-locked
    batches, copied to the device without blocking the step."""
    sampler = DurationBatchSampler(durations, max_batch_seconds, num_buckets=num_buckets, shuffle=shuffle,
                                   seed=seed, multiple_of=multiple_of)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
                        generator=torch.Generator().manual_seed(seed), persistent_workers=False,
                        pin_memory=pin_memory)
    return loader, sampler


def load_row_audio(row: dict, sample_rate: int) -> torch.Tensor:
    """`load_audio` of a manifest row: its `path` (a folder's), or its `audio` cell (a `datasets`
    source's, undecoded: bytes or a path)."""
    from common.data.stream import audio_source

    return load_audio(audio_source(row["audio"]) if "audio" in row else row["path"], sample_rate)


def build_loaders(cfg, accelerator, *, global_batch: int, num_workers: int, train: tuple, valid: tuple
                  ) -> tuple[DataLoader, DurationBatchSampler, DataLoader]:
    """(training loader, its sampler, validation loader): duration-bucketed loaders over `train` and
    `valid`, each (manifest, dataset, collator), with the items kept in RAM after their first read
    (`keep_in_memory`). The training batches per epoch are a multiple of `global_batch` micro-batches
    (the resume plan's, `common.training.run.start_run`), the validation batches a multiple of the processes.
    Reads the shared Config fields max_batch_seconds, num_buckets, seed and memory_cache_mb."""
    (train_set, train_items, collate), (valid_set, valid_items, valid_collate) = train, valid
    world = accelerator.num_processes
    logger.info(f"{len(train_set)} training utterances ({sum(train_set['duration']) / 3600:.2f} h), "
                f"{len(valid_set)} validation, {world} process(es)")
    batching = dict(max_batch_seconds=cfg.max_batch_seconds, num_buckets=cfg.num_buckets, seed=cfg.seed,
                    num_workers=num_workers, pin_memory=accelerator.device.type == "cuda")
    train_loader, train_sampler = make_loader(
        keep_in_memory(train_items, cfg.memory_cache_mb, num_workers, "training"), train_set["duration"], collate,
        shuffle=True, multiple_of=global_batch, **batching)
    valid_loader, _ = make_loader(
        keep_in_memory(valid_items, cfg.memory_cache_mb, num_workers, "validation"), valid_set["duration"],
        valid_collate, shuffle=False, multiple_of=world, **batching)
    return train_loader, train_sampler, valid_loader
