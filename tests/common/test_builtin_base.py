"""The built-in base's cache (common/training/builtin_base.py)."""

import json

import pytest

from common.training.builtin_base import base_folder, builtin_base
from common.training.checkpoint import MARKER, seal_export
from common.training.faults import UsageError
from common.training.prepare import COMPLETE_MARKER


def test_a_damaged_cached_base_names_the_cache_folder_to_delete(tmp_path):
    """A cached base is made by no training command of the user's: its refusal names the cache folder to
    delete (the next run rebuilds it), in one line, before anything reads it; no child is started."""
    script = tmp_path / "recipe" / "train.py"
    script.parent.mkdir()
    script.write_text("raise SystemExit('never run: the base is cached')\n")
    args = ["--data_dir", "none"]
    folder = base_folder(script, args, str(tmp_path / "cache"))
    (folder / "final").mkdir(parents=True)
    (folder / "final" / "model.safetensors").write_bytes(b"weights")
    seal_export(folder / "final")
    (folder / COMPLETE_MARKER).write_text(json.dumps({"command": []}))
    assert builtin_base(script, args, str(tmp_path / "cache")) == folder
    (folder / "final" / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(UsageError) as e:
        builtin_base(script, args, str(tmp_path / "cache"))
    assert str(e.value) == (f"--init_from builtin: the cached base {folder}/final: damaged (model.safetensors is "
                            f"corrupted (digest mismatch)): it is a cache: delete {folder} and re-run this command, "
                            f"which rebuilds it (exported again from its training run {folder}.run, or trained "
                            f"again if that is gone)")
    (folder / "final" / MARKER).unlink()
    with pytest.raises(UsageError, match=f"no COMPLETE marker.*it is a cache: delete {folder} and re-run"):
        builtin_base(script, args, str(tmp_path / "cache"))
