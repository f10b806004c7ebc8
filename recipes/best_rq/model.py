"""BEST-RQ: masked prediction of random-projection-quantized speech (Chiu et al., 2022, arXiv:2202.01855).

The encoder is `common.model.encoder.StackedLogMelEncoder`: a `transformers` `Wav2Vec2BertModel` (a
Conformer) fed stacked, globally normalized log-mel frames, so the pre-trained encoder loads with
`Wav2Vec2BertModel.from_pretrained(<output_dir>/final/encoder)` and the ASR recipe can fine-tune it. Stacking 4 × 10 ms frames gives the 4× time reduction: one encoder
frame, and one BEST-RQ label, per 40 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Wav2Vec2BertConfig

from common.model.encoder import StackedLogMelEncoder


class RandomProjectionQuantizer(nn.Module):
    """Frozen random projection (Xavier) + frozen codebook (standard normal); label = nearest code.

    Both are built from their own seed, never from the global RNG, and live in buffers: identical on
    every rank, saved with every checkpoint, and so identical across resumes. (SpeechBrain once
    shipped a BEST-RQ whose quantizer differed per GPU.)
    """

    def __init__(self, input_dim: int, code_dim: int = 16, codebook_size: int = 8192, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        projection = torch.empty(input_dim, code_dim)
        nn.init.xavier_uniform_(projection, generator=g)
        codebook = torch.randn(codebook_size, code_dim, generator=g)
        self.register_buffer("projection", projection)  # (input_dim, code_dim)
        self.register_buffer("codebook", F.normalize(codebook, dim=-1))  # (codebook_size, code_dim), unit rows

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """(..., input_dim) → unit-norm (..., code_dim), in float32 also under autocast."""
        with torch.autocast(x.device.type, enabled=False):
            return F.normalize(x.float() @ self.projection, dim=-1)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., input_dim) → labels (...) in [0, codebook_size).

        On the unit sphere the nearest code in l2 distance is the one with the largest dot product.
        Computed in float32 even in a bf16/fp16 run: autocast would run both products in half
        precision and change ~3 % of the labels (8192 codes), so the targets would depend on the
        run's precision.
        """
        with torch.autocast(x.device.type, enabled=False):
            return (self.project(x) @ self.codebook.T).argmax(dim=-1)


def utterance_normalize(feats: torch.Tensor, feat_lens: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """(B, T, n_mels) → each utterance's bins to zero mean, unit variance over its valid frames
    (padding ignored; padded frames come out as garbage the loss never reads). Float32."""
    with torch.autocast(feats.device.type, enabled=False):
        x = feats.float()
        valid = (torch.arange(x.shape[1], device=x.device)[None, :] < feat_lens[:, None]).unsqueeze(-1)  # (B, T, 1)
        n = feat_lens.clamp(min=1).to(x.dtype)[:, None, None]
        mean = torch.where(valid, x, 0).sum(1, keepdim=True) / n  # (B, 1, n_mels)
        var = torch.where(valid, (x - mean) ** 2, 0).sum(1, keepdim=True) / n
        return (x - mean) / torch.sqrt(var + eps)


class BestRQ(StackedLogMelEncoder):
    """The shared encoder (common/model/encoder.py: statistics, stacking, Conformer) + quantizer + head."""

    def __init__(self, config: Wav2Vec2BertConfig, *, n_mels: int, stack_frames: int,
                 codebook_size: int, code_dim: int, quantizer_seed: int, label_norm: str = "global"):
        super().__init__(config, n_mels=n_mels, stack_frames=stack_frames)
        self.label_norm = label_norm  # what the quantizer sees: "global" or "utterance" statistics
        self.quantizer = RandomProjectionQuantizer(n_mels * stack_frames, code_dim, codebook_size, quantizer_seed)
        self.head = nn.Linear(config.hidden_size, codebook_size)

    def forward(self, feats, feat_lens, mask, noise):
        """Masked-prediction loss.

        feats: (B, T, n_mels) raw log-mel, T a multiple of `stack`; feat_lens: (B,) valid frames;
        mask: (B, T // stack) bool, masked 40 ms positions; noise: (B, T, n_mels) ~ N(0, σ²).
        Returns (loss: mean CE over masked positions, accuracy, number of masked positions, the
        predicted codes and the labels of the masked positions, each (n_masked,)).
        """
        B, T, D = feats.shape
        x = self.normalize(feats)
        # Labels from the clean input; per-utterance statistics take level, channel and stationary
        # noise out of them (the encoder still gets the global ones: the contract with ASR/export).
        q = utterance_normalize(feats, feat_lens) if self.label_norm == "utterance" else x
        labels = self.quantizer(q.reshape(B, T // self.stack, self.stack * D))  # (B, L)
        frame_mask = mask.repeat_interleave(self.stack, dim=1).unsqueeze(-1)  # (B, T, 1)
        hidden, out_lens = self.encode(torch.where(frame_mask, noise, x), feat_lens)  # (B, L, hidden)
        valid = torch.arange(hidden.shape[1], device=feats.device)[None, :] < out_lens[:, None]
        sel = mask & valid
        logits = self.head(hidden[sel])  # (n_masked, codebook_size)
        target = labels[sel]
        loss = F.cross_entropy(logits.float(), target)
        pred = logits.argmax(-1)
        acc = (pred == target).float().mean()
        return loss, acc, sel.sum(), pred, target


@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict:
    """Masked-prediction loss and accuracy on the validation set (each utterance once), codebook
    usage: the fraction of codes ever predicted and the perplexity of the predicted-code distribution
    (a collapsed model predicts few codes), and `eval_label_entropy` (nats): the entropy of the masked
    positions' labels, i.e. the loss of a model that predicts their frequencies and has learned
    nothing from the audio; `eval_loss` below it is what pre-training learned (a plug-in estimate:
    low by about (codes seen − 1) / (2 · masked positions) nats on a small validation set).
    Collective: call on every rank."""
    model.eval()
    totals = torch.zeros(3, device=accelerator.device)  # Σ loss·n, Σ acc·n, Σ n
    counts = None  # (2, codebook_size): predictions, labels per code
    for batch in loader:
        loss, acc, n, pred, target = model(batch["feats"], batch["feat_lens"], batch["mask"], batch["noise"])
        totals += torch.stack([loss * n, acc * n, n.float()])
        size = accelerator.unwrap_model(model).head.out_features
        hist = torch.stack([torch.bincount(pred, minlength=size), torch.bincount(target, minlength=size)]).float()
        counts = hist if counts is None else counts + hist
    totals = accelerator.reduce(totals, "sum")
    counts = accelerator.reduce(counts, "sum")
    p = counts / counts.sum(1, keepdim=True)
    entropy = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(1)  # (2,) nats
    model.train()
    return {"eval_loss": (totals[0] / totals[2]).item(), "eval_acc": (totals[1] / totals[2]).item(),
            "eval_codes_used": (counts[0] > 0).float().mean().item(), "eval_code_perplexity": entropy[0].exp().item(),
            "eval_label_entropy": entropy[1].item()}
