"""Importing the code an exported `final/` carries (`import_export`), only from its sealed source: the
folder is verified first (`common.training.sealing.resolve_checkpoint`) and each module's bytes are
checked against the marker's digest as they are read; never from bytecode.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

from common.training.faults import UsageError
from common.training.sealing import RE_EXPORT, read_marker, resolve_checkpoint

class _SealedSource(importlib.machinery.SourceFileLoader):
    """Imports a module from a sealed folder's own source, and only if its bytes are the sealed ones:
    never from bytecode (`__pycache__/` is not sealed, and Python would run a planted .pyc whose
    recorded source size and time match), and writes none."""

    def __init__(self, name: str, path: str, sha256: str):
        super().__init__(name, path)
        self.sha256 = sha256

    def path_stats(self, path):
        # SourceLoader.get_code treats an OSError here as "no source time": it then compiles the
        # source and neither reads nor writes a .pyc (importlib._bootstrap_external, Python 3.9-3.13)
        raise OSError("sealed source: no bytecode cache")

    def get_data(self, path):
        data = super().get_data(path)
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise UsageError(f"{path} changed after its folder was verified: not imported: {RE_EXPORT}")
        return data


class _SealedFinder(importlib.abc.MetaPathFinder):
    """Finds a sealed folder's top-level modules by their own names; in `sys.meta_path` only while
    `import_export` imports one of them."""

    def __init__(self, folder: Path, modules: dict[str, str]):
        self.folder, self.modules = folder, modules

    def find_spec(self, name, path=None, target=None):
        if name not in self.modules:
            return None
        file = str(self.folder / f"{name}.py")
        return importlib.util.spec_from_file_location(name, file, loader=_SealedSource(name, file, self.modules[name]))


def import_export(folder: str | Path, module: str):
    """Import `module` (e.g. "tts_model") from an exported `final/` outside this repository: the
    folder is verified first (`resolve_checkpoint`), and the module and the folder's modules it
    imports come from their sealed source, checked against the marker's digests as they are read.
    (A plain `sys.path.insert(0, folder)` + `import` runs the folder's code before anything checks it.)

    Scope: the folder's modules are found, by their own names, only during this call (the finder
    leaves `sys.meta_path` when it returns): a later import of any other name never reaches the
    folder. They import each other at the top, as the exports' code does (`write_code`); what they
    imported stays in `sys.modules` under those names, as any import does. A sealed module whose name
    is already taken, by the standard library (`json.py`), by a module this process can import from
    elsewhere, or by another export imported before, is refused in one line before anything is
    imported: while the finder is in place it would replace that module for every importer (a
    library importing `json` meanwhile), and one process holds one module per name. Why not import
    them under private names instead (`_export_1.json`), which nothing could shadow: the exports'
    code imports its siblings by plain names (`from tts_frontend import ...`), and their classes
    carry their module's name; `write_code` prefixes every exported module (`tts_`, `vocoder_`), so
    plain names collide with nothing."""
    folder = resolve_checkpoint(folder, flag="import_export")
    files = read_marker(folder)["files"]
    modules = {name[:-3]: meta["sha256"] for name, meta in files.items()
               if name.endswith(".py") and "/" not in name and "sha256" in meta}
    if module not in modules:
        raise UsageError(f"{folder}: no sealed {module}.py in it (sealed modules: {', '.join(sorted(modules)) or 'none'})")
    for name in sorted(modules):
        taken = _name_taken(name, folder)
        if taken:
            # imported from elsewhere (another export, perhaps): a process of its own has not imported it
            imported = name in sys.modules and name not in sys.stdlib_module_names
            raise UsageError(f"{folder}: its sealed {name}.py has the name of {taken}: rename it in the export "
                             f"(and its imports)" + (", or load this export's code in a process of its own"
                                                     if imported else ""))
    finder = _SealedFinder(folder, modules)
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(module)
    finally:
        sys.meta_path.remove(finder)


def _name_taken(name: str, folder: Path) -> str | None:
    """What else module `name` is in this process, in words (None: only `folder`'s `name`.py)."""
    mine = (folder / f"{name}.py").resolve()
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return f"the standard library's {name} module"
    loaded = sys.modules.get(name)
    if loaded is not None:
        file = getattr(loaded, "__file__", None)
        if file and Path(file).resolve() == mine:
            return None
        return f"another module (this process already imported {name} from {file})"
    for finder in sys.meta_path:  # what `import name` would find without the export
        try:
            spec = finder.find_spec(name, None)
        except Exception:  # noqa: BLE001 — a third-party finder's own failure is no answer
            continue
        if spec is not None:
            origin = spec.origin if spec.has_location else None
            if origin and Path(origin).resolve() == mine:
                return None
            return f"another module ({name} at {origin or spec.name})"
    return None
