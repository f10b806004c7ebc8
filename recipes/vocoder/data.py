"""Vocoder data: whole utterances (waveforms) from the manifest, and a collator that cuts one random
segment per utterance and computes its log-mel (the TTS recipe's mel, `common.model.features.mel_frontend`);
the same mel for the losses and the validation (`loss_frontend`, `extra_mel_frontends`).

The segment's start is drawn from `sample_generator(seed, epoch, utterance id)`: a pure function of
the position in training, so a resumed run cuts the same segments (and the RAM cache keeps whole
waveforms, never a segment)."""

from __future__ import annotations

import functools

import torch

from common.data.loading import load_row_audio, sample_generator
from common.model.features import mel_frontend


class Waveforms(torch.utils.data.Dataset):
    """Manifest row → (id, waveform (samples,) at the recipe's sample rate): `dataset[i]`, or
    `item(row)` for any row (a streamed one: `manifest` None). A row's audio is its `path`, or its
    `audio` cell (a `datasets` source's)."""

    def __init__(self, manifest, sample_rate: int):
        self.manifest, self.sample_rate = manifest, sample_rate

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, i):
        return self.item(self.manifest[i])

    def item(self, row: dict):
        return row["id"], load_row_audio(row, self.sample_rate)


class SegmentCollator:
    """Items → {ids, wavs (B, segment_frames · hop), mels (B, segment_frames + 1, n_mels)}: one random
    segment of `segment_frames` mel frames per utterance (zero-padded when the utterance is shorter)."""

    def __init__(self, cfg):
        self.seed, self.epoch = cfg.seed, 0
        self.samples = cfg.segment_frames * cfg.hop_length
        self.hop = cfg.hop_length
        self.logmel = mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, items):
        wavs = torch.zeros(len(items), self.samples)
        for b, (utt_id, wav) in enumerate(items):
            hops = max(0, len(wav) - self.samples) // self.hop  # segments start on a hop (frames align)
            start = self.hop * int(torch.randint(hops + 1, (), generator=sample_generator(self.seed, self.epoch, utt_id)))
            piece = wav[start: start + self.samples]
            wavs[b, : len(piece)] = piece
        return {"ids": [i for i, _ in items], "wavs": wavs, "mels": self.logmel(wavs)}


def collate_whole(items):
    """Validation: whole utterances, unpadded (the generator takes each as it is)."""
    return {"ids": [i for i, _ in items], "wavs": [w for _, w in items]}


def loss_frontend(cfg, device):
    """The mel of the losses and the validation (`mel_frontend`), made once per device."""
    return _frontends(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length, torch.device(device))


@functools.lru_cache(maxsize=16)  # the input mel, --mel_resolutions', on each device: never rebuilt per step
def _frontends(sample_rate: int, n_mels: int, win_length: int, hop_length: int, device):
    return mel_frontend(sample_rate, n_mels, win_length, hop_length).to(device)


def extra_mel_frontends(cfg, device) -> list:
    """The --mel_resolutions mels: window w samples, hop w / 4, n_mels × w / win_length bins."""
    return [_frontends(cfg.sample_rate, max(8, cfg.n_mels * w // cfg.win_length), w, w // 4, torch.device(device))
            for w in cfg.mel_resolutions]
