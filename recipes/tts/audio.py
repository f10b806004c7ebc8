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
