"""The speech encoder shared by BEST-RQ pre-training and ASR fine-tuning: one contract, one place.

The contract that `--init_from` (ASR from a BEST-RQ run: common/model/hf_encoder.py) relies on:
- front end: 80-dim log-mel (`common.model.features.LogMel`), normalized with the global statistics held
  in the buffers `feat_mean`, `feat_std` (n_mels,), then `stack_frames` 10 ms frames stacked into
  one encoder frame (4 → 40 ms);
- encoder: a `transformers` `Wav2Vec2BertModel` (a Conformer) built by `encoder_config`, under the
  parameter name prefix `encoder.`; its self-attention computes the relative-position bias per distance
  (`BandedRelativeKeyAttention`: the same function and parameters, so exports are stock models);
- the config keys in `MATCHING_KEYS` must be equal on both sides; an export (a transformers folder)
  writes them under the names `EXPORTED_AS` gives.
Checkpoints of both recipes carry these names; do not rename them.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Wav2Vec2BertConfig, Wav2Vec2BertModel
from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import (
    ALL_ATTENTION_FUNCTIONS, Wav2Vec2BertSelfAttention, eager_attention_forward)

# Settings that must equal the pre-training run's for its encoder and features to mean anything, and
# where an export says each: {key: (part of a `hf_encoder.read_frontend` record: "config" is config.json
# (`encoder_config`'s names), "feature_extractor" preprocessor_config.json (speech_frontend's
# StackedLogMelFeatureExtractor), its name there)}.
EXPORTED_AS = {"sample_rate": ("feature_extractor", "sampling_rate"), "n_mels": ("feature_extractor", "feature_size"),
               "stack_frames": ("feature_extractor", "stack_frames"), "hidden_size": ("config", "hidden_size"),
               "num_layers": ("config", "num_hidden_layers"), "num_heads": ("config", "num_attention_heads"),
               "ffn_dim": ("config", "intermediate_size"), "conv_kernel": ("config", "conv_depthwise_kernel_size")}
MATCHING_KEYS = tuple(EXPORTED_AS)


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


class BandedRelativeKeyAttention(Wav2Vec2BertSelfAttention):
    """`Wav2Vec2BertSelfAttention` with "relative_key" positions, its position bias computed per distance.

    The bias of query l and key r is q_l · E[clamp(r − l, −left, right) + left] / sqrt(head), E the
    K = left + right + 1 (129) distance embeddings. transformers looks E up for every (l, r) pair, a
    (T, T, head) table, and contracts it with every query: T² · head multiply-adds per query row, and in
    the backward a scatter of T² rows into the K embeddings. Here: q · Eᵀ once, (B, H, T, K), then each
    pair's entry gathered, (B, H, T, T). On 2 CPU cores, one layer's forward + backward over one 29 s
    utterance (T = 725 frames of 40 ms) took 129 ms that way and 20 ms this way (a voice's prompts run to
    30 s; the built-in corpus's ~3 s ones gain ~10 %); forward outputs came out equal to the float.
    Same parameters and names: checkpoints and exports (stock `Wav2Vec2BertModel`) are unchanged."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                relative_position_embeddings: torch.Tensor | None = None, **kwargs):
        if self.position_embeddings_type != "relative_key":  # not ours (encoder_config): transformers' own
            return super().forward(hidden_states, attention_mask, relative_position_embeddings, **kwargs)
        shape = (*hidden_states.shape[:-1], -1, self.head_size)  # (B, T, H, head)
        q, k, v = (linear(hidden_states).view(shape).transpose(1, 2) for linear in (self.linear_q, self.linear_k, self.linear_v))
        T, S = q.shape[2], k.shape[2]
        left, right = self.left_max_position_embeddings, self.right_max_position_embeddings
        distance = torch.arange(S, device=q.device)[None, :] - torch.arange(T, device=q.device)[:, None]
        index = (distance.clamp(-left, right) + left).expand(*q.shape[:2], T, S)  # (B, H, T, S) into K
        per_distance = torch.matmul(q, self.distance_embedding.weight.to(q.dtype).t())  # (B, H, T, K)
        bias = torch.gather(per_distance, 3, index) * self.scaling
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attend(self, q, k, v, attention_mask, dropout=self.dropout.p if self.training else 0.0,
                              scaling=self.scaling, position_bias=bias, **kwargs)
        return self.linear_out(out.reshape(*hidden_states.shape[:-1], -1)), weights


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
        for layer in self.encoder.encoder.layers:  # the faster position bias (above): no new parameters, no RNG drawn
            layer.self_attn.__class__ = BandedRelativeKeyAttention

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
