"""The shared encoder's self-attention: the position bias computed per distance is transformers' function."""

import torch
from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import Wav2Vec2BertSelfAttention

from common.model.encoder import BandedRelativeKeyAttention, StackedLogMelEncoder, encoder_config


def test_banded_attention_is_transformers_function_with_its_parameters():
    torch.manual_seed(0)
    cfg = encoder_config(input_dim=320, hidden_size=48, num_layers=2, num_heads=4, ffn_dim=96, conv_kernel=5, dropout=0.1)
    model = StackedLogMelEncoder(cfg, n_mels=80, stack_frames=4).train()
    assert all(type(layer.self_attn) is BandedRelativeKeyAttention for layer in model.encoder.encoder.layers)
    # 90 encoder frames: distances beyond ±64 are clamped; padding masks the shorter utterances' keys
    x, lens = torch.randn(3, 360, 80), torch.tensor([360, 200, 44])

    def run(cls):
        for layer in model.encoder.encoder.layers:
            layer.self_attn.__class__ = cls
        torch.manual_seed(1)  # the same dropout masks
        model.zero_grad()
        out = model.encode(x, lens)[0]
        out.pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours, ours_grads = run(BandedRelativeKeyAttention)
    theirs, their_grads = run(Wav2Vec2BertSelfAttention)
    assert torch.equal(ours, theirs)
    assert ours_grads.keys() == their_grads.keys()
    for name, g in their_grads.items():
        if name.endswith("linear_k.bias"):  # zero in exact arithmetic (softmax ignores a shift of every key): rounding only
            continue
        assert torch.allclose(ours_grads[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max())), name
    # the same parameters under the same names: checkpoints and exports are unchanged
    assert {n for n, _ in BandedRelativeKeyAttention(cfg).named_parameters()} == \
           {n for n, _ in Wav2Vec2BertSelfAttention(cfg).named_parameters()}
