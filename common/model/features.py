"""Log-mel front end and global feature statistics.

`LogMel` lives in `common.model.speech_frontend`, the self-contained file that exported models carry, so
training and exported feature extraction are the same code.
"""

from __future__ import annotations

from typing import Iterable

import torch
from accelerate.utils import broadcast

from common.training.faults import RunError
from common.model.speech_frontend import LogMel  # noqa: F401 — re-exported: the recipes' front end
from common.model.vocoding import mel_frontend  # noqa: F401 — re-exported


def feature_stats(items: Iterable[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std over all frames of `items`, in float64. Each item is a tuple or
    list whose first two entries are (utterance id, (frames, dim) features); what follows them (a
    label, a transcript) is ignored, so a recipe passes its dataset's items as they are.

    Refuses non-finite features, naming the utterances: a NaN or Inf sample in one file (which the
    default header-only data check does not decode) would make every statistic NaN, and with it
    every loss of the run. An item of another shape is a TypeError of one line saying what it got."""
    ids, features = [], []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) >= 2 and isinstance(item[1], torch.Tensor)
                and item[1].ndim == 2):
            got = (f"a {type(item).__name__} of {len(item)}: ({', '.join(type(x).__name__ for x in item)})"
                   if isinstance(item, (tuple, list)) else f"a {type(item).__name__}")
            raise TypeError(f"feature_stats takes items (utterance id, (frames, dim) features, ...), got {got}: "
                            f"give it the dataset's items with the id first and the 2-D features second")
        ids.append(item[0])
        features.append(item[1])
    if not ids:
        raise TypeError("feature_stats got no items: give it at least one (utterance id, features, ...) item")
    bad = [utt_id for utt_id, f in zip(ids, features) if not torch.isfinite(f).all()]
    if bad:
        raise RunError(f"non-finite features (NaN/Inf audio samples) in {len(bad)} of the {len(ids)} utterances "
                       f"sampled for the feature statistics, e.g. {bad[0]}: find every such file with "
                       f"--data_check full (it refuses them), then remove them or add --on_bad_data skip")
    total = sum(f.shape[0] for f in features)
    s = sum(f.double().sum(0) for f in features)
    s2 = sum((f.double() ** 2).sum(0) for f in features)
    mean = s / total
    std = (s2 / total - mean**2).clamp_min(1e-10).sqrt()
    return mean.float(), std.float()


def shared_feature_stats(accelerator, compute) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `compute()` → (mean, std) on the main process only and broadcast the result.

    Collective: every rank must call it. Statistics that differ per rank (each rank normalizing
    with its own shard's stats) were a real bug in other toolkits; here there is one copy.
    """
    mean_std = torch.zeros(2, 0)
    if accelerator.is_main_process:
        mean, std = compute()
        mean_std = torch.stack([mean, std])
    if accelerator.num_processes > 1:
        dim = torch.tensor([mean_std.shape[1]], device=accelerator.device)
        dim = broadcast(dim, from_process=0)
        if not accelerator.is_main_process:
            mean_std = torch.zeros(2, int(dim.item()))
        mean_std = broadcast(mean_std.to(accelerator.device), from_process=0).cpu()
    return mean_std[0], mean_std[1]


def set_feature_stats(accelerator, model, compute) -> None:
    """Fill `model`'s `feat_mean`/`feat_std` buffers with `shared_feature_stats(accelerator, compute)`.

    Collective: every rank must call it (at the start of a fresh run; a resumed run loads them)."""
    mean, std = shared_feature_stats(accelerator, compute)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.feat_mean.copy_(mean)
    unwrapped.feat_std.copy_(std)
