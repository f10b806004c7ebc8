import os

import pytest
import torch

from common.training import distributed
from common.training.distributed import build_accelerator


def test_refuses_when_processes_did_not_form_one_group(monkeypatch):
    """The launcher says 2 processes, but this one is alone: the silent 2x run must not start."""
    monkeypatch.setattr(distributed, "launcher_world_size", lambda: 2)
    with pytest.raises(RuntimeError, match="started 2 processes but this one joined a process group of 1"):
        build_accelerator()


def test_single_process_is_fine():
    accelerator = build_accelerator()
    assert accelerator.num_processes == 1


@pytest.mark.parametrize("flag,env,expected,warned", [
    (None, {}, "no", False),  # no launcher: fp32
    (None, {"ACCELERATE_MIXED_PRECISION": "bf16"}, "bf16", False),  # the profile decides
    ("no", {"ACCELERATE_MIXED_PRECISION": "bf16"}, "no", True),  # the flag wins, and says so
    ("bf16", {"ACCELERATE_MIXED_PRECISION": "bf16"}, "bf16", False),
])
def test_precision_comes_from_the_profile_unless_the_flag_is_given(flag, env, expected, warned):
    from common.training.distributed import resolve_topology

    precision, warnings = resolve_topology(flag, cuda=False, bf16_ok=False, env=env)
    assert precision == expected and bool(warnings) == warned


@pytest.mark.parametrize("flag,env,cuda,bf16_ok,message", [
    ("fp16", {}, False, False, "fp16 mixed precision needs a GPU"),
    (None, {"ACCELERATE_MIXED_PRECISION": "bf16"}, True, False, "this GPU has no bf16 support"),
    # multi_gpu.yaml (8 processes) on a CPU-only machine: the cores are the devices
    (None, {"LOCAL_WORLD_SIZE": "100000"}, False, False, "100000 processes on this machine but no GPU and .* CPU core"),
])
def test_a_profile_that_cannot_be_honoured_is_refused(flag, env, cuda, bf16_ok, message):
    from common.training.distributed import resolve_topology
    from common.training.faults import RunError

    with pytest.raises(RunError, match=message):
        resolve_topology(flag, cuda=cuda, bf16_ok=bf16_ok, env=env)


# ---------------------------------------------------------------------------------------------
# Threads and workers: every core busy by default, the same count on resume
# ---------------------------------------------------------------------------------------------


def test_thread_plan_explicit_checkpoint_env_then_cores(monkeypatch):
    from common.training import distributed

    monkeypatch.setattr(distributed, "available_cores", lambda: 8)
    plan = distributed.plan_threads
    assert plan(3, 5, {"OMP_NUM_THREADS": "4"}) == (3, "--num_threads")  # the flag wins
    assert plan(0, 5, {"OMP_NUM_THREADS": "4"})[0] == 5  # a resume keeps the checkpoint's count
    assert plan(0, None, {"OMP_NUM_THREADS": "4"})[0] == 4  # the user's (or launch --cpu's) choice
    # accelerate launch's default OMP_NUM_THREADS=1 is not a choice: cores ÷ local processes
    assert plan(0, None, {"OMP_NUM_THREADS": "1"})[0] == 8
    assert plan(0, None, {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"})[0] == 4
    assert plan(0, None, {"LOCAL_WORLD_SIZE": "16"})[0] == 1  # never 0


def test_available_cores_respects_the_affinity_mask():
    from common.training.distributed import available_cores

    assert 1 <= available_cores() <= len(os.sched_getaffinity(0))


def test_workers_auto_cpu_none_gpu_some(monkeypatch):
    import torch

    from common.data.loading import auto_workers

    assert auto_workers(None, cuda=False) == 0  # a worker would take a core from the compute threads
    assert auto_workers(3, cuda=False) == 3  # explicit wins
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert auto_workers(None, cuda=True) == 4
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert auto_workers(None, cuda=True) == 1


def test_the_deepspeed_profile_without_deepspeed_installed_is_refused(monkeypatch):
    import importlib.util

    from common.training.distributed import resolve_topology
    from common.training.faults import RunError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RunError, match=r"needs the deepspeed package, which is not installed.*pip install deepspeed"):
        resolve_topology(None, cuda=True, bf16_ok=True, env={"ACCELERATE_USE_DEEPSPEED": "true"})


@pytest.mark.parametrize("built", ["MULTI_CPU", "NO", "MULTI_GPU"])
def test_a_deepspeed_profile_that_accelerate_did_not_honour_is_refused(built):
    from common.training.distributed import check_distributed_type
    from common.training.faults import RunError

    with pytest.raises(RunError, match=rf"the DeepSpeed profile needs GPUs.*accelerate built {built} instead.*cpu_ddp"):
        check_distributed_type(built, env={"ACCELERATE_USE_DEEPSPEED": "true"})
    check_distributed_type("DEEPSPEED", env={"ACCELERATE_USE_DEEPSPEED": "true"})  # honoured: accepted


@pytest.mark.parametrize("built", ["MULTI_CPU", "NO", "MULTI_GPU"])
def test_an_fsdp_profile_that_accelerate_did_not_honour_is_refused(built):
    from common.training.distributed import check_distributed_type
    from common.training.faults import RunError

    with pytest.raises(RunError, match=rf"the FSDP profile needs GPUs.*accelerate built {built} instead.*cpu_ddp.yaml"):
        check_distributed_type(built, env={"ACCELERATE_USE_FSDP": "true"})
    check_distributed_type("FSDP", env={"ACCELERATE_USE_FSDP": "true"})  # honoured: accepted
    check_distributed_type(built, env={})  # no FSDP asked: nothing to check


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)


def _accelerator(kind: str, wrap: list[str] | None):
    from types import SimpleNamespace

    return SimpleNamespace(distributed_type=SimpleNamespace(value=kind),
                           state=SimpleNamespace(fsdp_plugin=SimpleNamespace(transformer_cls_names_to_wrap=wrap)))


def test_an_fsdp_shard_unit_the_model_lacks_is_refused_naming_its_blocks():
    from common.training.distributed import check_fsdp_wrap
    from common.training.faults import RunError

    model = torch.nn.Sequential(torch.nn.ModuleList([_Block(), _Block()]), torch.nn.Linear(4, 2))
    with pytest.raises(RunError, match=r"shards at Wav2Vec2BertEncoderLayer, which this model does not have \(its "
                                       r"repeated blocks: _Block\); launch with .*--fsdp_transformer_layer_cls_to_wrap _Block"):
        check_fsdp_wrap(_accelerator("FSDP", ["Wav2Vec2BertEncoderLayer"]), model)
    check_fsdp_wrap(_accelerator("FSDP", ["_Block"]), model)  # present: accepted
    check_fsdp_wrap(_accelerator("MULTI_CPU", ["Wav2Vec2BertEncoderLayer"]), model)  # not FSDP: nothing to check
