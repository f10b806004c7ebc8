"""common/training/averaging.py: the warm-up decay's arithmetic, the swap that restores the trained
weights bit for bit, the state a checkpoint holds, and a tool reading the average from a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from common.training.averaging import NAME, WeightAverage, averaged_parameters, checkpoint_weights, swapped_in


def model_and_steps(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    steps = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(5)]
    return model, steps


def test_the_average_follows_the_warm_up_decay():
    model, steps = model_and_steps()
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = WeightAverage(model, decay=0.9)
    for n_update, delta in enumerate(steps, 1):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.add_(delta[n])
        average.update(model)
        d = min(0.9, (1 + n_update) / (10 + n_update))  # 0.182, 0.25, 0.308, 0.357, 0.4: the warm-up binds
        for n, p in model.named_parameters():
            expected[n] = d * expected[n] + (1 - d) * p.detach()
    assert average.updates == 5 and average.current_decay() == pytest.approx(6 / 15)
    assert all(torch.allclose(average.shadow[n], expected[n], atol=1e-6) for n in expected)
    late = WeightAverage(model, decay=0.9)
    late.updates = 1000
    assert late.current_decay() == 0.9  # the cap


def test_swapped_in_uses_the_average_then_restores_the_trained_weights_exactly():
    model, steps = model_and_steps()
    average = WeightAverage(model, decay=0.5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(steps[0][n])
    average.update(model)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with swapped_in(average, model):
        assert all(torch.equal(p, average.shadow[n]) for n, p in model.named_parameters())
        assert torch.equal(model[1].running_mean, trained["1.running_mean"])  # buffers stay the model's
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    wrapped = torch.nn.Module()
    wrapped.module = model  # a DDP-like wrapper: the swap reaches the inner module's parameters
    with swapped_in(average, wrapped):
        assert torch.equal(model[0].weight, average.shadow["0.weight"])
    with swapped_in(None, model):  # no average: the model as it is
        assert torch.equal(model[0].weight, trained["0.weight"])


def test_a_checkpoint_holds_the_average_and_tools_read_it_in_place_of_the_trained_weights(tmp_path):
    model, steps = model_and_steps()
    average = WeightAverage(model, decay=0.99)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    average.update(model)
    # what accelerate's save_state writes: the weights, and the registered objects' state_dicts (pickled)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    torch.save(average.state_dict(), tmp_path / "custom_checkpoint_0.pkl")
    (tmp_path / "train_state.json").write_text(json.dumps({"registered": [NAME, "RunState"]}))

    restored = WeightAverage(model_and_steps(seed=1)[0], decay=0.99)
    restored.load_state_dict(torch.load(tmp_path / "custom_checkpoint_0.pkl", weights_only=True))
    assert restored.updates == 1 and all(torch.equal(restored.shadow[n], average.shadow[n]) for n in average.shadow)

    weights = checkpoint_weights(tmp_path)
    assert torch.equal(weights["0.weight"], average.shadow["0.weight"])  # the average, not the trained weight
    assert not torch.equal(weights["0.weight"], model[0].weight)
    assert torch.equal(weights["1.running_var"], model[1].running_var)  # buffers from model.safetensors
    (tmp_path / "train_state.json").write_text(json.dumps({"registered": ["RunState"]}))  # a run without one
    assert averaged_parameters(tmp_path) is None and torch.equal(checkpoint_weights(tmp_path)["0.weight"], model[0].weight)

    other = WeightAverage(torch.nn.Linear(3, 4), decay=0.99)  # another model's names: refused
    with pytest.raises(ValueError, match="another model"):
        other.load_state_dict(average.state_dict())
    with pytest.raises(ValueError, match="must be in"):
        WeightAverage(model, decay=1.0)
