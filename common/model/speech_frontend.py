"""The recipes' speech front end, self-contained (torch, torchaudio, numpy, transformers only).

Training uses `LogMel` from here (through `common.model.features`), and exported models carry a copy of
this very file next to their `preprocessor_config.json`, so `AutoFeatureExtractor.from_pretrained(
folder, trust_remote_code=True)` computes exactly the features the model was trained on:
80-dim log-mel (25 ms Hann window, 10 ms hop, no dither), normalized with the training set's global
mean/std, `stack_frames` consecutive frames stacked into one encoder frame (4 → 40 ms). The
tokenizer decodes CTC output as the recipe does: repeats merged, blanks dropped, and (unlike
`Wav2Vec2CTCTokenizer`) runs of spaces collapsed, as in the normalized references.
"""

from __future__ import annotations

import numpy as np
import torch
import torchaudio
from transformers import BatchFeature, SequenceFeatureExtractor, Wav2Vec2CTCTokenizer


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
        return self.differentiable(wav)

    def differentiable(self, wav: torch.Tensor) -> torch.Tensor:
        """The same features with gradients to `wav` (a vocoder's mel loss): (..., samples) → (..., frames, n_mels)."""
        return torch.log(self.mel(wav) + 1e-6).transpose(-1, -2)


class StackedLogMelFeatureExtractor(SequenceFeatureExtractor):
    """Raw 16 kHz mono audio → `input_features` (batch, frames / stack, stack × n_mels) and
    `attention_mask` (batch, frames / stack), as the recipes' encoder consumes them."""

    model_input_names = ["input_features", "attention_mask"]

    def __init__(self, feature_size: int = 80, sampling_rate: int = 16000, padding_value: float = 0.0,
                 stack_frames: int = 4, mean: list[float] | None = None, std: list[float] | None = None, **kwargs):
        super().__init__(feature_size=feature_size, sampling_rate=sampling_rate, padding_value=padding_value, **kwargs)
        self.stack_frames = stack_frames
        self.mean = list(mean) if mean is not None else [0.0] * feature_size
        self.std = list(std) if std is not None else [1.0] * feature_size
        self._logmel = None

    def to_dict(self):
        out = super().to_dict()
        out.pop("_logmel", None)
        return out

    def features(self, wav: torch.Tensor) -> torch.Tensor:
        """One waveform (samples,) float32 → normalized, stacked features (frames / stack, stack × n_mels)."""
        if self._logmel is None:
            self._logmel = LogMel(self.sampling_rate, self.feature_size)
        x = (self._logmel(wav) - torch.tensor(self.mean)) / torch.tensor(self.std)
        usable = x.shape[0] // self.stack_frames * self.stack_frames  # whole encoder frames only
        return x[:usable].reshape(-1, self.stack_frames * self.feature_size)

    def __call__(self, raw_speech, sampling_rate: int | None = None, return_tensors=None, **kwargs) -> BatchFeature:
        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ValueError(f"audio at {sampling_rate} Hz; this model takes {self.sampling_rate} Hz (resample first)")
        batched = isinstance(raw_speech, (list, tuple)) and not np.isscalar(raw_speech[0])
        if not batched:
            raw_speech = [raw_speech]
        feats = [self.features(torch.as_tensor(np.asarray(w, dtype=np.float32)).reshape(-1)) for w in raw_speech]
        longest = max(f.shape[0] for f in feats)
        out = torch.full((len(feats), longest, self.stack_frames * self.feature_size), self.padding_value)
        mask = torch.zeros(len(feats), longest, dtype=torch.long)
        for i, f in enumerate(feats):
            out[i, : f.shape[0]] = f
            mask[i, : f.shape[0]] = 1
        data = {"input_features": out, "attention_mask": mask}
        if return_tensors != "pt":
            data = {k: v.numpy() for k, v in data.items()}
        return BatchFeature(data, tensor_type=return_tensors)


class CharCTCTokenizer(Wav2Vec2CTCTokenizer):
    """`Wav2Vec2CTCTokenizer` whose text has single spaces ("a  b" → "a b"), like the recipe's decoding
    and its normalized references (character error rates count spaces)."""

    def convert_tokens_to_string(self, tokens, *args, **kwargs):
        out = super().convert_tokens_to_string(tokens, *args, **kwargs)
        out["text"] = " ".join(out["text"].split())
        return out
