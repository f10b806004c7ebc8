"""Speaker identification data: manifest rows → (id, log-mel features, speaker index) → padded batches.

Each row names its speaker in `speaker`: a corpus folder's manifest has that column (LibriSpeech:
the first field of the id; an audiofolder: its speaker or speaker_id column), a `datasets` source's is read from --speaker_column_name
(`Config.EXTRA_COLUMNS`). The held-out utterances of the training voices are chosen by a hash of
their ids (`held_out`), so the split never depends on the order rows are read in.
"""

from __future__ import annotations

import hashlib

import torch

from common.data.loading import load_row_audio
from common.training.faults import UsageError
from common.model.features import LogMel


def held_out(utt_id: str, fraction: float) -> bool:
    """Whether an utterance is held out for validation: its id's hash falls in the first `fraction`
    of the hash range (a pure function of the id: the same utterances on every run and every rank)."""
    h = int.from_bytes(hashlib.blake2b(utt_id.encode(), digest_size=8).digest(), "big")
    return h < fraction * 2**64


class FeatureDataset(torch.utils.data.Dataset):
    """Manifest row → (id, log-mel (frames, n_mels) float32, speaker index in `speakers`):
    `dataset[i]`, or `item(row)` for a streamed row (`manifest` None). A row's audio is its `path`,
    or its `audio` cell (a `datasets` source, read undecoded)."""

    def __init__(self, manifest, sample_rate: int, n_mels: int, speakers: list[str]):
        self.manifest = manifest
        self.sample_rate = sample_rate
        self.logmel = LogMel(sample_rate, n_mels)
        self.speakers = speakers  # the training voices, sorted: the classifier's outputs in order
        self.index = {s: i for i, s in enumerate(speakers)}

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, i):
        return self.item(self.manifest[i])

    def item(self, row: dict):
        speaker = str(row["speaker"])
        if speaker not in self.index:
            raise UsageError(f"utterance {row['id']}: speaker {speaker} is not one of the {len(self.speakers)} "
                             f"training speakers: validate on held-out utterances of the training voices")
        return row["id"], self.logmel(load_row_audio(row, self.sample_rate)), self.index[speaker]


class PaddingCollator:
    """Pads a batch of (id, features, speaker) items; nothing random, so no epoch to set."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, items):
        s = self.cfg.stack_frames
        lens = torch.tensor([max(s, f.shape[0] // s * s) for _, f, _ in items])  # whole 40 ms positions only
        feats = torch.zeros(len(items), int(lens.max()), self.cfg.n_mels)  # (B, T, n_mels) raw log-mel
        for b, (_, f, _) in enumerate(items):
            n = min(int(lens[b]), f.shape[0])
            feats[b, :n] = f[:n]
        return dict(ids=[i for i, _, _ in items], feats=feats, feat_lens=lens,
                    speakers=torch.tensor([spk for _, _, spk in items]))
