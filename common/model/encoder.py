"""The speech encoder shared by BEST-RQ pre-training and ASR fine-tuning: one contract, one place.

The contract that `--init_from` (ASR from a BEST-RQ run) relies on:
- front end: 80-dim log-mel (`common.model.features.LogMel`), normalized with the global statistics held
  in the buffers `feat_mean`, `feat_std` (n_mels,), then `stack_frames` 10 ms frames stacked into
  one encoder frame (4 → 40 ms);
- encoder: a `transformers` `Wav2Vec2BertModel` (a Conformer) built by `encoder_config`, under the
  parameter name prefix `encoder.`;
- the config keys in `MATCHING_KEYS` must be equal on both sides.
Checkpoints of both recipes carry these names; do not rename them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file
from torch import nn
from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel

from common.training.averaging import checkpoint_weights
from common.training.sealing import resolve_checkpoint

# Settings that must equal the pre-training run's for its encoder and features to mean anything.
MATCHING_KEYS = ("sample_rate", "n_mels", "stack_frames", "hidden_size", "num_layers", "num_heads",
                 "ffn_dim", "conv_kernel")
# The encoder's parameter prefix in an exported ASR model (transformers Wav2Vec2BertForCTC).
ASR_EXPORT_PREFIX = "wav2vec2_bert."


def encoder_config(
    *, input_dim: int, hidden_size: int, num_layers: int, num_heads: int, ffn_dim: int,
    conv_kernel: int, dropout: float, attention_dropout: float | None = None,
    activation_dropout: float | None = None,
) -> Wav2Vec2BertConfig:
    """The Conformer. `dropout` is the residual-branch (and input projection) dropout; the attention
    probabilities' and the feed-forward activations' dropouts default to it. Those two are the
    expensive ones on CPU ((B, heads, L, L) and (B, L, 4·hidden) Bernoulli draws: 15 % of a BEST-RQ
    step, measured, see benchmarks/README.md) and BEST-RQ pre-training sets them to 0."""
    attention_dropout = dropout if attention_dropout is None else attention_dropout
    activation_dropout = dropout if activation_dropout is None else activation_dropout
    return Wav2Vec2BertConfig(
        feature_projection_input_dim=input_dim,  # stacked log-mel: stack_frames × n_mels
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=ffn_dim,
        conv_depthwise_kernel_size=conv_kernel,
        hidden_dropout=dropout,
        attention_dropout=attention_dropout,
        activation_dropout=activation_dropout,
        feat_proj_dropout=dropout,
        # Relative positions, symmetric: a bidirectional encoder (the default looks 8 frames ahead).
        left_max_position_embeddings=64,
        right_max_position_embeddings=64,
        # The recipes mask their input themselves: the built-in SpecAugment draws from numpy's
        # global RNG, and layerdrop leaves parameters unused under DDP.
        apply_spec_augment=False,
        mask_time_prob=0.0,
        layerdrop=0.0,
        add_adapter=False,
    )


def encoder_config_from(cfg) -> Wav2Vec2BertConfig:
    """`encoder_config` from a recipe config (dataclass or namespace with the MATCHING_KEYS fields)."""
    return encoder_config(input_dim=cfg.n_mels * cfg.stack_frames, hidden_size=cfg.hidden_size,
                          num_layers=cfg.num_layers, num_heads=cfg.num_heads, ffn_dim=cfg.ffn_dim,
                          conv_kernel=cfg.conv_kernel, dropout=cfg.dropout,
                          # configs written before these two fields existed used `dropout` for both
                          attention_dropout=getattr(cfg, "attention_dropout", None),
                          activation_dropout=getattr(cfg, "activation_dropout", None))


class StackedLogMelEncoder(nn.Module):
    """Global log-mel statistics + frame stacking + the Conformer. Recipes' models subclass it and add
    their heads, so the parameter names (`encoder.*`, `feat_mean`, `feat_std`) are the same in both."""

    def __init__(self, config: Wav2Vec2BertConfig, *, n_mels: int, stack_frames: int):
        super().__init__()
        self.stack = stack_frames
        # Global log-mel statistics (set once from the training data, or from BEST-RQ; checkpointed).
        self.register_buffer("feat_mean", torch.zeros(n_mels))
        self.register_buffer("feat_std", torch.ones(n_mels))
        self.encoder = Wav2Vec2BertModel(config)

    def normalize(self, feats: torch.Tensor) -> torch.Tensor:
        """(B, T, n_mels) raw log-mel → normalized with the global statistics."""
        return (feats - self.feat_mean) / self.feat_std

    def encode(self, x: torch.Tensor, feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, n_mels) normalized, T a multiple of `stack`; feat_lens: (B,) valid 10 ms frames.
        Returns hidden states (B, T // stack, hidden), one per 40 ms, and their valid lengths (B,)."""
        B, T, D = x.shape
        L = T // self.stack
        out_lens = feat_lens // self.stack
        valid = torch.arange(L, device=x.device)[None, :] < out_lens[:, None]
        # The features are fp32 (log-mel and statistics buffers). Under FSDP2 with bf16 the weights
        # themselves are bf16 (MixedPrecisionPolicy.param_dtype) and no autocast casts the input:
        # give the encoder its weights' dtype (a no-op in fp32 and under DDP's autocast).
        x = x.to(self.encoder.feature_projection.layer_norm.weight.dtype)
        hidden = self.encoder(input_features=x.reshape(B, L, self.stack * D),
                              attention_mask=valid.long()).last_hidden_state
        return hidden, out_lens


def resolve_pretrained(path: str | Path) -> Path:
    """A pre-trained run's output_dir (BEST-RQ or ASR) or its final/ → the sealed folder holding
    model.safetensors / encoder/ (verified as every tool verifies a trained model:
    `common.training.sealing.resolve_checkpoint`)."""
    return resolve_checkpoint(path, flag="--init_from")


def load_pretrained_encoder(model: StackedLogMelEncoder, path: str | Path, cfg: dict) -> bool:
    """Load a pre-trained encoder (and its feature statistics when present) into `model`: a BEST-RQ
    run's, or an ASR run's (its Conformer without the CTC head: transfer to a new voice or language).

    Refuses, listing the differences, when front end or encoder shape differ from `cfg`.
    Returns True if the feature mean/std were taken from the pre-trained run."""
    folder = resolve_pretrained(path)
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
    differ = [f"{k}: pre-trained {theirs[k]!r} != this run {cfg[k]!r}"
              for k in (*MATCHING_KEYS, "n_mels × stack_frames") if k in theirs and theirs[k] != cfg[k]]
    if differ:
        raise ValueError(f"--init_from {folder}: the pre-trained encoder does not match this config "
                         f"(front end and encoder shape must equal pre-training):\n  " + "\n  ".join(differ)
                         + "\nSet these keys to the pre-trained run's values (see its config.yaml).")
    stats = None  # a feature extractor exported beside the weights holds the statistics
    if (folder / "model.safetensors").is_file():
        weights = checkpoint_weights(folder)  # a checkpoint's weight average (--ema_decay) when its run kept one
        if any(k.startswith(ASR_EXPORT_PREFIX) for k in weights):
            # An ASR run's final/ (transformers Wav2Vec2BertForCTC): its encoder, without the CTC
            # head, whose vocabulary is the other run's. Transfer from a well-trained ASR model.
            state = {"encoder." + k[len(ASR_EXPORT_PREFIX):]: v for k, v in weights.items()
                     if k.startswith(ASR_EXPORT_PREFIX)}
            stats = folder / "preprocessor_config.json"
        else:
            state = {k: v for k, v in weights.items() if k.startswith("encoder.") or k in ("feat_mean", "feat_std")}
    else:
        weights = load_file(folder / "encoder" / "model.safetensors")
        state = {f"encoder.{k}": v for k, v in weights.items()}
        stats = folder / "encoder" / "preprocessor_config.json"
    if stats is not None and stats.is_file():
        fe = json.loads(stats.read_text())
        state.update(feat_mean=torch.tensor(fe["mean"]), feat_std=torch.tensor(fe["std"]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.startswith("encoder.")]
    if missing or unexpected:
        raise ValueError(f"--init_from {folder}: encoder weights do not fit: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return "feat_mean" in state
