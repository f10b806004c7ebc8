"""The logging row of an optimizer step: `WindowMeans` and `MetricsLog.log_step`; `decay_groups`."""

from __future__ import annotations

import json

import torch
from accelerate import Accelerator

from common.training.state import TrainState
from common.training.logs import MetricsLog, Throughput, WindowMeans
from common.training.loop import decay_groups


def test_log_step_writes_the_window_means_and_the_step(tmp_path):
    accelerator = Accelerator(cpu=True)
    window = WindowMeans()
    for loss, acc in ((1.0, 0.5), (3.0, 0.25)):  # a window of 2 batches
        window.add({"loss": torch.tensor(loss), "acc": torch.tensor(acc)}, 2)
    state = TrainState(step=7, epoch=1, skipped_updates=2)
    throughput = Throughput(accelerator, {"u1": 2.0})
    throughput.add(["u1"])
    metrics = MetricsLog(accelerator, tmp_path / "metrics.jsonl")
    row = metrics.log_step(state, window, throughput, lr=1e-3, grad_norm=torch.tensor(0.5),
                           extra={"eval_loss": 1.5})
    assert list(row)[:4] == ["step", "epoch", "loss", "acc"]  # the window's values in compute_loss's order
    assert row["step"] == 7 and row["epoch"] == 1 and row["loss"] == 2.0 and row["acc"] == 0.375
    assert row["lr"] == 1e-3 and row["grad_norm"] == 0.5 and row["skipped_updates"] == 2
    assert row["audio_s_per_s"] > 0 and row["eval_loss"] == 1.5
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [row]
    window.zero()
    window.add({"loss": torch.tensor(4.0), "acc": torch.tensor(1.0)}, 1)
    assert metrics.log_step(state, window, throughput, lr=1e-3, grad_norm=torch.tensor(0.5), extra={})["loss"] == 4.0


def test_decay_groups_exempt_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    decay, no_decay = decay_groups(model, 0.01, lr=2.0)
    assert [p.shape for p in decay["params"]] == [(4, 3)] and decay["weight_decay"] == 0.01
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0  # bias, norm weight and bias
    assert decay["lr"] == no_decay["lr"] == 2.0
