"""TTS data: the dataset (symbol ids, log-mel) and the collator (padding, beta-binomial alignment
prior); the train/validation/test split is `common.data.manifest.split_manifest`."""

from __future__ import annotations

import torch

from common.data.loading import load_row_audio
from audio import mel_frontend
from frontend import Symbols
from model import NEG, beta_binomial_prior


class TTSDataset(torch.utils.data.Dataset):
    """Manifest row → (id, symbol ids (N,), log-mel (frames, n_mels)): `dataset[i]`, or `item(row)`
    for any row (a streamed one: `manifest` None). A row's audio is its `path`, or its `audio` cell
    (a `datasets` source's)."""

    def __init__(self, manifest, cfg):
        self.manifest = manifest
        self.symbols = Symbols.from_config(cfg)
        # once per manifest: phonemizing is not free (a streamed row is encoded when it is read)
        self.tokens = None if manifest is None else [self.symbols.encode(t) for t in manifest["text"]]
        self.sample_rate = cfg.sample_rate
        self.logmel = mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length)

    def __len__(self):
        return len(self.manifest)

    def __getitem__(self, i):
        return self.item(self.manifest[i], self.tokens[i])

    def item(self, row: dict, tokens: list[int] | None = None):
        tokens = torch.tensor(self.symbols.encode(row["text"]) if tokens is None else tokens)
        mel = self.logmel(load_row_audio(row, self.sample_rate))
        if mel.shape[0] < len(tokens):
            raise ValueError(f"{row['id']}: {mel.shape[0]} frames cannot hold {len(tokens)} symbols")
        return row["id"], tokens, mel


class Collator:
    """Pads a batch and adds the static beta-binomial prior (log) of each (frames, symbols) pair."""

    def __init__(self, cfg):
        self.scaling = cfg.prior_scaling
        self.cache: dict[tuple[int, int], torch.Tensor] = {}

    def log_prior(self, T: int, N: int) -> torch.Tensor:
        if (T, N) not in self.cache:
            self.cache[(T, N)] = torch.log(beta_binomial_prior(T, N, self.scaling) + 1e-8)
        return self.cache[(T, N)]

    def __call__(self, items):
        text_lens = torch.tensor([len(t) for _, t, _ in items])
        mel_lens = torch.tensor([m.shape[0] for _, _, m in items])
        B, N, T = len(items), int(text_lens.max()), int(mel_lens.max())
        tokens = torch.zeros(B, N, dtype=torch.long)
        mels = torch.zeros(B, T, items[0][2].shape[1])
        log_prior = torch.full((B, T, N), NEG)
        for b, (_, t, m) in enumerate(items):
            tokens[b, : len(t)] = t
            mels[b, : m.shape[0]] = m
            log_prior[b, : m.shape[0], : len(t)] = self.log_prior(m.shape[0], len(t))
        return dict(ids=[i for i, _, _ in items], tokens=tokens, text_lens=text_lens, mels=mels,
                    mel_lens=mel_lens, log_prior=log_prior)
