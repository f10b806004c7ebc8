import math

import pytest
import torch

from common.training.faults import RunError
from common.model.features import LogMel, feature_stats


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
    mean, std = feature_stats((f"utt{i}", f) for i, f in enumerate(feats))
    cat = torch.cat(feats)
    assert torch.allclose(mean, cat.mean(0), atol=1e-5)
    assert torch.allclose(std, cat.std(0, unbiased=False), atol=1e-5)


def test_feature_stats_name_an_utterance_with_non_finite_features():
    """One NaN sample makes every statistic NaN: refused, naming the utterance and the fix."""
    feats = [("a", torch.randn(10, 5)), ("b", torch.randn(8, 5)), ("c", torch.randn(9, 5))]
    feats[1][1][3, 2] = float("nan")
    with pytest.raises(RunError, match=r"in 1 of the 3 utterances .*, e\.g\. b: .*--data_check full"):
        feature_stats(feats)


def test_feature_stats_take_items_that_carry_more_than_id_and_features():
    """A dataset whose items are (id, feats, label) gives the same statistics as (id, feats) pairs
    (a copied recipe with labels once failed here with a bare 'too many values to unpack')."""
    feats = [torch.randn(n, 5) for n in (6, 9)]
    pairs = feature_stats((f"u{i}", f) for i, f in enumerate(feats))
    labelled = feature_stats((f"u{i}", f, i, "more") for i, f in enumerate(feats))
    assert all(torch.equal(a, b) for a, b in zip(pairs, labelled))


@pytest.mark.parametrize("item,got", [(torch.randn(4, 5), "a Tensor"), (("u",), "a tuple of 1: (str)"),
                                      ((torch.randn(4, 5), "u"), "a tuple of 2: (Tensor, str)")])
def test_feature_stats_refuse_another_item_shape_in_one_line(item, got):
    with pytest.raises(TypeError) as e:
        feature_stats([item])
    assert str(e.value) == (f"feature_stats takes items (utterance id, (frames, dim) features, ...), got {got}: "
                            f"give it the dataset's items with the id first and the 2-D features second")
