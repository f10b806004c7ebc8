"""The TTS recipe's and the vocoder's mel (`mel_frontend`), mel → waveform without a neural vocoder
(Griffin-Lim, torchaudio's) and mel-cepstral distortion with DTW: what the TTS recipe vocodes and
scores with, and the baseline the vocoder recipe is measured against."""

from __future__ import annotations

import math

import numpy as np
import torch
import torchaudio

from common.model.speech_frontend import LogMel

# This file imports only torch, torchaudio, numpy and common/model/speech_frontend.py (transformers): a TTS
# export carries both, so that its final/ synthesizes without this repository.


def mel_frontend(sample_rate: int, n_mels: int, win_length: int, hop_length: int) -> LogMel:
    """The TTS recipe's and the vocoder's mel (one definition, so TTS output can be vocoded): waveform →
    natural-log power mel (frames, n_mels). 22.05 kHz, win 1024, hop 256 gives n_fft 1024 (next power
    of two ≥ window), HTK mel scale from 0 Hz to Nyquist, no filter norm, centred frames:
    samples // hop_length + 1 of them."""
    return LogMel(sample_rate, n_mels, win_ms=1000 * win_length / sample_rate, hop_ms=1000 * hop_length / sample_rate)


class GriffinLim(torch.nn.Module):
    """Log-mel → waveform: least-squares inverse of the mel filterbank, then Griffin-Lim phase
    recovery. Deterministic: the random initial phase comes from a fixed seed, drawn in a forked
    RNG so the caller's global RNG is untouched."""

    def __init__(self, frontend: LogMel, n_iter: int = 32, power: float = 1.0, seed: int = 0):
        super().__init__()
        mel = frontend.mel
        stft = mel.spectrogram
        self.inverse_mel = torchaudio.transforms.InverseMelScale(
            n_stft=stft.n_fft // 2 + 1, n_mels=mel.mel_scale.n_mels, sample_rate=mel.sample_rate,
            f_min=mel.f_min, f_max=mel.f_max, norm=mel.mel_scale.norm, mel_scale=mel.mel_scale.mel_scale)
        # `power` sharpens the magnitudes before phase recovery (1.0 = as predicted).
        self.power = power
        self.griffin_lim = torchaudio.transforms.GriffinLim(
            n_fft=stft.n_fft, n_iter=n_iter, win_length=stft.win_length, hop_length=stft.hop_length, power=1.0)
        self.seed = seed

    @torch.no_grad()
    def forward(self, logmel: torch.Tensor) -> torch.Tensor:
        """(frames, n_mels) natural-log power mel → (samples,) float32 in [-1, 1]."""
        power_mel = torch.exp(logmel.float()).T  # (n_mels, frames)
        magnitude = self.inverse_mel(power_mel).clamp_min(0).sqrt() ** self.power  # (n_stft, frames)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            wav = self.griffin_lim(magnitude)
        peak = wav.abs().max()
        return wav / peak * 0.95 if peak > 0.95 else wav


# ---------------------------------------------------------------------------------------------
# Mel-cepstral distortion
# ---------------------------------------------------------------------------------------------

MCD_CEPSTRA = 13  # c1..c13 (c0, the energy, excluded)
MCD_CONSTANT = 10.0 / math.log(10.0) * math.sqrt(2.0)  # dB


def mel_cepstra(logmel: np.ndarray, n: int = MCD_CEPSTRA) -> np.ndarray:
    """(frames, M) natural-log power mel → (frames, n) mel-cepstra c1..cn (c0, the energy, dropped).

    Cepstrum normalization of a real, even log spectrum on the mel-warped axis ω ∈ [0, π]:
    log A(ω) = c0 + 2 Σ_n c_n cos(nω), so c_n = (1/M) Σ_m log A_m cos(π n (m + ½) / M) — a DCT-II
    scaled by 1/M of the log mel *amplitude* log A = ½ log power. With this scaling
    (10 / ln 10) · sqrt(2 Σ Δc²) is the usual MCD (the RMS of the cepstrally smoothed log-spectral
    difference, in the convention of SPTK mel-cepstra).

    Ours rather than `torchaudio.functional.create_dct` (the same DCT-II, ×2M): torchaudio builds the
    basis in float32, and a constant log offset then leaks into c1..cn (2e-6 dB of MCD for a 3-nat
    offset, measured; float64 here: < 1e-9), so an MCD of 0 would not mean equal spectra."""
    m = logmel.shape[1]
    basis = np.cos(np.pi / m * (np.arange(m)[None, :] + 0.5) * np.arange(1, n + 1)[:, None]) / m  # (n, M)
    return (0.5 * logmel.astype(np.float64)) @ basis.T


def dtw_path(a: np.ndarray, b: np.ndarray) -> list[tuple[int, int]]:
    """Euclidean DTW (steps (1,0), (0,1), (1,1)) between (Ta, D) and (Tb, D); returns the path.

    Ours because neither torchaudio nor transformers has a DTW (librosa's would be a new dependency
    for these 20 lines); a few hundred frames per utterance take milliseconds."""
    cost = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))
    Ta, Tb = cost.shape
    acc = np.full((Ta + 1, Tb + 1), np.inf)
    acc[0, 0] = 0.0
    for i in range(1, Ta + 1):
        row, prev = acc[i], acc[i - 1]
        c = cost[i - 1]
        for j in range(1, Tb + 1):
            row[j] = c[j - 1] + min(prev[j - 1], prev[j], row[j - 1])
    path, i, j = [], Ta, Tb
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        step = np.argmin([acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]])
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    return path[::-1]


def mcd_dtw(pred_logmel: np.ndarray, ref_logmel: np.ndarray) -> float:
    """MCD (dB) = (10 / ln 10) · sqrt(2 · Σ_d (Δc_d)²), averaged over the DTW-aligned frame pairs."""
    a, b = mel_cepstra(pred_logmel), mel_cepstra(ref_logmel)
    path = dtw_path(a, b)
    ia, ib = np.array(path).T
    return float(np.mean(MCD_CONSTANT * np.sqrt(((a[ia] - b[ib]) ** 2).sum(-1))))
