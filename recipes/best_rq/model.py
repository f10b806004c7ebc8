"""BEST-RQ: masked prediction of random-projection-quantized speech (Chiu et al., 2022, arXiv:2202.01855).

The encoder is a `transformers` `Wav2Vec2BertModel` (a Conformer fed stacked log-mel frames), so the
pre-trained encoder loads with `Wav2Vec2BertModel.from_pretrained(<output_dir>/final/encoder)` and
the ASR recipe can fine-tune it. Stacking 4 × 10 ms frames gives the 4× time reduction: one encoder
frame, and one BEST-RQ label, per 40 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel


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
        """(..., input_dim) → unit-norm (..., code_dim)."""
        return F.normalize(x.float() @ self.projection, dim=-1)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., input_dim) → labels (...) in [0, codebook_size).

        On the unit sphere the nearest code in l2 distance is the one with the largest dot product.
        """
        return (self.project(x) @ self.codebook.T).argmax(dim=-1)


def encoder_config(
    *, input_dim: int, hidden_size: int, num_layers: int, num_heads: int, ffn_dim: int,
    conv_kernel: int, dropout: float,
) -> Wav2Vec2BertConfig:
    return Wav2Vec2BertConfig(
        feature_projection_input_dim=input_dim,  # stacked log-mel: stack_frames × n_mels
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=ffn_dim,
        conv_depthwise_kernel_size=conv_kernel,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=dropout,
        feat_proj_dropout=dropout,
        # Relative positions, symmetric: a bidirectional encoder (the default looks 8 frames ahead).
        left_max_position_embeddings=64,
        right_max_position_embeddings=64,
        # BEST-RQ masks its input itself; the built-in SpecAugment draws from numpy's global RNG,
        # and layerdrop leaves parameters unused under DDP.
        apply_spec_augment=False,
        mask_time_prob=0.0,
        layerdrop=0.0,
        add_adapter=False,
    )


class BestRQ(nn.Module):
    def __init__(self, config: Wav2Vec2BertConfig, *, n_mels: int, stack_frames: int,
                 codebook_size: int, code_dim: int, quantizer_seed: int):
        super().__init__()
        self.stack = stack_frames
        # Global log-mel statistics (set once from the training data, then checkpointed).
        self.register_buffer("feat_mean", torch.zeros(n_mels))
        self.register_buffer("feat_std", torch.ones(n_mels))
        self.quantizer = RandomProjectionQuantizer(n_mels * stack_frames, code_dim, codebook_size, quantizer_seed)
        self.encoder = Wav2Vec2BertModel(config)
        self.head = nn.Linear(config.hidden_size, codebook_size)

    def forward(self, feats, feat_lens, mask, noise):
        """Masked-prediction loss.

        feats: (B, T, n_mels) raw log-mel, T a multiple of `stack`; feat_lens: (B,) valid frames;
        mask: (B, T // stack) bool, masked 40 ms positions; noise: (B, T, n_mels) ~ N(0, σ²).
        Returns (loss: mean CE over masked positions, accuracy, number of masked positions).
        """
        B, T, D = feats.shape
        L = T // self.stack
        x = (feats - self.feat_mean) / self.feat_std
        labels = self.quantizer(x.reshape(B, L, self.stack * D))  # (B, L), from the clean input
        frame_mask = mask.repeat_interleave(self.stack, dim=1).unsqueeze(-1)  # (B, T, 1)
        x = torch.where(frame_mask, noise, x)
        valid = torch.arange(L, device=feats.device)[None, :] < (feat_lens // self.stack)[:, None]
        hidden = self.encoder(
            input_features=x.reshape(B, L, self.stack * D), attention_mask=valid.long()
        ).last_hidden_state  # (B, L, hidden)
        sel = mask & valid
        logits = self.head(hidden[sel])  # (n_masked, codebook_size)
        target = labels[sel]
        loss = F.cross_entropy(logits.float(), target)
        acc = (logits.argmax(-1) == target).float().mean()
        return loss, acc, sel.sum()


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
