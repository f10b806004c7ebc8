"""Tiny random transformers speech encoders of each family `--init_from` takes (common/model/hf_encoder.py),
written by `save_pretrained` as a Hub checkpoint is: no download. hidden 32, 2 layers; the raw-waveform
families' convolutional front end keeps the 320-sample (20 ms) stride of the real ones in 3 small layers."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILY_NAMES = ("wav2vec2", "hubert", "wavlm", "wav2vec2-bert")
CONV = dict(conv_dim=(16, 16, 16), conv_kernel=(10, 8, 4), conv_stride=(5, 8, 8), num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2)
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def tiny_encoder(family: str, folder: Path, *, model_class: str | None = None, seed: int = 0) -> Path:
    """A random `family` model (the bare encoder, or `model_class`: a pre-training or CTC class of the
    family) and its stock feature extractor, saved into `folder` (safetensors)."""
    import transformers

    torch.manual_seed(seed)
    if family == "wav2vec2-bert":
        config = transformers.Wav2Vec2BertConfig(**SHAPE, feature_projection_input_dim=160, conv_depthwise_kernel_size=3,
                                                 left_max_position_embeddings=16, right_max_position_embeddings=16)
        extractor = transformers.SeamlessM4TFeatureExtractor()
    else:
        config_class = transformers.AutoConfig.for_model(family).__class__
        config = config_class(**SHAPE, **CONV)
        extractor = transformers.Wav2Vec2FeatureExtractor(do_normalize=True, return_attention_mask=True)
    cls = model_class or {"wav2vec2": "Wav2Vec2Model", "hubert": "HubertModel", "wavlm": "WavLMModel",
                          "wav2vec2-bert": "Wav2Vec2BertModel"}[family]
    getattr(transformers, cls)(config).save_pretrained(folder)
    extractor.save_pretrained(folder)
    return Path(folder)
