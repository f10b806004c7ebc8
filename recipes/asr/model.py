"""Conformer-CTC: the encoder shared with BEST-RQ (`common.encoder`: a `transformers`
`Wav2Vec2BertModel` fed stacked log-mel frames) plus a linear CTC head; SpecAugment masks.

The parameter names are BEST-RQ's (`encoder.*`, buffers `feat_mean`, `feat_std`), so a BEST-RQ
`final/model.safetensors` loads into this model by name (`common.encoder.load_pretrained_encoder`).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from transformers import Wav2Vec2BertConfig

from common.encoder import StackedLogMelEncoder
from text import BLANK


class ConformerCTC(StackedLogMelEncoder):
    """The shared encoder (common/encoder.py: statistics, stacking, Conformer) + a linear CTC head."""

    def __init__(self, config: Wav2Vec2BertConfig, *, n_mels: int, stack_frames: int, vocab_size: int):
        super().__init__(config, n_mels=n_mels, stack_frames=stack_frames)
        self.head = nn.Linear(config.hidden_size, vocab_size)  # class 0 = CTC blank

    def forward(self, feats, feat_lens, time_mask=None, freq_mask=None):
        """feats: (B, T, n_mels) raw log-mel, T a multiple of `stack`; feat_lens: (B,) valid frames;
        time_mask: (B, T) and freq_mask: (B, n_mels) bool, SpecAugment (masked → 0 after normalization).
        Returns log-posteriors (B, T // stack, classes) in float32 and their valid lengths (B,)."""
        x = self.normalize(feats)
        if time_mask is not None:
            x = x.masked_fill(time_mask[:, :, None] | freq_mask[:, None, :], 0.0)
        hidden, out_lens = self.encode(x, feat_lens)  # (B, L, hidden), one frame per 40 ms
        return F.log_softmax(self.head(hidden).float(), dim=-1), out_lens


def ctc_loss(log_probs, out_lens, targets, target_lens):
    """CTC loss summed over the batch and divided by its target tokens: nats per output token.

    `zero_infinity`: an utterance too short for its transcript (e.g. sped up) contributes nothing."""
    loss = F.ctc_loss(log_probs.transpose(0, 1), targets, out_lens, target_lens, blank=BLANK,
                      reduction="sum", zero_infinity=True)
    return loss / target_lens.sum().clamp_min(1)
