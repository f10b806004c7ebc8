"""Log-mel front end and global feature statistics.

`LogMel` lives in `common.speech_frontend`, the self-contained file that exported models carry, so
training and exported feature extraction are the same code.
"""

from __future__ import annotations

from typing import Iterable

import torch
from accelerate.utils import broadcast

from common.faults import RunError
from common.speech_frontend import LogMel  # noqa: F401 — re-exported: the recipes' front end
from common.vocoding import mel_frontend  # noqa: F401 — re-exported


def feature_stats(items: Iterable[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std over all frames of `items`, (utterance id, (frames, dim)
    features) pairs, in float64.

    Refuses non-finite features, naming the utterances: a NaN or Inf sample in one file (which the
    default header-only data check does not decode) would make every statistic NaN, and with it
    every loss of the run."""
    ids, features = zip(*items)
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
