"""Log-mel front end and global feature statistics."""

from __future__ import annotations

import torch
import torchaudio
from accelerate.utils import broadcast


class LogMel(torch.nn.Module):
    """Waveform (samples,) → log-mel (frames, n_mels); 25 ms Hann window, 10 ms hop by default.

    Deterministic (no dither), so features are a pure function of the audio.
    """

    def __init__(self, sample_rate: int = 16000, n_mels: int = 80, win_ms: float = 25.0, hop_ms: float = 10.0):
        super().__init__()
        win = int(round(sample_rate * win_ms / 1000))
        self.hop = int(round(sample_rate * hop_ms / 1000))
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=sample_rate,
            n_fft=1 << (win - 1).bit_length(),  # next power of two ≥ window (512 at 16 kHz)
            win_length=win,
            hop_length=self.hop,
            n_mels=n_mels,
            power=2.0,
        )

    @torch.no_grad()
    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return torch.log(self.mel(wav) + 1e-6).transpose(-1, -2)  # (frames, n_mels)


def feature_stats(features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std over all frames of `features` (each (frames, dim)), in float64."""
    total = sum(f.shape[0] for f in features)
    s = sum(f.double().sum(0) for f in features)
    s2 = sum((f.double() ** 2).sum(0) for f in features)
    mean = s / total
    std = (s2 / total - mean**2).clamp_min(1e-10).sqrt()
    return mean.float(), std.float()


def shared_feature_stats(accelerator, compute) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `compute()` → (mean, std) on the main process only and broadcast the result.

    Collective: every rank must call it. Statistics that differ per rank (each rank normalizing
    with its own shard's stats) were a real bug in other toolkits; here there is one copy.
    """
    mean_std = torch.zeros(2, 0)
    if accelerator.is_main_process:
        mean, std = compute()
        mean_std = torch.stack([mean, std])
    if accelerator.num_processes > 1:
        dim = torch.tensor([mean_std.shape[1]], device=accelerator.device)
        dim = broadcast(dim, from_process=0)
        if not accelerator.is_main_process:
            mean_std = torch.zeros(2, int(dim.item()))
        mean_std = broadcast(mean_std.to(accelerator.device), from_process=0).cpu()
    return mean_std[0], mean_std[1]


def set_feature_stats(accelerator, model, compute) -> None:
    """Fill `model`'s `feat_mean`/`feat_std` buffers with `shared_feature_stats(accelerator, compute)`.

    Collective: every rank must call it (at the start of a fresh run; a resumed run loads them)."""
    mean, std = shared_feature_stats(accelerator, compute)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.feat_mean.copy_(mean)
    unwrapped.feat_std.copy_(std)
