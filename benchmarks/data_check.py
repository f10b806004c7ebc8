"""How fast is the data check? The old serial full decode against the header / full modes, serial
and in a process pool, a cached re-check and a re-launch, on a generated LibriSpeech-layout corpus.

    python benchmarks/data_check.py                      # 50 000 files, 3 repetitions (~10 min on 2 cores)
    python benchmarks/data_check.py --files 8000 --repeats 1   # a quick look (~1 min)

The corpus: `--files` FLAC files (16 kHz, 16-bit, ~140 kbit/s like LibriSpeech) of a few distinct
waveforms, hard-linked into `<spk>/<chap>/<spk>-<chap>-<utt>.flac` with their `.trans.txt`, in four
splits of a quarter each (for the linearity line). Generating it is not measured. The files are
hard links of a few inodes, so every read hits the page cache: the figures are the CPU cost of the
check, without disk or network I/O (on NFS, header mode also reads ~20× fewer bytes per file).

Each repetition runs every variant once, in turn (interleaved, so a slower minute on a shared
machine hits all variants alike); each line gives the median over the repetitions and its ratio to
the old serial full decode, and the time the variant would take on LibriSpeech 960 h (281 241
files) at that rate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: this checkout's common/

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402

from common.data.datacheck import audio_facts, default_workers, list_files  # noqa: E402
from common.data.manifest import DataPolicy, prepare_manifest, scan_librispeech  # noqa: E402

LIBRISPEECH_960H_FILES = 281_241
LIBRISPEECH_MEAN_SECONDS = 12.3  # 960 h / 281 241 utterances
SAMPLE_RATE = 16000  # Hz
UTTS_PER_CHAPTER = 100
CHAPTERS_PER_SPEAKER = 5
SPLITS = ["part-1", "part-2", "part-3", "part-4"]


def speechlike(seconds: float, seed: int) -> np.ndarray:
    """Brown noise, high-passed and amplitude-modulated at 3 Hz (syllable rate): FLAC compresses it
    to ~140 kbit/s, like LibriSpeech, so decoding costs what it costs on speech."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    x = np.cumsum(rng.standard_normal(n))
    x -= np.convolve(x, np.ones(64) / 64, "same")  # remove the drift below ~250 Hz
    x = x / np.abs(x).max() * 0.3 * (0.5 + 0.5 * np.sin(np.arange(n) / SAMPLE_RATE * 2 * np.pi * 3))
    return x.astype("float32")


def make_corpus(root: Path, n_files: int, mean_seconds: float) -> None:
    sources = []
    for i in range(8):  # 8 distinct files, durations mean_seconds × 0.65 … 1.35
        path = root / f"source-{i}.flac"
        sf.write(path, speechlike(mean_seconds * (0.65 + 0.1 * i), seed=i), SAMPLE_RATE)
        sources.append(path)
    per_split = n_files // len(SPLITS)
    k = 0
    for s, split in enumerate(SPLITS):
        for j in range(per_split):
            spk, chap = 1000 + s * 1000 + j // (UTTS_PER_CHAPTER * CHAPTERS_PER_SPEAKER), j // UTTS_PER_CHAPTER
            folder = root / split / str(spk) / str(chap)
            if j % UTTS_PER_CHAPTER == 0:
                folder.mkdir(parents=True)
                trans = open(folder / f"{spk}-{chap}.trans.txt", "w")
            utt = f"{spk}-{chap}-{j % UTTS_PER_CHAPTER:04d}"
            os.link(sources[k % len(sources)], folder / f"{utt}.flac")
            trans.write(f"{utt} SOME WORDS NUMBER {k % 97}\n")
            k += 1
            if j % UTTS_PER_CHAPTER == UTTS_PER_CHAPTER - 1 or j == per_split - 1:
                trans.close()


# ---------------------------------------------------------------------------------------------
# The reference: the data check as it was before the header mode (serial, every sample decoded,
# the fingerprint from `Path.rglob` with two stats per file)
# ---------------------------------------------------------------------------------------------


def old_fingerprint(root: Path, parts: list[str], policy: DataPolicy) -> str:
    h = hashlib.blake2b(repr(policy).encode(), digest_size=8)
    for part in parts:
        for p in sorted((root / part).rglob("*")):
            if p.is_file():
                st = p.stat()
                h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def old_check(row: dict, policy: DataPolicy) -> tuple[str | None, dict]:
    path = Path(row["path"])
    if not path.is_file():
        return "missing file", {}
    try:
        audio, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001
        return "unreadable audio", {"detail": str(e)[:120]}
    facts = {"sample_rate": sr, "duration": audio.shape[0] / sr}
    if audio.shape[1] != 1 or audio.shape[0] == 0 or not np.isfinite(audio).all() or np.abs(audio).max() == 0:
        return "bad audio", facts
    if not policy.min_seconds <= facts["duration"] <= policy.max_seconds:
        return "bad duration", facts
    return None, facts


def old_prepare(out: Path, root: Path, splits: str, policy: DataPolicy) -> datasets.Dataset:
    final = out / "data" / f"train-{old_fingerprint(root, splits.split(','), policy)}"
    final.mkdir(parents=True)
    rows, problems = scan_librispeech(root, splits)
    good = []
    for row in rows:
        reason, facts = old_check(row, policy)
        if reason:
            problems.append({"entry": row["where"], "reason": reason})
        else:
            good.append({k: v for k, v in row.items() if k != "where"} | facts)
    good.sort(key=lambda r: r["id"])
    (final / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    return datasets.Dataset.from_list(good)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=50_000, help="audio files in the corpus (≥ 8)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every variant (median reported)")
    parser.add_argument("--mean_seconds", type=float, default=2.0, help="mean duration of the files, seconds")
    parser.add_argument("--workers", type=int, default=None, help="pool size (default: every core we may use)")
    args = parser.parse_args()
    if args.files < 8 or args.repeats < 1:
        parser.error("--files must be ≥ 8 and --repeats ≥ 1")
    logging.basicConfig(level=logging.WARNING)
    workers = args.workers or default_workers()
    tmp = Path(tempfile.mkdtemp(prefix="data_check_bench-"))
    try:
        run(tmp, args, workers)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(tmp: Path, args, workers: int) -> None:
    root = tmp / "corpus"
    root.mkdir()
    make_corpus(root, args.files, args.mean_seconds)
    n = args.files // len(SPLITS) * len(SPLITS)
    all_splits = ",".join(SPLITS)
    header, full = DataPolicy(SAMPLE_RATE), DataPolicy(SAMPLE_RATE, data_check="full")
    print(f"corpus: {n} FLAC files in LibriSpeech layout, mean {args.mean_seconds} s; {os.cpu_count()} cores, "
          f"pool of {workers}; load average {os.getloadavg()[0]:.1f}; {args.repeats} repetition(s), interleaved")

    counter = iter(range(10**9))

    def fresh() -> Path:
        return tmp / f"out-{next(counter)}"

    def cached_recheck() -> datasets.Dataset:
        # after a build: the manifest folder removed (as when a few files were added), the cache kept
        for d in (warm / "data").iterdir():
            if d.is_dir():
                shutil.rmtree(d)
        return prepare_manifest(warm, "train", root, header, all_splits)

    warm = fresh()
    prepare_manifest(warm, "train", root, header, all_splits)  # fills warm's cache
    variants = {
        "old: full decode, serial": lambda: old_prepare(fresh(), root, all_splits, full),
        "header, serial": lambda: prepare_manifest(fresh(), "train", root, header, all_splits, workers=1),
        f"header, pool of {workers}": lambda: prepare_manifest(fresh(), "train", root, header, all_splits,
                                                              workers=workers),
        f"full, pool of {workers}": lambda: prepare_manifest(fresh(), "train", root, full, all_splits,
                                                            workers=workers),
        "header, cached re-check": cached_recheck,
        "re-launch (manifest built)": lambda: prepare_manifest(warm, "train", root, header, all_splits),
        "  of which: fingerprint, old": lambda: old_fingerprint(root, SPLITS, header),
        "  of which: fingerprint, new": lambda: list_files([root / s for s in SPLITS]),
    }
    linear = {k: ",".join(SPLITS[:k]) for k in (1, 2)}  # N/4, N/2 (N is "header, pool")
    times: dict[str, list[float]] = {name: [] for name in [*variants, *linear]}
    cpu: dict[str, list[float]] = {name: [] for name in variants}  # CPU seconds, this process + its workers
    reference_rows = None
    for rep in range(args.repeats):
        for name, fn in variants.items():
            start, cpu_start = time.perf_counter(), cpu_seconds()
            result = fn()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(cpu_seconds() - cpu_start)
            if isinstance(result, datasets.Dataset):  # every variant must accept the same utterances
                rows = list(zip(result["id"], result["duration"]))
                reference_rows = reference_rows or rows
                assert rows == reference_rows, f"{name}: another manifest than the old check's"
        for k, splits in linear.items():
            start = time.perf_counter()
            prepare_manifest(fresh(), "train", root, header, splits, workers=workers)
            times[k].append(time.perf_counter() - start)
        print(f"  repetition {rep + 1}/{args.repeats} done", flush=True)
    assert reference_rows is not None and len(reference_rows) == n

    median = {name: statistics.median(t) for name, t in times.items()}
    old = median["old: full decode, serial"]
    old_cpu = statistics.median(cpu["old: full decode, serial"])
    print(f"\n{'variant':34s} {'files/s':>9s} {'× old':>7s} {'CPU ms/file':>12s} {'× old':>7s}   "
          f"{LIBRISPEECH_960H_FILES} files (LibriSpeech 960 h) of {args.mean_seconds} s at this rate")
    for name in variants:
        rate = n / median[name]
        extrapolated = LIBRISPEECH_960H_FILES / rate
        cpu_per_file = statistics.median(cpu[name]) / n
        print(f"{name:34s} {rate:9.0f} {old / median[name]:7.1f} {cpu_per_file * 1e3:12.3f} "
              f"{old_cpu / n / cpu_per_file:7.1f}   {fmt(extrapolated)} (old: {fmt(LIBRISPEECH_960H_FILES / (n / old))})")
    print(f"(CPU: this process and its pool workers, user + system; a pool needs idle cores to turn it into "
          f"speed: load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(f"\nlinearity, header with a pool of {workers} (files/s; ratio to the rate at N):")
    full_rate = n / median[f"header, pool of {workers}"]
    for label, k in (("N/4", 1), ("N/2", 2)):
        rate = n // len(SPLITS) * k / median[k]
        print(f"  {label} = {n // len(SPLITS) * k:6d} files: {rate:7.0f} files/s ({rate / full_rate:.2f})")
    print(f"  N   = {n:6d} files: {full_rate:7.0f} files/s (1.00)")
    per_file_at_librispeech_length()


def per_file_at_librispeech_length(files: int = 200) -> None:
    """The benchmark's files are short to keep it quick; header reading costs about the same on
    longer files, full decoding grows with the duration. One process, one 12.3 s file read again."""
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "long.flac")
        sf.write(path, speechlike(LIBRISPEECH_MEAN_SECONDS, seed=0), SAMPLE_RATE)
        cost = {}
        for mode in ("header", "full", "header", "full"):  # interleaved; the second pass counts
            start = time.perf_counter()
            for _ in range(files):
                audio_facts(path, mode)
            cost[mode] = (time.perf_counter() - start) / files
    print(f"\nper file at LibriSpeech's mean duration ({LIBRISPEECH_MEAN_SECONDS} s), one process, "
          f"{files} reads: full decode costs {cost['full'] / cost['header']:.1f}× the header check "
          f"({cost['header'] * 1e3:.2f} ms vs {cost['full'] * 1e3:.2f} ms per file; 281 241 files serially: "
          f"{fmt(cost['header'] * LIBRISPEECH_960H_FILES)} vs {fmt(cost['full'] * LIBRISPEECH_960H_FILES)})")


def cpu_seconds() -> float:
    """User + system CPU of this process and of its finished children (the pool's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def fmt(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


if __name__ == "__main__":
    main()
