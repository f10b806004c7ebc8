"""Importing an export's own code (common/training/sealed_import.py): only its sealed source, only during
the import, never under a name another module has."""

import os
import shutil

import pytest

from tests.common.training.test_sealing import seal


def test_import_export_runs_only_the_sealed_source(tmp_path, monkeypatch):
    """Outside the repository an export's code is imported through `import_export`: the folder is
    verified, its modules (and those they import from it) come from their sealed source, never
    from a planted `__pycache__/` .pyc that a plain import would run, and none is written."""
    import importlib.util
    import py_compile
    import sys

    from common.training.sealed_import import import_export
    from common.training.faults import UsageError

    final = seal(tmp_path / "final", {"model.safetensors": "x", "config.yaml": "a: 1\n",
                                      "sealed_b.py": "VALUE = 'good'\n",
                                      "sealed_a.py": "from sealed_b import VALUE\n"})
    # A .pyc of other code whose header (source size and time) matches sealed_b.py: a plain import runs it.
    evil = tmp_path / "evil" / "sealed_b.py"
    evil.parent.mkdir()
    evil.write_text("VALUE = 'evil'\n")
    stat = (final / "sealed_b.py").stat()
    os.utime(evil, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    py_compile.compile(str(evil), cfile=importlib.util.cache_from_source(str(final / "sealed_b.py")), doraise=True)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("sealed_a", "sealed_b"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert import_export(final, "sealed_a").VALUE == "good"
    assert [p.name for p in (final / "__pycache__").iterdir()] == ["sealed_b.cpython-%d%d.pyc" % sys.version_info[:2]]
    with pytest.raises(UsageError, match="no sealed missing.py in it"):
        import_export(final, "missing")
    other = shutil.copytree(final, tmp_path / "other", ignore=shutil.ignore_patterns("__pycache__"))
    with pytest.raises(UsageError, match=f"already imported sealed_a from {final}/sealed_a.py"):
        import_export(other, "sealed_a")
    (final / "sealed_b.py").write_text("VALUE = 'edit'\n")
    with pytest.raises(UsageError, match="sealed_b.py is corrupted"):
        import_export(final, "sealed_a")


def test_import_export_finds_the_folder_only_during_its_import(tmp_path, monkeypatch):
    """The export's finder leaves `sys.meta_path` when `import_export` returns: a later import of a
    sibling it did not import, or of any other name, never reaches the folder."""
    import sys

    from common.training.sealed_import import import_export, _SealedFinder

    final = seal(tmp_path / "final", {"model.safetensors": "x", "config.yaml": "a: 1\n",
                                      "scoped_a.py": "from scoped_b import VALUE\n", "scoped_b.py": "VALUE = 1\n",
                                      "scoped_c.py": "VALUE = 'from the export'\n"})
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("scoped_a", "scoped_b", "scoped_c"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert import_export(final, "scoped_a").VALUE == 1  # its sibling, by its name, during the import
    assert not any(isinstance(f, _SealedFinder) for f in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        import scoped_c  # noqa: F401 — not imported by scoped_a: not reachable afterwards


@pytest.mark.parametrize("name", ["colorsys", "json"])
def test_import_export_refuses_a_module_that_shadows_another(tmp_path, monkeypatch, name):
    """A sealed module named like a standard-library one (imported yet or not) is refused in one line
    that says so, before anything is imported: during the import it would replace that module for
    every importer."""
    import sys

    from common.training.sealed_import import import_export
    from common.training.faults import UsageError

    final = seal(tmp_path / "final", {"model.safetensors": "x", "config.yaml": "a: 1\n",
                                      "shadow_model.py": "VALUE = 1\n", f"{name}.py": "PLANTED = True\n"})
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, "shadow_model", raising=False)
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    with pytest.raises(UsageError) as e:
        import_export(final, "shadow_model")
    assert str(e.value) == (f"{final}: its sealed {name}.py has the name of the standard library's {name} module: "
                            f"rename it in the export (and its imports)")
    assert "shadow_model" not in sys.modules
    import colorsys
    import json as json_module

    assert not hasattr(colorsys, "PLANTED") and not hasattr(json_module, "PLANTED")
