"""BEST-RQ data: manifest rows → log-mel features → padded batches with their masks and noise.

Every random draw (mask spans, noise) comes from `sample_generator(seed, epoch, utterance id)`, so
neither the number of workers nor sharding nor a mid-epoch resume can change it.
"""

from __future__ import annotations

import torch

from common.data.loading import load_row_audio, sample_generator
from common.model.features import LogMel


class FeatureDataset(torch.utils.data.Dataset):
    """Manifest row → (id, log-mel (frames, n_mels) float32): `dataset[i]`, or `item(row)` for a
    streamed row (`manifest` None). A row's audio is its `path`, or its `audio` cell (a `datasets`
    source, read undecoded)."""

    def __init__(self, manifest, sample_rate: int, n_mels: int):
        self.manifest = manifest
        self.sample_rate = sample_rate
        self.logmel = LogMel(sample_rate, n_mels)

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, i):
        return self.item(self.manifest[i])

    def item(self, row: dict):
        return row["id"], self.logmel(load_row_audio(row, self.sample_rate))


class MaskingCollator:
    """Pads a batch and draws its masks and noise from (seed, epoch, utterance id) alone."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.span = max(1, round(cfg.mask_span_ms / (10 * cfg.stack_frames)))  # in 40 ms positions
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, items):
        s = self.cfg.stack_frames
        lens = torch.tensor([f.shape[0] // s * s for _, f in items])  # whole 40 ms positions only
        T = int(lens.max())
        feats = torch.zeros(len(items), T, self.cfg.n_mels)  # (B, T, n_mels) raw log-mel, 10 ms frames
        noise = torch.zeros_like(feats)
        mask = torch.zeros(len(items), T // s, dtype=torch.bool)  # (B, T // s) masked 40 ms positions
        for b, (utt_id, f) in enumerate(items):
            n = int(lens[b])
            g = sample_generator(self.cfg.seed, self.epoch, utt_id)
            feats[b, :n] = f[:n]
            mask[b, : n // s] = span_mask(n // s, self.cfg.mask_prob, self.span, g)
            noise[b, :n] = torch.randn(n, self.cfg.n_mels, generator=g) * self.cfg.noise_std
        return dict(ids=[i for i, _ in items], feats=feats, feat_lens=lens, mask=mask, noise=noise)


def span_mask(num_positions: int, start_prob: float, span: int, generator: torch.Generator) -> torch.Tensor:
    """(num_positions,) bool: each position starts a masked span of `span` with `start_prob`.

    At least one position is masked, so every utterance contributes to the loss.
    """
    starts = torch.rand(num_positions, generator=generator) < start_prob
    if not starts.any():
        starts[torch.randint(num_positions, (1,), generator=generator)] = True
    # position i is masked iff a span started in (i - span, i]
    c = torch.cumsum(starts.long(), 0)
    shifted = torch.cat([torch.zeros(span, dtype=torch.long), c])[:num_positions]
    return (c - shifted) > 0
