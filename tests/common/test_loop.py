"""The loop mechanics in common/loop.py, without a recipe: accumulation windows, resume inside an
epoch and inside a window, the per-position reseed, and the optimizer step's non-finite skip."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from common.checkpoint import TrainState
from common.loop import MicroBatch, accumulation_window, optimizer_step, train_batches


def test_accumulation_windows_with_a_short_last_window():
    # 7 batches, accumulation 3: windows [0, 3), [3, 6), [6, 7): the last one holds 1 batch
    windows = [accumulation_window(i, 7, 3) for i in range(7)]
    assert [w.window_len for w in windows] == [3, 3, 3, 3, 3, 3, 1]
    assert [i for i, w in enumerate(windows) if w.sync] == [2, 5, 6]
    assert accumulation_window(0, 1, 4) == MicroBatch(window_len=1, sync=True)


class Batches:
    """A world-agnostic batch sampler: (seed, epoch) → a shuffled list of index lists."""

    def __init__(self, n_batches: int):
        self.n, self.epoch = n_batches, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        return iter([[b] for b in order])

    def __len__(self):
        return self.n


class EpochLoader(DataLoader):
    def set_epoch(self, epoch):  # what a prepared DataLoaderShard has
        self.batch_sampler.set_epoch(epoch)


def make_loader(n_batches):
    return EpochLoader(list(range(n_batches)), batch_sampler=Batches(n_batches),
                       collate_fn=lambda items: {"ids": items}, generator=torch.Generator().manual_seed(0))


def consume(state, loader, max_steps, accumulation, stop_at=None):
    """What a recipe loop does: one record per micro-batch (position, ids, a dropout-like draw),
    an optimizer step at each window end; returns the records and, at `stop_at`, a checkpoint."""
    acc = SimpleNamespace(process_index=0, num_processes=1)
    records, saved = [], None
    for batch, micro in train_batches(acc, loader, state, max_steps=max_steps, accumulation=accumulation, seed=1):
        records.append((batch["ids"], micro, torch.rand(1).item()))
        if micro.sync:
            state.step += 1
            if state.step == stop_at:
                saved = copy.deepcopy(state)
                break
    return records, saved


@pytest.mark.parametrize("accumulation,stop_at", [(1, 3), (1, 7), (3, 2), (3, 3), (2, 5)])
def test_interrupted_equals_continuous(accumulation, stop_at):
    """Batches of 7 per epoch; stopping after any optimizer step (inside an epoch, at its end, after
    a short last window) and resuming from the saved state gives the same micro-batches, windows
    and random draws as never stopping."""
    max_steps = 9
    full, _ = consume(TrainState(), make_loader(7), max_steps, accumulation)
    first, saved = consume(TrainState(), make_loader(7), max_steps, accumulation, stop_at=stop_at)
    rest, _ = consume(saved, make_loader(7), max_steps, accumulation)
    assert first + rest == full
    assert sum(m.sync for _, m, _ in full) == max_steps


def test_position_at_epoch_end_names_the_next_epoch():
    state = TrainState()
    consume(state, make_loader(4), max_steps=4, accumulation=1)
    assert (state.step, state.epoch, state.batches_in_epoch) == (4, 1, 0)
    consume(state, make_loader(4), max_steps=6, accumulation=1)
    assert (state.step, state.epoch, state.batches_in_epoch) == (6, 1, 2)


def test_a_finished_run_yields_nothing():
    state = dataclasses.replace(TrainState(), step=5)
    assert consume(state, make_loader(4), max_steps=5, accumulation=1)[0] == []


def test_nonfinite_gradients_skip_the_update_then_stop():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    before = model.weight.detach().clone()
    for streak in (1, 2):
        model(torch.full((1, 3), float("nan"))).sum().backward()
        grad_norm = optimizer_step(accelerator, model, optimizer, scheduler, state, max_grad_norm=1.0,
                                   max_nonfinite_updates=3)
        assert not torch.isfinite(grad_norm)
        assert (state.step, state.skipped_updates, state.nonfinite_streak) == (streak, streak, streak)
        assert torch.equal(model.weight, before) and model.weight.grad is None
    model(torch.ones(1, 3)).sum().backward()
    optimizer_step(accelerator, model, optimizer, scheduler, state, max_grad_norm=1.0, max_nonfinite_updates=3)
    assert state.nonfinite_streak == 0 and not torch.equal(model.weight, before)
    for _ in range(2):
        model(torch.full((1, 3), float("nan"))).sum().backward()
        optimizer_step(accelerator, model, optimizer, scheduler, state, max_grad_norm=1.0, max_nonfinite_updates=3)
    model(torch.full((1, 3), float("nan"))).sum().backward()
    with pytest.raises(FloatingPointError, match="3 consecutive non-finite updates"):
        optimizer_step(accelerator, model, optimizer, scheduler, state, max_grad_norm=1.0, max_nonfinite_updates=3)


class FakeEngine:
    """What optimizer_step reads from a DeepSpeed engine after it stepped inside backward()."""

    def __init__(self, norm, clipping=1.0, gas=1):
        self.norm, self.clipping, self.gas = norm, clipping, gas

    def gradient_accumulation_steps(self):
        return self.gas

    def gradient_clipping(self):
        return self.clipping

    def get_global_grad_norm(self):
        return self.norm


def test_deepspeed_outcome_is_counted_like_ours_and_an_applied_nonfinite_update_stops():
    from common.faults import RunError
    from common.loop import no_sync_unless

    syncs = []
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(value="DEEPSPEED"),
                                  gradient_state=SimpleNamespace(_set_sync_gradients=syncs.append))
    with no_sync_unless(accelerator, None, False):  # a window's inner micro-batch: the engine must not step
        assert syncs == [False]
    assert syncs == [False, True]  # accelerate's default back (outside its accumulate())

    optimizer = SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None, step_was_skipped=False)
    scheduler = SimpleNamespace(step=lambda: None)
    state = TrainState()
    step = lambda engine: optimizer_step(accelerator, engine, optimizer, scheduler, state,  # noqa: E731
                                         max_grad_norm=1.0, max_nonfinite_updates=3)
    assert step(FakeEngine(0.5)) == 0.5 and (state.step, state.skipped_updates) == (1, 0)
    optimizer.step_was_skipped = True  # DeepSpeed skipped it (overflow) and reports inf
    assert not torch.isfinite(step(FakeEngine(float("inf"))))
    assert (state.step, state.skipped_updates, state.nonfinite_streak) == (2, 1, 1)
    optimizer.step_was_skipped = False  # ... or applied it anyway: nothing to undo, stop
    with pytest.raises(FloatingPointError, match="DeepSpeed applied an update with a non-finite"):
        step(FakeEngine(float("nan")))
    for engine in (FakeEngine(0.5, clipping=5.0), FakeEngine(0.5, gas=2)):  # the engine's settings must be ours
        with pytest.raises(RunError, match="these recipes need 1 .* and --max_grad_norm"):
            step(engine)
