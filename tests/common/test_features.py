import math

import torch

from common.features import LogMel, feature_stats


def test_logmel_shape_and_determinism():
    wav = torch.sin(torch.arange(16000) * 2 * math.pi * 440 / 16000)
    f = LogMel(16000, 80)(wav)
    assert f.shape == (101, 80)  # 1 s at a 10 ms hop (centered frames)
    assert torch.equal(f, LogMel(16000, 80)(wav))
    assert torch.isfinite(f).all()
    # the 440 Hz tone is the loudest mel band region
    assert f.mean(0).argmax() < 30


def test_feature_stats_match_torch():
    feats = [torch.randn(n, 5) * 3 + 1 for n in (10, 20, 7)]
    mean, std = feature_stats(feats)
    cat = torch.cat(feats)
    assert torch.allclose(mean, cat.mean(0), atol=1e-5)
    assert torch.allclose(std, cat.std(0, unbiased=False), atol=1e-5)
