import json
import math
import os
import shutil

import pytest
import torch
from accelerate import Accelerator

from common.training.checkpoint import save_checkpoint as _save
from common.training.faults import NonFiniteError, RunError
from common.training.resume import choose_checkpoint
from common.training.resume import resume_from_checkpoint as _resume
from common.training.sealing import checkpoint_dir, file_digest, find_latest_checkpoint, list_checkpoints, verify_checkpoint
from common.training.state import ContractError, TrainState


def resume_from_checkpoint(accelerator, out, state, sched):
    model, opt = accelerator._models[0], accelerator._optimizers[0]
    return _resume(accelerator, choose_checkpoint(accelerator, out), state, models=model, optimizers=opt,
                   schedulers=sched)


def save_checkpoint(accelerator, model, out, state, sched, save_total_limit):
    state.stage = "boundary"  # as end_step leaves it
    return _save(accelerator, out, state, models=model, optimizers=accelerator._optimizers[0], schedulers=sched,
                 save_total_limit=save_total_limit)


def setup(seed=0):
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model, opt = accelerator.prepare(model, opt)
    state = TrainState(world_size=1, gradient_accumulation_steps=1, global_batch=1, config_hash="h",
                       config={"lr": 0.1, "max_steps": 10})
    return accelerator, model, opt, sched, state


def train_step(model, opt, sched):
    model(torch.randn(2, 4)).pow(2).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_roundtrip_prune_and_marker(tmp_path):
    accelerator, model, opt, sched, state = setup()
    for step in range(1, 5):
        train_step(model, opt, sched)
        state.step, state.batches_in_epoch = step, step
        save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    latest = find_latest_checkpoint(tmp_path)
    assert latest == checkpoint_dir(tmp_path, 4)
    marker = json.loads((latest / "COMPLETE").read_text())
    assert marker["step"] == 4 and "model.safetensors" in marker["files"]
    assert json.loads((latest / "train_state.json").read_text())["batches_in_epoch"] == 4
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    lr = sched.get_last_lr()

    # a fresh process state: different init, then resume
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) == latest
    assert state2.step == 4 and state2.batches_in_epoch == 4
    assert all(torch.equal(weights[k], v) for k, v in model2.state_dict().items())
    assert sched2.get_last_lr() == lr
    # the same next step gives the same result
    torch.manual_seed(5)
    train_step(model, opt, sched)
    torch.manual_seed(5)
    train_step(model2, opt2, sched2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_incomplete_checkpoints_are_ignored(tmp_path):
    accelerator, model, opt, sched, state = setup()
    state.step = 2
    save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    # a save killed mid-way: temp folder, and a step folder without marker
    (tmp_path / "checkpoints" / ".step_00000003.tmp").mkdir()
    checkpoint_dir(tmp_path, 4).mkdir()
    assert find_latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 2)
    # the next real save of step 3 replaces the leftover temp folder
    state.step = 3
    save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    assert find_latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    assert not (tmp_path / "checkpoints" / ".step_00000003.tmp").exists()


def test_no_checkpoint_means_fresh_start(tmp_path):
    accelerator, model, opt, sched, state = setup()
    assert resume_from_checkpoint(accelerator, tmp_path, state, sched) is None


@pytest.mark.parametrize("change", ["global_batch", "config"])
def test_mismatched_checkpoint_is_refused(tmp_path, change):
    accelerator, model, opt, sched, state = setup()
    state.step = 1
    save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    accelerator2, model2, opt2, sched2, state2 = setup()
    if change == "config":
        state2.config = {"lr": 0.2, "max_steps": 10}
        state2.config_hash = "other"
        expected = "lr: checkpoint 0.1 != now 0.2"
    else:
        setattr(state2, change, 2)
        expected = "global batch: checkpoint 1 micro-batches per step"
    with pytest.raises(RuntimeError, match=expected):  # RunError: a RuntimeError printed without traceback
        resume_from_checkpoint(accelerator2, tmp_path, state2, sched2)


def test_resume_safe_keys_may_change(tmp_path):
    accelerator, model, opt, sched, state = setup()
    state.step = 1
    save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    accelerator2, model2, opt2, sched2, state2 = setup()
    state2.config = {"lr": 0.1, "max_steps": 99}  # same hash: max_steps is resume-safe
    assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) is not None
    assert state2.config["max_steps"] == 99


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, damage, caplog):
    accelerator, model, opt, sched, state = setup()
    for step in (1, 2):
        train_step(model, opt, sched)
        state.step = step
        save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
        if step == 1:
            weights_at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    victim = checkpoint_dir(tmp_path, 2) / ("model.safetensors" if damage != "delete" else "optimizer.bin")
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[-3] ^= 0xFF  # same size, one byte of a weight changed
        victim.write_bytes(data)
    else:
        victim.unlink()
    assert verify_checkpoint(checkpoint_dir(tmp_path, 2)) is not None
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    with caplog.at_level("WARNING"):
        assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) == checkpoint_dir(tmp_path, 1)
    assert "step_00000002" in caplog.text and victim.name in caplog.text
    assert state2.step == 1
    assert all(torch.equal(weights_at_1[k], v) for k, v in model2.state_dict().items())


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {_Evil.target}",))


def _reseal(ckpt, name):
    """Write `name`'s size and digest into the marker, as an attacker who re-seals a folder would."""
    marker = json.loads((ckpt / "COMPLETE").read_text())
    marker["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": file_digest(ckpt / name)}
    (ckpt / "COMPLETE").write_text(json.dumps(marker))


@pytest.mark.parametrize("victim,content", [("random_states_0.pkl", "crafted"), ("optimizer.bin", "crafted"),
                                            ("optimizer.bin", "garbage"), ("random_states_0.pkl", "truncated"),
                                            ("custom_checkpoint_0.pkl", "crafted"), ("scaler.pt", "crafted")])
def test_an_unloadable_pickle_is_named_and_the_previous_checkpoint_used(tmp_path, caplog, victim, content):
    """A crafted pickle (its digest re-sealed) is refused, not executed; like a damaged file it is
    named in a warning and the checkpoint before it is resumed from."""
    accelerator, model, opt, sched, state = setup()
    for step in (1, 2):
        train_step(model, opt, sched)
        state.step = step
        ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
        if step == 1:
            weights_at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    _Evil.target = tmp_path / "pwned"
    if content == "crafted":
        torch.save({"step": _Evil()}, ckpt / victim)
    elif content == "garbage":
        (ckpt / victim).write_bytes(os.urandom(4096))
    else:
        (ckpt / victim).write_bytes((ckpt / victim).read_bytes()[:-200])
    _reseal(ckpt, victim)
    assert verify_checkpoint(ckpt) is None  # the digests match: only loading can tell
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    with caplog.at_level("WARNING"):
        assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) == checkpoint_dir(tmp_path, 1)
    assert f"skipping damaged checkpoint {ckpt}: {victim} " in caplog.text
    if content == "crafted":
        assert "GLOBAL posix.system" in caplog.text
    assert not _Evil.target.exists()
    assert state2.step == 1
    assert all(torch.equal(weights_at_1[k], v) for k, v in model2.state_dict().items())


def _full_disk(monkeypatch):
    """safetensors, as accelerate calls it, on a full disk: part of the file, then its error."""
    import accelerate.utils.other
    from safetensors import SafetensorError

    def save_file(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        # the message safetensors 0.8 gives on a full tmpfs
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(accelerate.utils.other, "safe_save_file", save_file)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))


def test_disk_full_while_writing_the_weights_says_what_to_free(tmp_path, monkeypatch):
    """The weights' writer fails (safetensors raises its own SafetensorError, no OSError): one line
    naming the mount, the space needed and the older checkpoints that may be deleted; no partial
    folder is left."""
    from common.training.faults import RunError

    accelerator, model, opt, sched, state = setup()
    for step in (1, 2):
        state.step = step
        save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    size = sum(f.stat().st_size for f in checkpoint_dir(tmp_path, 2).iterdir())
    _full_disk(monkeypatch)
    state.step = 3
    with pytest.raises(RunError) as e:
        save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=1)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("no space left on /") and "while saving step 3 (needs ~" in message
    assert "the partial checkpoint was removed and step 2 is kept" in message
    assert f"Free at least {math.ceil(size / 1e5) / 10:g} MB on /" in message  # all of it: 0 bytes are free
    assert f"the older checkpoints in {tmp_path / 'checkpoints'}: step_00000001, " in message
    assert "keep step_00000002" in message and "re-run the same command to resume" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]


def test_disk_full_during_the_export_leaves_no_partial_folder(tmp_path, monkeypatch):
    from common.training.checkpoint import export_final
    from common.training.faults import RunError

    accelerator, model, opt, sched, state = setup()
    state.step = 1
    save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    _full_disk(monkeypatch)
    with pytest.raises(RunError, match=r"^no space left on /.* while exporting the final model to .*final \(needs ~"
                                       r".*the partial export was removed and step 1 is kept\. Free at least .* "
                                       r"re-run the same command to finish the export"):
        export_final(accelerator, model, tmp_path, lambda folder: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_leftovers_are_removed_at_launch_but_never_an_only_copy(tmp_path):
    """What kills leave (a pruned `.step_N.old`, a replaced `.final.old`, a `.step_N.tmp`) is removed
    when the next launch chooses its checkpoint; a `.old` that may be the only copy is kept."""
    from common.training.checkpoint import export_final

    accelerator, model, opt, sched, state = setup()
    for step in (1, 2):
        state.step = step
        save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    root = tmp_path / "checkpoints"
    os.rename(root / "step_00000001", root / ".step_00000001.old")  # pruned, then killed mid-delete
    (root / ".step_00000003.tmp").mkdir()  # a save killed mid-way
    (root / ".step_00000007.old").mkdir()  # newer than every checkpoint: may be the only copy
    (tmp_path / ".final.old").mkdir()  # no final/: the previous export is the only one
    assert choose_checkpoint(accelerator, tmp_path) == checkpoint_dir(tmp_path, 2)
    assert sorted(p.name for p in root.iterdir()) == [".step_00000007.old", "step_00000002"]
    assert (tmp_path / ".final.old").is_dir()
    export_final(accelerator, model, tmp_path, lambda folder: None)  # killed between its renames before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "final"]
    (tmp_path / ".final.old").mkdir()  # killed while deleting the replaced export
    choose_checkpoint(accelerator, tmp_path)
    assert not (tmp_path / ".final.old").exists() and (tmp_path / "final" / "COMPLETE").is_file()


def test_non_finite_weights_are_never_saved(tmp_path):
    accelerator, model, opt, sched, state = setup()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="refusing to save step 0: non-finite weights in model"):
        save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    assert find_latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_resealed_checkpoint_with_non_finite_weights_is_skipped(tmp_path, caplog, value):
    """Weights made non-finite and re-sealed (digests match) cannot have been written by a save
    (it refuses them): the checkpoint is damaged, named in a warning with its file, and the one
    before it resumed from, like a checkpoint whose files fail their digests."""
    from safetensors.torch import load_file, save_file

    accelerator, model, opt, sched, state = setup()
    for step in (1, 2):
        train_step(model, opt, sched)
        state.step = step
        ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
        if step == 1:
            weights_at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    weights = load_file(ckpt / "model.safetensors")
    weights["weight"][1, 2] = value
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    _reseal(ckpt, "model.safetensors")
    assert verify_checkpoint(ckpt) is None
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    with caplog.at_level("WARNING"):
        assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) == checkpoint_dir(tmp_path, 1)
    assert f"skipping damaged checkpoint {ckpt}: model.safetensors (the model) holds non-finite weights (weight)" in caplog.text
    assert state2.step == 1
    assert all(torch.equal(weights_at_1[k], v) for k, v in model2.state_dict().items())


# ---- several named models, optimizers and schedulers (a GAN), and the save/resume contracts ------


def gan(seed=0, order=("generator", "discriminator")):
    """Two models, two AdamW, two schedules, prepared in `order`."""
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    nets = {"generator": torch.nn.Linear(4, 3), "discriminator": torch.nn.Linear(3, 1)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=0.1) for k, m in nets.items()}
    prepared = accelerator.prepare(*(nets[k] for k in order), *(opts[k] for k in order))
    nets = dict(zip(order, prepared[:2]))
    opts = dict(zip(order, prepared[2:]))
    scheds = {k: torch.optim.lr_scheduler.LambdaLR(o, lambda s, k=k: 1.0 / (s + 1 + len(k))) for k, o in opts.items()}
    state = TrainState(config_hash="h", config={"lr": 0.1})
    return accelerator, dict(models=nets, optimizers=opts, schedulers=scheds), state


def gan_step(parts, d_only=False):
    g, d = parts["models"]["generator"], parts["models"]["discriminator"]
    x = torch.randn(2, 4)
    d(g(x).detach()).pow(2).sum().backward()
    parts["optimizers"]["discriminator"].step()
    parts["schedulers"]["discriminator"].step()
    if not d_only:
        g.zero_grad()
        d(g(x)).sum().backward(inputs=list(g.parameters()))
        parts["optimizers"]["generator"].step()
        parts["schedulers"]["generator"].step()
    for o in parts["optimizers"].values():
        o.zero_grad()


def test_several_named_models_roundtrip(tmp_path):
    """Both models and both optimizers (accelerate's prepare-order files) and both schedules come back;
    the checkpoint names them in prepare order; the next steps are bit-identical."""
    accelerator, parts, state = gan()
    for step, d_only in enumerate((False, True, False), start=1):
        gan_step(parts, d_only)
        state.step, state.stage = step, "boundary"
    ckpt = _save(accelerator, tmp_path, state, **parts)
    assert {"model.safetensors", "model_1.safetensors", "optimizer.bin", "optimizer_1.bin"} <= {
        p.name for p in ckpt.iterdir()}
    saved = json.loads((ckpt / "train_state.json").read_text())
    assert saved["models"] == ["generator", "discriminator"] and saved["optimizers"] == saved["models"]
    assert set(saved["schedulers"]) == {"generator", "discriminator"}

    accelerator2, parts2, state2 = gan(seed=1)
    assert _resume(accelerator2, choose_checkpoint(accelerator2, tmp_path), state2, **parts2) == ckpt
    for kind in ("models", "optimizers", "schedulers"):
        for name in parts[kind]:
            a, b = parts[kind][name].state_dict(), parts2[kind][name].state_dict()
            assert str(a) == str(b), (kind, name)  # tensors printed in full at this size
    for p in (parts, parts2):
        torch.manual_seed(7)
        gan_step(p)
    for name in ("generator", "discriminator"):
        for a, b in zip(parts["models"][name].parameters(), parts2["models"][name].parameters()):
            assert torch.equal(a, b)


def test_models_prepared_in_another_order_are_refused(tmp_path):
    accelerator, parts, state = gan()
    state.stage = "boundary"
    _save(accelerator, tmp_path, state, **parts)
    accelerator2, parts2, state2 = gan(order=("discriminator", "generator"))
    with pytest.raises(RuntimeError, match=r"models: checkpoint \['generator', 'discriminator'\] != now "
                                           r"\['discriminator', 'generator'\] \(names, in prepare order\)"):
        _resume(accelerator2, choose_checkpoint(accelerator2, tmp_path), state2, **parts2)


def test_every_prepared_model_must_be_named(tmp_path):
    accelerator, parts, state = gan()
    state.stage = "boundary"
    with pytest.raises(ContractError, match=r"2 model\(s\) prepared, 1 named; accelerate saves and loads every"):
        _save(accelerator, tmp_path, state, **{**parts, "models": {"generator": parts["models"]["generator"]}})
    unprepared = torch.nn.Linear(4, 3)
    with pytest.raises(ContractError, match="generator: not what accelerator.prepare returned"):
        _resume(accelerator, None, TrainState(), **{**parts, "models": {**parts["models"], "generator": unprepared}})


def test_non_finite_weights_name_the_model(tmp_path):
    accelerator, parts, state = gan()
    state.stage = "boundary"
    with torch.no_grad():
        parts["models"]["discriminator"].weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="non-finite weights in discriminator \\(the last complete checkpoint is kept\\)"):
        _save(accelerator, tmp_path, state, **parts)


def as_json_layout(ckpt):
    """`ckpt` as checkpoints were written before the run's state was registered for checkpointing:
    no custom_checkpoint_<i>.pkl, no `registered` in train_state.json (the position and the schedules
    there only), re-sealed."""
    saved = json.loads((ckpt / "train_state.json").read_text())
    assert saved.pop("registered") == ["RunState"]
    (ckpt / "train_state.json").write_text(json.dumps(saved, indent=2))
    marker = json.loads((ckpt / "COMPLETE").read_text())
    for path in ckpt.glob("custom_checkpoint_*.pkl"):
        path.unlink()
        del marker["files"][path.name]
    marker["files"]["train_state.json"] = {"bytes": (ckpt / "train_state.json").stat().st_size,
                                           "sha256": file_digest(ckpt / "train_state.json")}
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    assert verify_checkpoint(ckpt) is None


def test_a_checkpoint_without_names_still_resumes(tmp_path):
    """One model, one optimizer, `"scheduler"` in train_state.json: what checkpoints held before."""
    accelerator, model, opt, sched, state = setup()
    train_step(model, opt, sched)
    state.step = 1
    ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    as_json_layout(ckpt)
    saved = json.loads((ckpt / "train_state.json").read_text())
    del saved["models"], saved["optimizers"]
    saved["scheduler"] = saved.pop("schedulers")["scheduler"]
    (ckpt / "train_state.json").write_text(json.dumps(saved))
    marker = json.loads((ckpt / "COMPLETE").read_text())
    marker["files"]["train_state.json"] = {"bytes": (ckpt / "train_state.json").stat().st_size,
                                           "sha256": file_digest(ckpt / "train_state.json")}
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) == ckpt
    assert sched2.get_last_lr() == sched.get_last_lr() and state2.step == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_each_launch_is_recorded_with_the_step_it_started_at(tmp_path, monkeypatch):
    """TrainState.launches (the model card's commands): a fresh start records its command from step 0,
    each resume appends its own from the checkpoint's step; a checkpoint written before launches were
    recorded still resumes, recording this launch alone."""
    import sys

    from common.training.state import this_launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "recipes/asr/train.py"), "--max_steps", "2"])
    accelerator, model, opt, sched, state = setup()
    assert resume_from_checkpoint(accelerator, tmp_path, state, sched) is None
    assert state.launches == [{"from_step": 0, "command": "accelerate launch recipes/asr/train.py --max_steps 2",
                               "cwd": str(tmp_path), "processes": 1}] == [this_launch(0, 1)]
    train_step(model, opt, sched)
    state.step = 2
    save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)

    monkeypatch.setattr(sys, "argv", [str(tmp_path / "recipes/asr/train.py"), "--max_steps", "4"])
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    ckpt = resume_from_checkpoint(accelerator2, tmp_path, state2, sched2)
    assert [(launch["from_step"], launch["command"][-13:]) for launch in state2.launches] == [
        (0, "--max_steps 2"), (2, "--max_steps 4")]

    as_json_layout(ckpt)
    saved = json.loads((ckpt / "train_state.json").read_text())
    del saved["launches"]  # as written before launches were recorded
    (ckpt / "train_state.json").write_text(json.dumps(saved))
    marker = json.loads((ckpt / "COMPLETE").read_text())
    marker["files"]["train_state.json"] = {"bytes": (ckpt / "train_state.json").stat().st_size,
                                           "sha256": file_digest(ckpt / "train_state.json")}
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    accelerator3, model3, opt3, sched3, state3 = setup(seed=2)
    assert resume_from_checkpoint(accelerator3, tmp_path, state3, sched3) == ckpt and state3.step == 2
    assert [launch["from_step"] for launch in state3.launches] == [2]
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), model3.parameters()))


def test_save_only_at_a_step_boundary(tmp_path):
    accelerator, model, opt, sched, state = setup()
    for stage in ("new", "window", "window_end"):
        state.stage = stage
        with pytest.raises(ContractError, match=f"not at a step boundary \\(stage '{stage}'\\); save after end_step"):
            _save(accelerator, tmp_path, state, models=model, optimizers=opt, schedulers=sched)
    assert find_latest_checkpoint(tmp_path) is None


def test_resume_once_and_only_from_a_chosen_checkpoint(tmp_path):
    accelerator, model, opt, sched, state = setup()
    ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    parts = dict(models=model, optimizers=opt, schedulers=sched)
    accelerator2, model2, opt2, sched2, state2 = setup()
    parts2 = dict(models=model2, optimizers=opt2, schedulers=sched2)
    (ckpt / "COMPLETE").unlink()  # not what choose_checkpoint returns
    with pytest.raises(ContractError, match="no COMPLETE marker; pass what choose_checkpoint returned"):
        _resume(accelerator2, ckpt, state2, **parts2)
    fresh = TrainState()
    assert _resume(accelerator, None, fresh, **parts) is None and fresh.stage == "boundary"
    with pytest.raises(ContractError, match="resume a fresh TrainState.for_run.* once, before the loop"):
        _resume(accelerator, None, fresh, **parts)


def test_export_final_of_several_models_writes_one_folder_each(tmp_path):
    from common.training.checkpoint import export_final
    from safetensors.torch import load_file

    accelerator, parts, _ = gan()
    final = export_final(accelerator, parts["models"], tmp_path, lambda folder: None)
    for name, model in parts["models"].items():
        weights = load_file(final / name / "model.safetensors")
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert verify_checkpoint(final) is None


def test_several_models_under_deepspeed_are_refused_in_one_line():
    from types import SimpleNamespace

    from common.training.faults import RunError

    g, d = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
    accelerator = SimpleNamespace(distributed_type=SimpleNamespace(value="DEEPSPEED"), _models=[g, d],
                                  _optimizers=[og, od], unwrap_model=lambda m: m)
    with pytest.raises(RunError, match=r"^DeepSpeed trains one model per Accelerator; this recipe has 2 "
                                       r"\(generator, discriminator\): use a DDP or FSDP profile"):
        _resume(accelerator, None, TrainState(), models={"generator": g, "discriminator": d},
                optimizers={"generator": og, "discriminator": od}, schedulers={})


def test_non_finite_weights_in_a_layout_not_checked_before_loading_stop_the_resume(tmp_path, monkeypatch):
    """FSDP and DeepSpeed weights are not safetensors files that choose_checkpoint can read: after
    loading, the weights are checked all the same, and the resume stops in one line naming the
    checkpoint and what to do (instead of training on from NaN and failing at the next save)."""
    import common.training.resume as resume
    from safetensors.torch import load_file, save_file

    accelerator, model, opt, sched, state = setup()
    train_step(model, opt, sched)
    state.step = 1
    ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    weights = load_file(ckpt / "model.safetensors")
    weights["bias"][0] = float("nan")
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    _reseal(ckpt, "model.safetensors")
    monkeypatch.setattr(resume, "nonfinite_weights", lambda ckpt: None)  # as for an FSDP/DeepSpeed layout
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    with pytest.raises(RunError, match=f"{ckpt}: non-finite weights in model after loading it .*move step_00000001 "
                                       f"out of {ckpt.parent} to resume from the checkpoint before it"):
        resume_from_checkpoint(accelerator2, tmp_path, state2, sched2)


def test_a_discriminator_made_non_finite_and_resealed_is_named(tmp_path, caplog):
    """Several models: the file is named with its model (accelerate numbers them by prepare order)."""
    from safetensors.torch import load_file, save_file

    accelerator, parts, state = gan()
    for step in (1, 2):
        gan_step(parts)
        state.step, state.stage = step, "boundary"
        ckpt = _save(accelerator, tmp_path, state, **parts)
    weights = load_file(ckpt / "model_1.safetensors")
    weights["weight"][0, 0] = float("nan")
    save_file(weights, ckpt / "model_1.safetensors", metadata={"format": "pt"})
    _reseal(ckpt, "model_1.safetensors")
    with caplog.at_level("WARNING"):
        assert choose_checkpoint(accelerator, tmp_path) == checkpoint_dir(tmp_path, 1)
    assert (f"skipping damaged checkpoint {ckpt}: model_1.safetensors (the discriminator) holds non-finite "
            f"weights (weight)") in caplog.text


# ---- objects registered for checkpointing: the run's own state (RunState) and a recipe's ------------


class Counter:
    """A recipe's own state, registered by the recipe (not by common/)."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_the_run_state_and_a_recipe_object_are_registered_and_come_back(tmp_path):
    """save_state writes a recipe's registered object and the run's state (position, schedules) as
    custom_checkpoint_<i>.pkl, in registration order; load_state brings them back."""
    accelerator, model, opt, sched, state = setup()
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    parts = dict(models=model, optimizers=opt, schedulers=sched)
    assert _resume(accelerator, None, state, **parts) is None
    for step in (1, 2):
        train_step(model, opt, sched)
        counter.count += 3
        state.step = step
        ckpt = _save(accelerator, tmp_path, state, **parts)
    saved = json.loads((ckpt / "train_state.json").read_text())
    assert saved["registered"] == ["Counter", "RunState"]
    assert torch.load(ckpt / "custom_checkpoint_0.pkl", weights_only=True) == {"count": 6}
    run_state = torch.load(ckpt / "custom_checkpoint_1.pkl", weights_only=True)
    assert run_state["train_state"]["step"] == 2 and set(run_state["schedulers"]) == {"scheduler"}

    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    counter2 = Counter()
    accelerator2.register_for_checkpointing(counter2)
    assert _resume(accelerator2, choose_checkpoint(accelerator2, tmp_path), state2, models=model2, optimizers=opt2,
                   schedulers=sched2) == ckpt
    assert counter2.count == 6 and state2.step == 2 and sched2.state_dict() == sched.state_dict()
    assert state2.config == state.config and [launch["from_step"] for launch in state2.launches] == [0, 2]


def test_a_checkpoint_in_the_json_layout_resumes_bit_exactly(tmp_path):
    """A checkpoint as written before the run's state was registered (train_state.json alone) resumes
    from its JSON; the next steps are bit-identical, and the next save writes the registered layout."""
    accelerator, model, opt, sched, state = setup()
    for step in (1, 2, 3):
        train_step(model, opt, sched)
        state.step, state.epoch, state.batches_in_epoch, state.applied_updates = step, 1, 2 * step, step
        ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    as_json_layout(ckpt)
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) == ckpt
    assert (state2.step, state2.epoch, state2.batches_in_epoch, state2.applied_updates) == (3, 1, 6, 3)
    assert sched2.state_dict() == sched.state_dict()
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        for seed in (5, 6):
            torch.manual_seed(seed)
            train_step(m, o, s)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    state2.step = 5
    ckpt = save_checkpoint(accelerator2, model2, tmp_path, state2, sched2, save_total_limit=None)
    assert json.loads((ckpt / "train_state.json").read_text())["registered"] == ["RunState"]
    assert (ckpt / "custom_checkpoint_0.pkl").is_file()


def test_a_registered_object_the_checkpoint_does_not_hold_is_refused_in_one_line(tmp_path):
    """accelerate loads registered objects by position and stops on another count (after the weights):
    a recipe that registers one more object than its checkpoint holds, or one fewer, is refused
    before anything is loaded, naming both lists; a JSON-layout checkpoint holds none."""
    accelerator, model, opt, sched, state = setup()
    state.step = 1
    ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)

    def resume_with(*objects):
        accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
        accelerator2.register_for_checkpointing(*objects)
        with pytest.raises(RunError) as refused:
            resume_from_checkpoint(accelerator2, tmp_path, state2, sched2)
        assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), setup(seed=1)[1].parameters()))  # unloaded
        return str(refused.value)

    assert ("registered objects: checkpoint ['RunState'] != now ['Counter', 'RunState'] (names, in registration "
            "order: register_for_checkpointing before resume_from_checkpoint") in resume_with(Counter())
    as_json_layout(ckpt)
    assert ("registered objects: checkpoint none (written before registered objects were saved) != now ['Counter']"
            in resume_with(Counter()))


def test_a_registered_object_must_be_plain_data_and_registered_before_the_resume(tmp_path):
    accelerator, model, opt, sched, state = setup()
    parts = dict(models=model, optimizers=opt, schedulers=sched)
    _resume(accelerator, None, state, **parts)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    with pytest.raises(ContractError, match=r"objects registered for checkpointing \['RunState', 'Counter'\] != "
                                            r"\['RunState'\] at resume_from_checkpoint: register every object before"):
        _save(accelerator, tmp_path, state, **parts)

    accelerator, model, opt, sched, state = setup()
    counter = Counter()
    _Evil.target = tmp_path / "pwned"  # (set here too: this test may run before, or without, the one above)
    counter.count = _Evil()  # a class: torch.load(weights_only=True) refuses it
    accelerator.register_for_checkpointing(counter)
    state.stage = "boundary"
    with pytest.raises(ContractError, match=r"register_for_checkpointing\(Counter\): its state_dict\(\) is not "
                                            r"plain data \(UnpicklingError: .*posix.system"):
        _save(accelerator, tmp_path, state, models=model, optimizers=opt, schedulers=sched)
    assert find_latest_checkpoint(tmp_path) is None


def test_a_registered_state_crafted_after_the_check_still_runs_no_code(tmp_path):
    """A custom_checkpoint file replaced between choose_checkpoint's check and load_state (which asks
    torch for weights_only=False) is refused by the load itself: one line, nothing run."""
    accelerator, model, opt, sched, state = setup()
    state.step = 1
    ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    assert choose_checkpoint(accelerator2, tmp_path) == ckpt
    _Evil.target = tmp_path / "pwned"
    torch.save({"train_state": _Evil()}, ckpt / "custom_checkpoint_0.pkl")
    with pytest.raises(RunError, match=r"step_00000001: a pickled state cannot be loaded safely \(UnpicklingError: "
                                       r".*posix.system.*\); it changed after the checkpoint was checked"):
        _resume(accelerator2, ckpt, state2, models=model2, optimizers=opt2, schedulers=sched2)
    assert not _Evil.target.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


@pytest.mark.parametrize("change", ["missing", "extra", "another step", "not a run state"])
def test_a_missing_or_unrecorded_registered_state_file_skips_the_checkpoint(tmp_path, caplog, change):
    accelerator, model, opt, sched, state = setup()
    for step in (1, 2):
        state.step = step
        ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    marker = json.loads((ckpt / "COMPLETE").read_text())
    if change == "missing":
        (ckpt / "custom_checkpoint_0.pkl").unlink()
        del marker["files"]["custom_checkpoint_0.pkl"]
        (ckpt / "COMPLETE").write_text(json.dumps(marker))
        expected = "custom_checkpoint_0.pkl is missing (the state of the registered RunState)"
    elif change == "extra":
        shutil.copy(ckpt / "custom_checkpoint_0.pkl", ckpt / "custom_checkpoint_1.pkl")
        _reseal(ckpt, "custom_checkpoint_1.pkl")
        expected = "custom_checkpoint_1.pkl is not the state of any object it records (1 registered)"
    else:  # plain data that loads safely, but no run state of this step: copied or crafted, re-sealed
        if change == "another step":
            shutil.copy(checkpoint_dir(tmp_path, 1) / "custom_checkpoint_0.pkl", ckpt / "custom_checkpoint_0.pkl")
        else:
            torch.save({"step": 2}, ckpt / "custom_checkpoint_0.pkl")
        _reseal(ckpt, "custom_checkpoint_0.pkl")
        expected = "custom_checkpoint_0.pkl does not hold the run's state at step 2 (a position and the schedules)"
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    with caplog.at_level("WARNING"):
        assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) == checkpoint_dir(tmp_path, 1)
    assert f"skipping damaged checkpoint {ckpt}: {expected}" in caplog.text


def test_a_train_state_carries_nothing_beside_its_fields(tmp_path):
    """What resume and save need travels as fields (a copy made with dataclasses.replace keeps it) or
    is derived from the accelerator: no attribute beside them, after for_run, a resume and a save."""
    import dataclasses

    from common.config import RunConfig

    state = TrainState.for_run(RunConfig(), 1, 1)
    assert dataclasses.replace(state).config_defaults["max_steps"] == 1000
    accelerator, model, opt, sched, _ = setup()
    parts = dict(models=model, optimizers=opt, schedulers=sched)
    _resume(accelerator, None, state, **parts)
    _save(accelerator, tmp_path, state, **parts)
    # `stage`: declared on the class (where the loop stands, never saved)
    assert set(vars(state)) == {f.name for f in dataclasses.fields(TrainState)} | {"stage"}


def test_a_checkpoint_with_a_malformed_marker_is_skipped_for_the_previous(tmp_path, caplog):
    accelerator, model, opt, sched, state = setup()
    for step in (1, 2):
        train_step(model, opt, sched)
        state.step = step
        ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    marker = json.loads((ckpt / "COMPLETE").read_text())
    marker["files"]["model.safetensors"] = 7
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    with caplog.at_level("WARNING"):
        assert choose_checkpoint(setup(seed=1)[0], tmp_path) == checkpoint_dir(tmp_path, 1)
    assert (f"skipping damaged checkpoint {ckpt}: malformed COMPLETE marker (entry 'model.safetensors' has no "
            f"byte count)") in caplog.text


def test_a_checkpoint_holding_a_fifo_is_skipped_without_opening_it(tmp_path, caplog):
    """An unlisted FIFO among a checkpoint's pickles would block the safe-load check for ever: the
    checkpoint is skipped as damaged, for the one before it."""
    accelerator, model, opt, sched, state = setup()
    for step in (1, 2):
        train_step(model, opt, sched)
        state.step = step
        ckpt = save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    os.mkfifo(ckpt / "scaler.pt")
    with caplog.at_level("WARNING"):
        assert choose_checkpoint(setup(seed=1)[0], tmp_path) == checkpoint_dir(tmp_path, 1)
    assert (f"skipping damaged checkpoint {ckpt}: scaler.pt is a FIFO (named pipe), not a regular "
            f"file") in caplog.text


# ---- every checkpoint damaged; --resume false; pruning only what a save supersedes ------------------


def two_checkpoints(tmp_path):
    """Checkpoints of steps 1 and 2 of a fresh run, with the run's parts."""
    accelerator, model, opt, sched, state = setup()
    for step in (1, 2):
        train_step(model, opt, sched)
        state.step = step
        save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    return accelerator, model, opt, sched, state


def test_when_no_checkpoint_is_usable_the_run_stops_naming_each_and_deletes_none(tmp_path, caplog):
    """Checkpoints exist but every one is damaged: one line naming each with its problem and the ways
    to start over, on every rank, instead of a fresh start that would save over them and prune them.
    A step folder without a marker counts (a partial copy); --resume false moves them aside."""
    two_checkpoints(tmp_path)
    _Evil.target = tmp_path / "pwned"
    for step in (1, 2):
        torch.save({"step": _Evil()}, checkpoint_dir(tmp_path, step) / "random_states_0.pkl")
        _reseal(checkpoint_dir(tmp_path, step), "random_states_0.pkl")
    for step in (3, 4, 5):  # partial copies; the fifth problem and after are counted, not listed
        shutil.copytree(checkpoint_dir(tmp_path, 1), checkpoint_dir(tmp_path, step))
        (checkpoint_dir(tmp_path, step) / "COMPLETE").unlink()
    with pytest.raises(RunError) as refused, caplog.at_level("WARNING"):
        choose_checkpoint(setup()[0], tmp_path)
    message = str(refused.value)
    assert message.startswith(f"no checkpoint in {tmp_path / 'checkpoints'} can be resumed, so nothing was loaded and "
                              f"nothing deleted: step_00000002 (random_states_0.pkl cannot be loaded safely "
                              f"(UnpicklingError: ")
    assert "; step_00000001 (random_states_0.pkl cannot be loaded safely" in message
    assert ("; step_00000005 (no COMPLETE marker: a partial copy, or files put there by hand); step_00000004 (no "
            "COMPLETE marker: a partial copy, or files put there by hand); and 1 more. Restore") in message
    assert message.endswith("Restore a good copy of one, or start over from step 0: --resume false (this folder's "
                            "checkpoints are moved to checkpoints.before_<time>/ beside it, not deleted) or a new "
                            "--output_dir")
    assert "\n" not in message and not _Evil.target.exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert "skipping damaged checkpoint" in caplog.text

    assert choose_checkpoint(setup()[0], tmp_path, resume=False) is None  # --resume false
    assert not (tmp_path / "checkpoints").exists()
    aside, = tmp_path.glob("checkpoints.before_*")
    assert sorted(p.name for p in aside.iterdir()) == [f"step_0000000{step}" for step in range(1, 6)]
    assert choose_checkpoint(setup()[0], tmp_path) is None  # the fresh run's own folder is empty


def test_a_save_prunes_only_the_checkpoints_it_supersedes(tmp_path):
    """Resumed from step 1 (steps 2 and 3 damaged, skipped), the save of step 2 with --save_total_limit 1
    replaces the damaged step 2 and prunes step 1; it neither counts the newer damaged step 3 (which
    pushed the new checkpoint out of the limit) nor deletes it (not this run's to delete)."""
    accelerator, model, opt, sched, state = two_checkpoints(tmp_path)
    state.step = 3
    save_checkpoint(accelerator, model, tmp_path, state, sched, save_total_limit=None)
    (checkpoint_dir(tmp_path, 3) / "optimizer.bin").write_bytes(b"damaged")
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    (checkpoint_dir(tmp_path, 2) / "optimizer.bin").write_bytes(b"damaged")
    assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) == checkpoint_dir(tmp_path, 1)
    train_step(model2, opt2, sched2)
    state2.step = 2
    save_checkpoint(accelerator2, model2, tmp_path, state2, sched2, save_total_limit=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert verify_checkpoint(checkpoint_dir(tmp_path, 2)) is None  # the new one, kept


def _tamper_run_state(ckpt, change):
    state = torch.load(ckpt / "custom_checkpoint_0.pkl", weights_only=True)
    change(state)
    torch.save(state, ckpt / "custom_checkpoint_0.pkl")
    _reseal(ckpt, "custom_checkpoint_0.pkl")


def _tamper_rng(ckpt, change):
    states = torch.load(ckpt / "random_states_0.pkl", weights_only=False)
    torch.save(change(states), ckpt / "random_states_0.pkl")
    _reseal(ckpt, "random_states_0.pkl")


@pytest.mark.parametrize("damage,expected", [
    ("a schedule the run lacks", "custom_checkpoint_0.pkl holds the schedules ['bogus'], train_state.json "
                                 "['scheduler']"),
    ("another schedule state", "custom_checkpoint_0.pkl differs from train_state.json in the state of the schedule "
                               "'scheduler' (a save writes both from the same state)"),
    ("another position", "custom_checkpoint_0.pkl differs from train_state.json in the position's epoch"),
    ("a class attribute", "custom_checkpoint_0.pkl holds 'stage', which is no field of the run's position "
                          "(TrainState)"),
    ("a counter of another type", "custom_checkpoint_0.pkl holds batches_in_epoch = 'x', not a whole number ≥ 0"),
    ("no RNG states", "random_states_0.pkl holds no random_state (python, numpy and torch RNG states"),
    ("an RNG state of another shape", "random_states_0.pkl holds RNG states that cannot be set (RuntimeError: "),
    ("a device RNG state of another type", "random_states_0.pkl holds torch_cuda_manual_seed that is no list of device "
                                          "generator states"),
    ("a missing RNG file", "random_states_0.pkl is missing (the RNG states of rank 0)"),
])
def test_a_run_state_or_rng_state_that_would_not_resume_as_saved_skips_the_checkpoint(tmp_path, caplog, damage,
                                                                                       expected):
    """Pickles that load with weights only but hold what no save wrote: a schedule the run lacks (a
    KeyError after the weights were loaded), a position unlike train_state.json's, a key that is no
    TrainState field, an RNG file accelerate would skip with an info line ({}): each is a damaged
    checkpoint, named, and the one before it is resumed from."""
    accelerator, model, opt, sched, state = two_checkpoints(tmp_path)
    ckpt = checkpoint_dir(tmp_path, 2)
    if damage == "a schedule the run lacks":
        _tamper_run_state(ckpt, lambda s: s.update(schedulers={"bogus": s["schedulers"]["scheduler"]}))
    elif damage == "another schedule state":
        _tamper_run_state(ckpt, lambda s: s["schedulers"]["scheduler"].update(last_epoch=7))
    elif damage == "another position":
        _tamper_run_state(ckpt, lambda s: s["train_state"].update(epoch=3))
    elif damage == "a class attribute":
        _tamper_run_state(ckpt, lambda s: s["train_state"].update(stage="window"))
    elif damage == "a counter of another type":
        _tamper_run_state(ckpt, lambda s: s["train_state"].update(batches_in_epoch="x"))
    elif damage == "no RNG states":
        _tamper_rng(ckpt, lambda s: {})
    elif damage == "an RNG state of another shape":
        _tamper_rng(ckpt, lambda s: {**s, "torch_manual_seed": torch.zeros(3, dtype=torch.uint8)})
    elif damage == "a device RNG state of another type":
        _tamper_rng(ckpt, lambda s: {**s, "torch_cuda_manual_seed": "x"})
    else:
        (ckpt / "random_states_0.pkl").unlink()
        marker = json.loads((ckpt / "COMPLETE").read_text())
        del marker["files"]["random_states_0.pkl"]
        (ckpt / "COMPLETE").write_text(json.dumps(marker))
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    with caplog.at_level("WARNING"):
        assert resume_from_checkpoint(accelerator2, tmp_path, state2, sched2) == checkpoint_dir(tmp_path, 1)
    assert f"skipping damaged checkpoint {ckpt}: {expected}" in caplog.text
    assert state2.step == 1 and state2.stage == "boundary"


def test_an_rng_state_changed_after_the_check_stops_the_resume_in_one_line(tmp_path):
    accelerator, model, opt, sched, state = two_checkpoints(tmp_path)
    accelerator2, model2, opt2, sched2, state2 = setup(seed=1)
    ckpt = choose_checkpoint(accelerator2, tmp_path)
    torch.save({}, ckpt / "random_states_0.pkl")
    with pytest.raises(RunError, match=rf"^{ckpt}: random_states_0.pkl holds no random_state .*; it changed after the "
                                       rf"checkpoint was checked at launch: move step_00000002 out of"):
        _resume(accelerator2, ckpt, state2, models=model2, optimizers=opt2, schedulers=sched2)


def test_a_position_is_loaded_into_fields_only():
    with pytest.raises(ContractError, match=r"\['stage'\] are no TrainState fields"):
        TrainState().load_state_dict({"step": 3, "stage": "window"})
