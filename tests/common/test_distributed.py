import pytest

from common import distributed
from common.distributed import build_accelerator


def test_refuses_when_processes_did_not_form_one_group(monkeypatch):
    """The launcher says 2 processes, but this one is alone: the silent 2x run must not start."""
    monkeypatch.setattr(distributed, "launcher_world_size", lambda: 2)
    with pytest.raises(RuntimeError, match="started 2 processes but this one joined a process group of 1"):
        build_accelerator(cpu=True)


def test_single_process_is_fine():
    accelerator = build_accelerator(cpu=True)
    assert accelerator.num_processes == 1
