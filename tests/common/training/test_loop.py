"""The loop mechanics in common/training/loop.py, without a recipe: accumulation windows, resume inside an
epoch and inside a window, the per-position reseed, the optimizer update's non-finite skip, and the
contracts each helper checks (every misuse fails with a message saying what was out of order)."""

import copy
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from common.training.state import ContractError, TrainState
from common.training.faults import RunError
from common.training.loop import (MicroBatch, accumulation_window, end_step, lr_schedule, optimizer_update,
                                  train_batches)


def test_accumulation_windows_with_a_short_last_window():
    # 7 batches, accumulation 3: windows [0, 3), [3, 6), [6, 7): the last one holds 1 batch
    windows = [accumulation_window(i, 7, 3) for i in range(7)]
    assert [w.window_len for w in windows] == [3, 3, 3, 3, 3, 3, 1]
    assert [i for i, w in enumerate(windows) if w.sync] == [2, 5, 6]
    assert accumulation_window(0, 1, 4) == MicroBatch(window_len=1, sync=True)


def test_lr_schedules_warm_up_then_decay_or_hold():
    inv, const = lr_schedule(100), lr_schedule(100, "constant_with_warmup")
    for f in (inv, const):  # the same linear warm-up, reaching the peak at warmup_steps
        assert [f(s) for s in (0, 1, 50, 100)] == [0.01, 0.01, 0.5, 1.0]
    assert inv(400) == 0.5 and inv(10_000) == pytest.approx(0.1)  # 1/sqrt: half the peak at 4× the warm-up, a tenth at 100×
    assert const(400) == const(10_000) == 1.0
    with pytest.raises(ValueError, match="unknown LR schedule 'cosine'"):
        lr_schedule(100, "cosine")


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


def started(accumulation=1, **position):
    """A TrainState as `resume_from_checkpoint` leaves it (1 process): at a step boundary."""
    state = TrainState(gradient_accumulation_steps=accumulation, global_batch=accumulation, **position)
    state.stage = "boundary"
    return state


def consume(state, loader, max_steps, accumulation, stop_at=None):
    """What a recipe loop does: one record per micro-batch (position, ids, a dropout-like draw),
    an optimizer step at each window end; returns the records and, at `stop_at`, a checkpoint."""
    acc = SimpleNamespace(process_index=0, num_processes=1)
    records, saved = [], None
    for batch, micro in train_batches(acc, loader, state, max_steps=max_steps, accumulation=accumulation, seed=1):
        records.append((batch["ids"], micro, torch.rand(1).item()))
        if micro.sync:
            end_step(state)
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
    full, _ = consume(started(accumulation), make_loader(7), max_steps, accumulation)
    first, saved = consume(started(accumulation), make_loader(7), max_steps, accumulation, stop_at=stop_at)
    rest, _ = consume(saved, make_loader(7), max_steps, accumulation)
    assert first + rest == full
    assert sum(m.sync for _, m, _ in full) == max_steps


def test_position_at_epoch_end_names_the_next_epoch():
    state = started()
    consume(state, make_loader(4), max_steps=4, accumulation=1)
    assert (state.step, state.epoch, state.batches_in_epoch) == (4, 1, 0)
    consume(state, make_loader(4), max_steps=6, accumulation=1)
    assert (state.step, state.epoch, state.batches_in_epoch) == (6, 1, 2)


def test_a_finished_run_yields_nothing():
    state = started(step=5)
    assert consume(state, make_loader(4), max_steps=5, accumulation=1)[0] == []


def test_max_steps_below_the_resumed_step_is_refused():
    """Lowering --max_steps under a run's step would export its later weights labelled with the lower
    count: refused in one line that says what works."""
    with pytest.raises(RunError, match=r"--max_steps 3 is below this run's step 5 .*--max_steps 5 or more"):
        consume(started(step=5), make_loader(4), max_steps=3, accumulation=1)


def at_window_end(state):
    """`state` as train_batches leaves it when it yields a window's last micro-batch."""
    state.stage, state.updated = "window_end", ()
    return state


def test_nonfinite_gradients_skip_the_update_then_stop():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = started()

    def step(x):
        model(x).sum().backward()
        grad_norm = optimizer_update(accelerator, model, optimizer, at_window_end(state), max_grad_norm=1.0,
                                     max_nonfinite_updates=3)
        end_step(state, scheduler)
        return grad_norm

    before = model.weight.detach().clone()
    for streak in (1, 2):
        assert not torch.isfinite(step(torch.full((1, 3), float("nan"))))
        assert (state.step, state.skipped_updates, state.nonfinite_streak) == (streak, streak, streak)
        assert torch.equal(model.weight, before) and model.weight.grad is None
    assert scheduler.last_epoch == 2  # a skipped update still ends its step: the schedule moves on
    step(torch.ones(1, 3))
    assert state.nonfinite_streak == 0 and not torch.equal(model.weight, before)
    for _ in range(2):
        step(torch.full((1, 3), float("nan")))
    with pytest.raises(FloatingPointError, match="3 consecutive non-finite updates"):
        step(torch.full((1, 3), float("nan")))


def test_two_optimizers_in_one_step_count_one_step_and_one_streak():
    """A GAN step: the discriminator's and the generator's updates, one end_step for both schedules;
    a step whose two updates are both skipped counts once in the streak."""
    accelerator = Accelerator(cpu=True)
    gen, disc = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    g_opt, d_opt = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    g_sched, d_sched = (torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0) for o in (g_opt, d_opt))
    gen, disc, g_opt, d_opt = accelerator.prepare(gen, disc, g_opt, d_opt)
    state = started()
    for x, skipped in ((torch.ones(1, 3), 0), (torch.full((1, 3), float("nan")), 2)):
        (gen(x).sum() + disc(x).sum()).backward()
        at_window_end(state)
        for model, opt in ((disc, d_opt), (gen, g_opt)):
            optimizer_update(accelerator, model, opt, state, max_grad_norm=1.0, max_nonfinite_updates=3)
        end_step(state, d_sched, g_sched)
        assert state.skipped_updates == skipped
    assert (state.step, state.nonfinite_streak, d_sched.last_epoch, g_sched.last_epoch) == (2, 1, 2, 2)
    at_window_end(state)  # a discriminator-only step: the generator's schedule stays
    d_opt.zero_grad()
    optimizer_update(accelerator, disc, d_opt, state, max_grad_norm=1.0, max_nonfinite_updates=3)
    end_step(state, d_sched)
    assert (state.step, state.nonfinite_streak, d_sched.last_epoch, g_sched.last_epoch) == (3, 0, 3, 2)


# ---- contracts: each misuse fails, saying what was out of order --------------------------------


def _opt_and_model():
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator, *accelerator.prepare(model, optimizer)


def test_optimizer_update_only_at_a_window_end_and_once_per_optimizer():
    accelerator, model, optimizer = _opt_and_model()
    update = lambda state: optimizer_update(accelerator, model, optimizer, state, max_grad_norm=1.0,  # noqa: E731
                                            max_nonfinite_updates=3)
    state = started()
    state.stage = "window"
    with pytest.raises(ContractError, match=r"inside an accumulation window \(micro.sync is False\)"):
        update(state)
    update(at_window_end(state))
    with pytest.raises(ContractError, match="already updated in this window"):
        update(state)
    end_step(state)
    with pytest.raises(ContractError, match="after end_step"):
        update(state)
    with pytest.raises(ContractError, match="outside the loop"):
        update(TrainState())


def test_end_step_once_per_window_and_only_at_its_end():
    state = started()
    state.stage = "window"
    with pytest.raises(ContractError, match="end_step at step 1: inside an accumulation window"):
        end_step(state)
    end_step(at_window_end(state))
    with pytest.raises(ContractError, match="end_step at step 2: twice for one window"):
        end_step(state)
    assert state.step == 1


def test_train_batches_refuses_a_state_never_resumed():
    acc = SimpleNamespace(process_index=0, num_processes=1)
    with pytest.raises(ContractError, match="call resume_from_checkpoint.* once before the loop"):
        next(train_batches(acc, make_loader(4), TrainState(), max_steps=2, accumulation=1, seed=1))


def test_train_batches_refuses_an_accumulation_or_sampler_off_the_global_batch():
    acc = SimpleNamespace(process_index=0, num_processes=2)
    state = started(accumulation=2)  # global batch 2
    state.global_batch = 4  # 2 processes × 2 from global_batch_plan
    with pytest.raises(ContractError, match=r"2 process\(es\) × accumulation 1 != the state's global batch 4"):
        next(train_batches(acc, make_loader(4), state, max_steps=2, accumulation=1, seed=1))
    sampler = SimpleNamespace(multiple_of=2, set_epoch=lambda e: None)  # sized to the processes only
    with pytest.raises(ContractError, match="multiple of 2, not of the global batch 4: build it with multiple_of"):
        next(train_batches(acc, make_loader(4), state, max_steps=2, accumulation=2, seed=1, epoch_objects=(sampler,)))
    from common.data.loading import make_loader as duration_loader  # the recipes' loader: its sampler is found in it

    loader, _ = duration_loader(list(range(8)), [1.0] * 8, lambda items: {"ids": items}, max_batch_seconds=2.0,
                                num_buckets=1, seed=0, multiple_of=2, shuffle=True)
    with pytest.raises(ContractError, match="multiple of 2, not of the global batch 4"):
        next(train_batches(acc, loader, state, max_steps=2, accumulation=2, seed=1))


def test_a_window_without_end_step_stops_the_loop():
    acc = SimpleNamespace(process_index=0, num_processes=1)
    batches = train_batches(acc, make_loader(4), started(), max_steps=2, accumulation=1, seed=1)
    next(batches)  # a window of one micro-batch; the loop "forgets" end_step
    with pytest.raises(ContractError, match="was not closed: call end_step"):
        next(batches)


class FakeEngine:
    """What optimizer_update reads from a DeepSpeed engine after it stepped inside backward()."""

    def __init__(self, norm, clipping=1.0, gas=1):
        self.norm, self.clipping, self.gas = norm, clipping, gas

    def gradient_accumulation_steps(self):
        return self.gas

    def gradient_clipping(self):
        return self.clipping

    def get_global_grad_norm(self):
        return self.norm


def test_deepspeed_outcome_is_counted_like_ours_and_an_applied_nonfinite_update_stops():
    from common.training.faults import RunError
    from common.training.loop import no_sync_unless

    syncs = []
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(value="DEEPSPEED"),
                                  gradient_state=SimpleNamespace(_set_sync_gradients=syncs.append))
    with no_sync_unless(accelerator, None, False):  # a window's inner micro-batch: the engine must not step
        assert syncs == [False]
    assert syncs == [False, True]  # accelerate's default back (outside its accumulate())

    optimizer = SimpleNamespace(step=lambda: None, zero_grad=lambda set_to_none: None, step_was_skipped=False)
    scheduler = SimpleNamespace(step=lambda: None)
    state = started()

    def step(engine):
        try:
            return optimizer_update(accelerator, engine, optimizer, at_window_end(state), max_grad_norm=1.0,
                                    max_nonfinite_updates=3)
        finally:
            if state.stage == "window_end":
                end_step(state, scheduler)

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


def test_no_sync_unless_covers_every_model_given():
    import contextlib

    entered = []

    @contextlib.contextmanager
    def no_sync(model):
        entered.append(model)
        yield

    from common.training.loop import no_sync_unless

    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(value="MULTI_CPU"), no_sync=no_sync)
    with no_sync_unless(accelerator, ("generator", "discriminator"), False):
        assert entered == ["generator", "discriminator"]
    with no_sync_unless(accelerator, "model", False):
        assert entered[-1] == "model"
    with no_sync_unless(accelerator, ("generator", "discriminator"), True):  # a window's end: all-reduce
        assert len(entered) == 3
