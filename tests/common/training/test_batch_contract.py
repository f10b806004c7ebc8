"""The batch contract (docs/adapt.md): a training batch is a dict with its utterance ids under "ids".
A collator that returns anything else stops the loop at its first batch with one line naming what it
got, instead of a KeyError inside the logging (Throughput) or --dump_batch_ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.data.loading import make_loader
from common.training.state import ContractError, TrainState
from common.training.logs import Throughput
from common.training.loop import train_batches

EXPECTED = ('a training batch must be a dict with its utterance ids under "ids" (one per item: what Throughput and '
            '--dump_batch_ids read), got {}: return dict(ids=[...], ...) from the collator')


def first_batch(collate):
    """The first batch `train_batches` yields from 4 items of 1 s, batched by `collate` (1 process)."""
    loader, _ = make_loader([torch.zeros(2)] * 4, [1.0] * 4, collate, max_batch_seconds=2.0, num_buckets=1, seed=0,
                            multiple_of=1, shuffle=True)
    loader.set_epoch = loader.batch_sampler.set_epoch  # what accelerator.prepare's loader has
    state = TrainState(gradient_accumulation_steps=1, global_batch=1)
    state.stage = "boundary"  # as resume_from_checkpoint leaves a fresh start
    return next(train_batches(SimpleNamespace(process_index=0, num_processes=1), loader, state, max_steps=1,
                              accumulation=1, seed=1))


@pytest.mark.parametrize("collate,got", [(lambda items: (torch.stack(items), torch.stack(items)), "a tuple"),
                                         (lambda items: {"noisy": torch.stack(items), "lens": 2},
                                          "a dict with keys ['lens', 'noisy']")])
def test_a_batch_without_ids_stops_the_loop_in_one_line(collate, got):
    with pytest.raises(ContractError) as e:
        first_batch(collate)
    assert str(e.value) == EXPECTED.format(got)


def test_a_batch_with_ids_is_yielded_and_counted():
    batch, _ = first_batch(lambda items: {"ids": ["a", "b"][: len(items)], "x": torch.stack(items)})
    throughput = Throughput(SimpleNamespace(), {"a": 1.0, "b": 1.0})
    throughput.add(batch)
    assert throughput.seconds == 2.0
    with pytest.raises(ContractError) as e:
        throughput.add({"x": batch["x"]})
    assert str(e.value) == EXPECTED.format("a dict with keys ['x']")
