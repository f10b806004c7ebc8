"""A fixed validation set of per-sample draws, as docs/adapt.md shows it (the enhancement example): the
validation collator is an instance of its own, which nothing gives an epoch — not `train_batches`
(RecipeData.epoch_objects holds the training collator) and not accelerate's prepared loader (it sets
the epoch of a sampler or a dataset, never of a collator) — so it draws from (seed, 0, id) at every
evaluation and in every resumed process. A collator shared with training follows the training epoch."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from common.data.loading import make_loader, sample_generator
from common.data.source import RecipeData


class NoisyCollator:
    """The shape of the example's MixingCollator: one draw per item from (seed, epoch, id)."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __call__(self, items):
        return {"ids": list(items), "noise": torch.stack([torch.rand(3, generator=sample_generator(7, self.epoch, i))
                                                           for i in items])}


def passes(loader, n: int) -> list[list[torch.Tensor]]:
    return [[batch["noise"] for batch in loader] for _ in range(n)]


def test_a_validation_collator_of_its_own_draws_the_same_set_at_every_evaluation():
    ids = [f"utt{i}" for i in range(6)]
    train_collator, valid_collator = NoisyCollator(), NoisyCollator()
    shape = dict(max_batch_seconds=2.0, num_buckets=1, seed=0, multiple_of=1)
    train_loader, sampler = make_loader(ids, [1.0] * 6, train_collator, shuffle=True, **shape)
    valid_loader, _ = make_loader(ids, [1.0] * 6, valid_collator, shuffle=False, **shape)
    data = RecipeData(None, ids, ids, train_collator, train_loader, sampler, valid_loader, summary={}, durations={})
    valid = Accelerator(cpu=True).prepare(valid_loader)
    first = passes(valid, 1)[0]
    for epoch in (1, 2):  # what train_batches does at each epoch, between evaluations
        data.set_epoch(epoch)
        assert valid_collator not in data.epoch_objects and train_collator.epoch == epoch
        for again in passes(valid, 2):  # accelerate's loader counts its passes: they reach no collator
            assert all(torch.equal(a, b) for a, b in zip(first, again))
    shared = Accelerator(cpu=True).prepare(make_loader(ids, [1.0] * 6, train_collator, shuffle=False, **shape)[0])
    assert not all(torch.equal(a, b) for a, b in zip(first, passes(shared, 1)[0]))  # shared: the training epoch's
