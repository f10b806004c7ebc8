"""Conformer-CTC: the BEST-RQ encoder (a `transformers` `Wav2Vec2BertModel` fed stacked log-mel
frames) plus a linear CTC head; SpecAugment masks; initialization from a BEST-RQ run.

The parameter names are BEST-RQ's (`encoder.*`, buffers `feat_mean`, `feat_std`), so a BEST-RQ
`final/model.safetensors` loads into this model by name. `encoder_config` is a copy of BEST-RQ's
(recipes never import each other): keep the two identical, or pre-trained encoders stop loading.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from torch import nn
from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

from text import BLANK


def encoder_config(
    *, input_dim: int, hidden_size: int, num_layers: int, num_heads: int, ffn_dim: int,
    conv_kernel: int, dropout: float,
) -> Wav2Vec2BertConfig:
    """Identical to recipes/best_rq/model.py: encoder_config."""
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
        # We apply SpecAugment ourselves; the built-in one draws from numpy's global RNG, and
        # layerdrop leaves parameters unused under DDP.
        apply_spec_augment=False,
        mask_time_prob=0.0,
        layerdrop=0.0,
        add_adapter=False,
    )


class ConformerCTC(nn.Module):
    def __init__(self, config: Wav2Vec2BertConfig, *, n_mels: int, stack_frames: int, vocab_size: int):
        super().__init__()
        self.stack = stack_frames
        # Global log-mel statistics (from the training data, or from BEST-RQ; then checkpointed).
        self.register_buffer("feat_mean", torch.zeros(n_mels))
        self.register_buffer("feat_std", torch.ones(n_mels))
        self.encoder = Wav2Vec2BertModel(config)
        self.head = nn.Linear(config.hidden_size, vocab_size)  # class 0 = CTC blank

    def forward(self, feats, feat_lens, time_mask=None, freq_mask=None):
        """feats: (B, T, n_mels) raw log-mel, T a multiple of `stack`; feat_lens: (B,) valid frames;
        time_mask: (B, T) and freq_mask: (B, n_mels) bool, SpecAugment (masked → 0 after normalization).
        Returns log-posteriors (B, T // stack, classes) in float32 and their valid lengths (B,)."""
        B, T, D = feats.shape
        L = T // self.stack
        x = (feats - self.feat_mean) / self.feat_std
        if time_mask is not None:
            x = x.masked_fill(time_mask[:, :, None] | freq_mask[:, None, :], 0.0)
        out_lens = feat_lens // self.stack
        valid = torch.arange(L, device=feats.device)[None, :] < out_lens[:, None]
        hidden = self.encoder(
            input_features=x.reshape(B, L, self.stack * D), attention_mask=valid.long()
        ).last_hidden_state  # (B, L, hidden), one frame per 40 ms
        return F.log_softmax(self.head(hidden).float(), dim=-1), out_lens


def ctc_loss(log_probs, out_lens, targets, target_lens):
    """CTC loss summed over the batch and divided by its target tokens: nats per output token.

    `zero_infinity`: an utterance too short for its transcript (e.g. sped up) contributes nothing."""
    loss = F.ctc_loss(log_probs.transpose(0, 1), targets, out_lens, target_lens, blank=BLANK,
                      reduction="sum", zero_infinity=True)
    return loss / target_lens.sum().clamp_min(1)


def spec_augment_masks(frames: int, n_mels: int, generator: torch.Generator, *, freq_masks: int,
                       freq_mask_width: int, time_masks: int, time_mask_width: int, time_mask_ratio: float):
    """SpecAugment (Park et al. 2019) masks for one utterance, drawn from `generator` only.

    `freq_masks` bands of U[0, freq_mask_width] mel bins and `time_masks` spans of
    U[0, min(time_mask_width, time_mask_ratio · frames)] frames. Returns (frames,), (n_mels,) bool."""
    time_mask = torch.zeros(frames, dtype=torch.bool)
    freq_mask = torch.zeros(n_mels, dtype=torch.bool)
    for _ in range(freq_masks):
        w = int(torch.randint(0, freq_mask_width + 1, (1,), generator=generator))
        f0 = int(torch.randint(0, max(1, n_mels - w + 1), (1,), generator=generator))
        freq_mask[f0 : f0 + w] = True
    max_t = min(time_mask_width, int(time_mask_ratio * frames))
    for _ in range(time_masks):
        w = int(torch.randint(0, max_t + 1, (1,), generator=generator))
        t0 = int(torch.randint(0, max(1, frames - w + 1), (1,), generator=generator))
        time_mask[t0 : t0 + w] = True
    return time_mask, freq_mask


# Settings that must equal the pre-training run's for its encoder and features to mean anything.
MATCHING_KEYS = ("sample_rate", "n_mels", "stack_frames", "hidden_size", "num_layers", "num_heads",
                 "ffn_dim", "conv_kernel")


def resolve_best_rq(path: str | Path) -> Path:
    """A BEST-RQ output_dir or its final/ → the folder holding model.safetensors / encoder/."""
    path = Path(path)
    for folder in (path / "final", path):
        if (folder / "model.safetensors").is_file() or (folder / "encoder" / "config.json").is_file():
            return folder
    raise FileNotFoundError(f"--init_from {path}: no BEST-RQ export found (expected final/model.safetensors "
                            f"or final/encoder/ under it)")


def load_best_rq(model: ConformerCTC, path: str | Path, cfg: dict) -> bool:
    """Load a BEST-RQ encoder (and its feature statistics when present) into `model`.

    Refuses, listing the differences, when front end or encoder shape differ from `cfg`.
    Returns True if the feature mean/std were taken from the BEST-RQ run."""
    folder = resolve_best_rq(path)
    if (folder / "config.yaml").is_file():
        theirs = yaml.safe_load((folder / "config.yaml").read_text())
    else:  # encoder/ alone: its transformers config says the shape (front end assumed from it)
        enc = Wav2Vec2BertConfig.from_pretrained(folder / "encoder")
        theirs = dict(hidden_size=enc.hidden_size, num_layers=enc.num_hidden_layers,
                      num_heads=enc.num_attention_heads, ffn_dim=enc.intermediate_size,
                      conv_kernel=enc.conv_depthwise_kernel_size)
        if enc.feature_projection_input_dim != cfg["n_mels"] * cfg["stack_frames"]:
            theirs["n_mels × stack_frames"] = enc.feature_projection_input_dim
            cfg = {**cfg, "n_mels × stack_frames": cfg["n_mels"] * cfg["stack_frames"]}
    differ = [f"{k}: BEST-RQ {theirs[k]!r} != ASR {cfg[k]!r}"
              for k in (*MATCHING_KEYS, "n_mels × stack_frames") if k in theirs and theirs[k] != cfg[k]]
    if differ:
        raise ValueError(f"--init_from {folder}: the pre-trained encoder does not match this config "
                         f"(front end and encoder shape must equal pre-training):\n  " + "\n  ".join(differ)
                         + "\nSet these keys to the BEST-RQ values (see its config.yaml).")
    if (folder / "model.safetensors").is_file():
        weights = load_file(folder / "model.safetensors")
        state = {k: v for k, v in weights.items() if k.startswith("encoder.") or k in ("feat_mean", "feat_std")}
    else:
        weights = load_file(folder / "encoder" / "model.safetensors")
        state = {f"encoder.{k}": v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.startswith("encoder.")]
    if missing or unexpected:
        raise ValueError(f"--init_from {folder}: encoder weights do not fit: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return "feat_mean" in state
