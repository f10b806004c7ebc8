"""Speaker identification: the shared encoder (common/model/encoder.py, a `transformers` Wav2Vec2BertModel fed
stacked, globally normalized log-mel frames), its outputs averaged over each utterance's valid frames,
and a linear layer over the training speakers; utterance-level cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Wav2Vec2BertConfig

from common.model.encoder import StackedLogMelEncoder


class SpeakerClassifier(StackedLogMelEncoder):
    """The shared encoder (statistics, stacking, Conformer) + mean pooling + a linear speaker head."""

    def __init__(self, config: Wav2Vec2BertConfig, *, n_mels: int, stack_frames: int, num_speakers: int):
        super().__init__(config, n_mels=n_mels, stack_frames=stack_frames)
        self.head = nn.Linear(config.hidden_size, num_speakers)

    def logits(self, feats, feat_lens):
        """feats: (B, T, n_mels) raw log-mel, T a multiple of `stack`; feat_lens: (B,) valid frames.
        Returns the speaker logits (B, num_speakers) (predict.py turns them into probabilities)."""
        hidden, out_lens = self.encode(self.normalize(feats), feat_lens)  # (B, L, hidden)
        valid = (torch.arange(hidden.shape[1], device=feats.device)[None, :] < out_lens[:, None]).unsqueeze(-1)
        pooled = torch.where(valid, hidden, 0).sum(1) / out_lens.clamp(min=1)[:, None].to(hidden.dtype)  # (B, hidden)
        return self.head(pooled)

    def forward(self, feats, feat_lens, speakers):
        """`logits`' inputs and speakers: (B,) speaker indices. Returns (loss: mean CE over the
        utterances, accuracy, the number of utterances, the predicted speakers (B,))."""
        logits = self.logits(feats, feat_lens)  # (B, num_speakers)
        loss = F.cross_entropy(logits.float(), speakers)
        pred = logits.argmax(-1)
        return loss, (pred == speakers).float().mean(), torch.tensor(len(speakers), device=feats.device), pred


@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict:
    """Loss and accuracy over the held-out utterances (each once, over all processes).
    Collective: call on every rank."""
    model.eval()
    totals = torch.zeros(3, device=accelerator.device)  # Σ loss·n, Σ acc·n, Σ n
    for batch in loader:
        loss, acc, n, _ = model(batch["feats"], batch["feat_lens"], batch["speakers"])
        totals += torch.stack([loss * n, acc * n, n.float()])
    totals = accelerator.reduce(totals, "sum")
    model.train()
    return {"eval_loss": (totals[0] / totals[2]).item(), "eval_acc": (totals[1] / totals[2]).item()}
