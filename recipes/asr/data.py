"""ASR data: utterance manifests (LibriSpeech layout or `datasets.save_to_disk`), the dataset
(log-mel, speed perturbation, tokens) and the collator that draws SpecAugment masks.

Manifests — `read_split(data_dir, split)`:
- if `<data_dir>/<split>/state.json` exists, it is a `datasets.Dataset.save_to_disk` folder (what
  `DatasetDict.save_to_disk(data_dir)` writes for each split) loaded with `datasets.load_from_disk`.
  Columns: `text` (the transcript), and the audio as either `path` (an audio file soundfile reads)
  or `audio` (a `datasets.Audio` column, read undecoded from its bytes or path; or a plain struct
  {`array`, `sampling_rate`}). Optional: `id` (default: the row number, zero-padded) and
  `duration` (seconds; default: read from the audio headers once). Other columns are ignored.
- if `<data_dir>/<split>/metadata.csv` (or metadata.jsonl) exists, it is an audiofolder (`datasets`'
  convention: a header line naming file_name, text or transcription, optionally speaker;
  `common.data.manifest.scan_audiofolder`);
- otherwise it is LibriSpeech layout (`common.data.manifest.read_librispeech`); several splits may be
  joined with commas (train-clean-100,train-clean-360).
Utterances whose transcript is empty after normalization are left out (CTC and WER need text).

With a transformers encoder (--init_from a `save_pretrained` folder: model.HFEncoderCTC) an item
holds that model's own feature extractor's output instead of log-mel (`StockFrontend`: the
waveform normalized per utterance, or w2v-BERT's stacked fbank), padded by `PaddingCollator`; its
SpecAugment is the model's own (--mask_time_prob), drawn in the model.

Every random draw (speed factor, SpecAugment) comes from `sample_generator(seed, epoch, utterance
id)`, so neither the number of workers nor sharding nor a mid-epoch resume can change it.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import datasets
import soundfile as sf
import torch

from common.data.loading import load_audio, resample, sample_generator
from common.training.distributed import derive_seed
from common.model.features import LogMel
from common.data.manifest import read_corpus
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
    return resample(wav, sr, sample_rate)


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


def read_split(data_dir: str | Path, split: str, read_folder=read_corpus) -> datasets.Dataset:
    """Manifest with at least `id`, `text` (raw), `duration` (s) and `path` or `audio`; see above.
    `read_folder(data_dir, split)` reads the LibriSpeech layout or an audiofolder (train.py passes the
    checked `common.data.manifest.prepare_manifest`)."""
    folder = Path(data_dir) / split
    return transcribed(read_hf_split(folder) if (folder / "state.json").is_file() else read_folder(data_dir, split), split)


def transcribed(ds: datasets.Dataset, split: str) -> datasets.Dataset:
    """`ds` without the utterances whose transcript has no letters (logged)."""
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


def fixed_subset(ds: datasets.Dataset, ids_file: Path) -> datasets.Dataset:
    """The utterances listed in `ids_file` (one id per line, `#` comments); ValueError naming the
    missing ones if the manifest lacks any."""
    wanted = {line.strip() for line in Path(ids_file).read_text().splitlines()} - {""}
    wanted = {i for i in wanted if not i.startswith("#")}
    ids = ds["id"]
    missing = wanted - set(ids)
    if missing:
        raise ValueError(f"{len(missing)} of its {len(wanted)} utterance ids are missing (e.g. {min(missing)})")
    return ds.select([i for i, utt_id in enumerate(ids) if utt_id in wanted])


class StockFrontend:
    """A transformers model's own feature extractor on one waveform (samples,) at its rate: (samples,)
    for wav2vec 2.0/HuBERT/WavLM (zero-mean unit-variance when its config says do_normalize), or
    (frames, 160) for w2v-BERT (80 fbank bins, 2 frames stacked, per-bin normalized): exactly what
    `pipeline("automatic-speech-recognition")` gives the exported model for that audio."""

    def __init__(self, frontend: dict):
        from common.model.hf_encoder import feature_extractor

        self.fe = feature_extractor(frontend)
        self.name = self.fe.model_input_names[0]

    def __call__(self, wav: torch.Tensor) -> torch.Tensor:
        out = self.fe(wav.numpy(), sampling_rate=self.fe.sampling_rate, return_attention_mask=True, return_tensors="pt")
        return out[self.name][0][: int(out["attention_mask"][0].sum())]  # its valid part (w2v-BERT pads odd frames)


class SpeechDataset(torch.utils.data.Dataset):
    """Manifest row → (id, log-mel (frames, n_mels), token ids, normalized transcript): `dataset[i]`,
    or `item(row)` for a streamed row (`manifest` None). With `frontend` (a transformers encoder's
    record, common/model/hf_encoder.py) its feature extractor's output in place of log-mel.

    Speed perturbation (resampling: tempo and pitch, as in Kaldi) is drawn from (seed, epoch, id)."""

    def __init__(self, manifest, cfg, tokenizer, speed_perturb: float = 0.0, frontend: dict | None = None):
        self.manifest, self.cfg, self.tokenizer, self.speed_perturb = manifest, cfg, tokenizer, speed_perturb
        self.ids = list(manifest["id"]) if manifest is not None else []  # read once: a manifest row costs ~0.1 ms, cache_key runs per item
        self.logmel = LogMel(cfg.sample_rate, cfg.n_mels) if frontend is None else StockFrontend(frontend)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def speed_factor(self, utt_id: str) -> float:
        if not self.speed_perturb:
            return 1.0
        g = sample_generator(self.cfg.seed, self.epoch, f"{utt_id}/speed")
        return (1 - self.speed_perturb, 1.0, 1 + self.speed_perturb)[int(torch.randint(3, (1,), generator=g))]

    def cache_key(self, i: int) -> tuple[int, float]:
        """An item depends on the epoch only through its speed factor: kept per (index, factor)."""
        return i, self.speed_factor(self.ids[i])

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, i):
        return self.item(self.manifest[i])

    def item(self, row: dict):
        wav = load_wav(row, self.cfg.sample_rate)
        factor = self.speed_factor(row["id"])
        if factor != 1.0:  # played `factor` times faster: fewer samples
            sr = self.cfg.sample_rate
            wav = resample(wav, round(sr * factor), sr)
        return row["id"], self.logmel(wav), self.tokenizer.encode(row["text"]), self.tokenizer.normalize(row["text"])


class SpecAugmentCollator:
    """Pads a batch and draws its SpecAugment masks from (seed, epoch, utterance id) alone."""

    def __init__(self, cfg, augment: bool):
        self.cfg, self.augment = cfg, augment
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, items):
        c, s = self.cfg, self.cfg.stack_frames
        lens = torch.tensor([f.shape[0] // s * s for _, f, _, _ in items])  # whole 40 ms frames only
        T = max(int(lens.max()), s)
        feats = torch.zeros(len(items), T, c.n_mels)
        time_mask = torch.zeros(len(items), T, dtype=torch.bool)
        freq_mask = torch.zeros(len(items), c.n_mels, dtype=torch.bool)
        for b, (utt_id, f, _, _) in enumerate(items):
            n = int(lens[b])
            feats[b, :n] = f[:n]
            if self.augment:
                g = sample_generator(c.seed, self.epoch, utt_id)
                time_mask[b, :n], freq_mask[b] = spec_augment_masks(
                    n, c.n_mels, g, freq_masks=c.freq_masks, freq_mask_width=c.freq_mask_width,
                    time_masks=c.time_masks, time_mask_width=c.time_mask_width, time_mask_ratio=c.time_mask_ratio)
        return dict(ids=[i for i, _, _, _ in items], feats=feats, feat_lens=lens, time_mask=time_mask,
                    freq_mask=freq_mask, targets=torch.tensor([t for _, _, tok, _ in items for t in tok], dtype=torch.long),
                    target_lens=torch.tensor([len(tok) for _, _, tok, _ in items]), texts=[t for *_, t in items])


class PaddingCollator:
    """Pads a batch of a transformers front end's items with zeros (its feature extractors' padding
    value): feats (B, samples) or (B, frames, dim) and their valid lengths; no masks (the model draws its own)."""

    def __call__(self, items):
        lens = torch.tensor([f.shape[0] for _, f, _, _ in items])
        feats = torch.zeros(len(items), int(lens.max()), *items[0][1].shape[1:])
        for b, (_, f, _, _) in enumerate(items):
            feats[b, : f.shape[0]] = f
        return dict(ids=[i for i, _, _, _ in items], feats=feats, feat_lens=lens,
                    targets=torch.tensor([t for _, _, tok, _ in items for t in tok], dtype=torch.long),
                    target_lens=torch.tensor([len(tok) for _, _, tok, _ in items]), texts=[t for *_, t in items])


def spec_augment_masks(frames: int, n_mels: int, generator: torch.Generator, *, freq_masks: int,
                       freq_mask_width: int, time_masks: int, time_mask_width: int, time_mask_ratio: float):
    """SpecAugment (Park et al. 2019) masks for one utterance, drawn from `generator` only.

    `freq_masks` bands of U[0, freq_mask_width] mel bins and `time_masks` spans of
    U[0, min(time_mask_width, time_mask_ratio · frames)] frames. Returns (frames,), (n_mels,) bool."""
    time_mask = torch.zeros(frames, dtype=torch.bool)
    freq_mask = torch.zeros(n_mels, dtype=torch.bool)
    for _ in range(freq_masks):
        w = int(torch.randint(0, freq_mask_width + 1, (1,), generator=generator))
        f0 = int(torch.randint(0, max(1, n_mels - w + 1), (1,), generator=generator))
        freq_mask[f0 : f0 + w] = True
    max_t = min(time_mask_width, int(time_mask_ratio * frames))
    for _ in range(time_masks):
        w = int(torch.randint(0, max_t + 1, (1,), generator=generator))
        t0 = int(torch.randint(0, max(1, frames - w + 1), (1,), generator=generator))
        time_mask[t0 : t0 + w] = True
    return time_mask, freq_mask
