"""Audio side of the TTS recipe: the log-mel front end, the Griffin-Lim vocoder and mel-cepstral distortion
with DTW (common/model/vocoding.py, shared with the vocoder recipe), and spectrogram pictures (PNG files through Pillow)."""

from __future__ import annotations

import numpy as np
import torch

from common.model.vocoding import (GriffinLim, MCD_CEPSTRA, MCD_CONSTANT, dtw_path, mcd_dtw, mel_cepstra,  # noqa: F401 — the recipe's
                             mel_frontend)


# ---------------------------------------------------------------------------------------------
# Pictures: tensors for TensorBoard, and PNG files
# ---------------------------------------------------------------------------------------------


def to_image(x: torch.Tensor, lo: float | None = None, hi: float | None = None) -> np.ndarray:
    """(frames, bins) → (bins, frames) uint8, low bins at the bottom, scaled to [lo, hi]."""
    x = x.detach().float().cpu().T.flip(0).numpy()
    lo = float(x.min()) if lo is None else lo
    hi = float(x.max()) if hi is None else hi
    return (np.clip((x - lo) / max(hi - lo, 1e-8), 0, 1) * 255).astype(np.uint8)


def stack_images(images: list[np.ndarray], gap: int = 2) -> np.ndarray:
    """Stack (H_i, W_i) uint8 images vertically, right-padded to the widest, with white gaps."""
    width = max(im.shape[1] for im in images)
    rows = []
    for im in images:
        rows.append(np.pad(im, ((0, 0), (0, width - im.shape[1]))))
        rows.append(np.full((gap, width), 255, np.uint8))
    return np.concatenate(rows[:-1])


def write_png(path, image: np.ndarray) -> None:
    """Write an (H, W) uint8 grayscale image as a PNG."""
    from PIL import Image  # lazy: only score.py writes pictures

    if image.ndim != 2 or image.dtype != np.uint8:
        raise ValueError(f"write_png wants an (H, W) uint8 image, got {image.shape} {image.dtype}")
    Image.fromarray(image).save(path, format="PNG")


def make_vocoder(cfg, n_iter: int, power: float = 1.0) -> "GriffinLim":
    """Griffin-Lim for the mel front end of a TTS config (the dataclass or a namespace)."""
    return GriffinLim(mel_frontend(cfg.sample_rate, cfg.n_mels, cfg.win_length, cfg.hop_length), n_iter, power)


# ---------------------------------------------------------------------------------------------
# Pitch: the fundamental frequency of each mel frame, for the model's pitch conditioning
# ---------------------------------------------------------------------------------------------


def pitch_track(wave: torch.Tensor, sample_rate: int, win_length: int, hop_length: int, fmin: float = 60.0,
                fmax: float = 500.0, threshold: float = 0.15, silence_db: float = 40.0) -> torch.Tensor:
    """YIN (de Cheveigné & Kawahara 2002) on the mel's frames: wave (samples,) → (samples // hop + 1,) F0
    in Hz, 0 where unvoiced. Frames are centred as the mel's (`mel_frontend`), `win_length` samples long.
    A frame is voiced when its cumulative-mean-normalized difference dips under `threshold` at a lag
    within [1/fmax, 1/fmin] (the first dip, refined to its local minimum and by a parabola) and its
    energy is within `silence_db` of the loudest frame's."""
    wave = wave.double()
    tau_max = min(int(sample_rate / fmin), win_length // 2)
    tau_min = max(int(sample_rate / fmax), 2)
    width = win_length - tau_max  # the integration window
    frames = torch.nn.functional.pad(wave[None, None], (win_length // 2, win_length // 2), mode="reflect")[0, 0]
    frames = frames.unfold(0, win_length, hop_length)  # (T, win_length)
    n = 1 << (win_length + width - 1).bit_length()
    # d(τ) = Σ_j (x_j − x_{j+τ})², j < width: the energies of both windows minus twice their cross-correlation
    xcorr = torch.fft.irfft(torch.fft.rfft(frames, n) * torch.fft.rfft(frames[:, :width], n).conj(), n)[:, : tau_max + 1]
    sq = torch.nn.functional.pad(frames.pow(2).cumsum(1), (1, 0))
    energy = sq[:, width : width + tau_max + 1] - sq[:, : tau_max + 1]  # Σ x_{j+τ}², j < width
    diff = (energy[:, :1] + energy - 2 * xcorr).clamp_min(0)
    cmnd = diff[:, 1:] * torch.arange(1, tau_max + 1) / diff[:, 1:].cumsum(1).clamp_min(1e-12)  # d'(τ), τ ≥ 1
    cmnd = torch.cat([torch.ones_like(cmnd[:, :1]), cmnd], 1)
    below = cmnd[:, tau_min:] < threshold
    tau = below.double().argmax(1) + tau_min  # the first lag under the threshold
    while True:  # walk down to that dip's minimum
        nxt = (tau + 1).clamp_max(tau_max)
        step = (cmnd.gather(1, nxt[:, None]) < cmnd.gather(1, tau[:, None]))[:, 0] & (tau < tau_max)
        if not step.any():
            break
        tau = tau + step.long()
    lo, hi = (tau - 1).clamp_min(1), (tau + 1).clamp_max(tau_max)
    a, b, c = (cmnd.gather(1, t[:, None])[:, 0] for t in (lo, tau, hi))
    shift = (0.5 * (a - c) / (a - 2 * b + c)).nan_to_num(0.0).clamp(-1, 1)
    f0 = sample_rate / (tau.double() + shift)
    loud = frames.pow(2).mean(1)
    voiced = below.any(1) & (10 * torch.log10(loud.clamp_min(1e-20) / loud.max().clamp_min(1e-20)) > -silence_db)
    return (f0 * voiced).float()
