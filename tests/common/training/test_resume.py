"""The resume plan (common/training/resume.py) on its own: the global batch a checkpoint fixes and the
DeepSpeed layout it needs. (Resuming real checkpoints: test_checkpoint.py.)"""

import json

import pytest

from common.training.state import TrainState


@pytest.mark.parametrize("world,accum,expected", [
    (2, 1, (1, 2)),  # unchanged
    (1, 1, (2, 2)),  # 2 processes × 1 → 1 process × 2 (the flag kept as at the first launch)
    (1, 2, (2, 2)),  # the flag changed, consistently
    (4, 1, (1, 4)),  # 4 processes cannot split 2 micro-batches: refused at resume (below)
    (2, 3, (3, 6)),  # 2 × 3 != 2: likewise
])
def test_global_batch_plan_keeps_the_global_batch_or_refuses(tmp_path, world, accum, expected):
    from common.training.resume import _global_batch_problem, global_batch_plan

    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    saved = {"world_size": 2, "gradient_accumulation_steps": 1, "global_batch": 2}
    (ckpt / "train_state.json").write_text(json.dumps(saved))
    assert global_batch_plan(None, world, accum) == (accum, world * accum)
    plan = global_batch_plan(ckpt, world, accum)
    assert plan == expected
    state = TrainState(world_size=world, gradient_accumulation_steps=plan[0], global_batch=plan[1])
    problem = _global_batch_problem(saved, state)
    if plan[1] == 2:
        assert problem is None
    else:
        assert "processes × accumulation that keep it: 1 × 2, 2 × 1" in problem


def test_deepspeed_checkpoints_resume_only_under_deepspeed_on_as_many_processes(tmp_path):
    from types import SimpleNamespace

    from common.training.resume import _deepspeed_problem

    def accelerator(kind, n):
        return SimpleNamespace(distributed_type=SimpleNamespace(value=kind), num_processes=n)

    ddp, ds = tmp_path / "ddp", tmp_path / "ds"
    ddp.mkdir()
    (ds / "pytorch_model").mkdir(parents=True)  # DeepSpeed's layout (accelerate's ckpt_id)
    assert _deepspeed_problem(ddp, {"world_size": 2}, accelerator("MULTI_CPU", 1)) is None
    assert _deepspeed_problem(ds, {"world_size": 2}, accelerator("DEEPSPEED", 2)) is None
    assert "written without DeepSpeed" in _deepspeed_problem(ddp, {"world_size": 2}, accelerator("DEEPSPEED", 2))
    assert "written with DeepSpeed" in _deepspeed_problem(ds, {"world_size": 2}, accelerator("MULTI_CPU", 2))
    assert "launch with --num_processes 2" in _deepspeed_problem(ds, {"world_size": 2}, accelerator("DEEPSPEED", 1))
