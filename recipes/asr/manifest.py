"""Utterance manifests for ASR: LibriSpeech-layout folders or Hugging Face `datasets` saved to disk.

`read_split(data_dir, split)`:
- if `<data_dir>/<split>/state.json` exists, it is a `datasets.Dataset.save_to_disk` folder (what
  `DatasetDict.save_to_disk(data_dir)` writes for each split) loaded with `datasets.load_from_disk`.
  Columns: `text` (the transcript), and the audio as either `path` (an audio file soundfile reads)
  or `audio` (a `datasets.Audio` column, read undecoded from its bytes or path; or a plain struct
  {`array`, `sampling_rate`}). Optional: `id` (default: the row number, zero-padded) and
  `duration` (seconds; default: read from the audio headers once). Other columns are ignored.
- otherwise it is LibriSpeech layout (`common.data.read_librispeech`); several splits may be
  joined with commas (train-clean-100,train-clean-360).
Utterances whose transcript is empty after normalization are left out (CTC and WER need text).
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import datasets
import soundfile as sf
import torch
import torchaudio

from common.data import load_audio, read_librispeech
from common.distributed import derive_seed
from text import normalize_text


def _audio_source(row: dict):
    """(path or file-like, None) or (None, (array, sample_rate)) for one manifest row."""
    audio = row.get("audio")
    if audio is None:
        return row["path"], None
    if audio.get("bytes"):
        return io.BytesIO(audio["bytes"]), None
    if audio.get("array") is not None:
        return None, (audio["array"], audio["sampling_rate"])
    return audio["path"], None


def load_wav(row: dict, sample_rate: int) -> torch.Tensor:
    """Mono float32 waveform (samples,) at `sample_rate` for a manifest row of `read_split`."""
    source, array = _audio_source(row)
    if isinstance(source, str):
        return load_audio(source, sample_rate)
    if array is None:
        data, sr = sf.read(source, dtype="float32", always_2d=True)
        wav = torch.from_numpy(data).mean(dim=1)
    else:
        wav, sr = torch.as_tensor(array[0], dtype=torch.float32), array[1]
        wav = wav.mean(dim=-1) if wav.ndim == 2 else wav
    return torchaudio.functional.resample(wav, sr, sample_rate) if sr != sample_rate else wav


def _duration(row: dict) -> float:
    source, array = _audio_source(row)
    if array is not None:
        return len(array[0]) / array[1]
    info = sf.info(source)
    return info.frames / info.samplerate


def read_hf_split(folder: Path) -> datasets.Dataset:
    ds = datasets.load_from_disk(str(folder))
    cols = ds.column_names
    if "text" not in cols or not ({"path", "audio"} & set(cols)):
        raise ValueError(f"{folder}: a saved dataset needs a `text` column and a `path` or `audio` column; "
                         f"it has {cols}")
    keep = [c for c in ("id", "text", "duration", "path", "audio") if c in cols]
    ds = ds.select_columns(keep)
    if "audio" in keep and isinstance(ds.features["audio"], datasets.Audio):
        ds = ds.cast_column("audio", datasets.Audio(decode=False))  # we decode with soundfile
    if "id" not in keep:
        ds = ds.add_column("id", [f"{i:08d}" for i in range(len(ds))])
    if "duration" not in keep:
        ds = ds.add_column("duration", [_duration(row) for row in ds.select_columns(
            [c for c in ("path", "audio") if c in keep])])
    return ds


def read_split(data_dir: str | Path, split: str, read_folder=read_librispeech) -> datasets.Dataset:
    """Manifest with at least `id`, `text` (raw), `duration` (s) and `path` or `audio`; see above.
    `read_folder(data_dir, split)` reads the LibriSpeech layout (train.py passes the checked
    `common.manifest.prepare_manifest`)."""
    folder = Path(data_dir) / split
    ds = read_hf_split(folder) if (folder / "state.json").is_file() else read_folder(data_dir, split)
    keep = [i for i, t in enumerate(ds["text"]) if normalize_text(t)]
    if len(keep) < len(ds):
        logging.getLogger(__name__).warning(
            f"{split}: {len(ds) - len(keep)} utterances left out: no letters in their transcripts")
        ds = ds.select(keep)
    return ds


def labelled_subset(ds: datasets.Dataset, fraction: float) -> datasets.Dataset:
    """The round(fraction · N) utterances whose ids hash lowest: deterministic, independent of the
    seed and of the order, and nested (a smaller fraction is a subset of a larger one)."""
    if fraction >= 1.0:
        return ds
    n = max(1, round(fraction * len(ds)))
    ids = ds["id"]
    ranked = sorted(range(len(ds)), key=lambda i: derive_seed("labelled_subset", ids[i]))
    return ds.select(sorted(ranked[:n]))
