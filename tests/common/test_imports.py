"""The import graph of common/: no module imports another that imports it back (directly or
around a longer circle), and no module takes a private name (`_x`) out of another. Imports inside
functions count too: a deferred import hides a circle from the interpreter, not from a reader."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMON = ROOT / "common"


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module of common/ imported, as its dotted name under common (`data.source`), names taken from
    it, line) for every import in `path`. `from common.data import source` imports `data.source`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("common."):
            module = node.module[len("common."):]
            if "." not in module and all(not a.name.startswith("_") and a.name.islower() and
                                         (COMMON / module / f"{a.name}.py").exists() for a in node.names):
                found += [(f"{module}.{a.name}", [], node.lineno) for a in node.names]  # submodules
            else:
                found.append((module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name[len("common."):], [], node.lineno) for a in node.names if a.name.startswith("common.")]
    return found


def module_name(path: Path, folder: Path) -> str:
    """common/data/source.py → "data.source"; a package's __init__.py → the package ("data")."""
    parts = path.relative_to(folder).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph(folder: Path) -> dict[str, set[str]]:
    """{module: the modules of common/ it imports}, over every file under `folder` (the groups too)."""
    edges = {}
    for p in sorted(folder.rglob("*.py")):
        name = module_name(p, folder)
        edges[name] = {m for m, _, _ in imports(p) if m != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each circle of `edges` once, as the path that closes it (depth-first, from the sorted modules)."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            circle = path[path.index(node):]
            if not any(set(c) == set(circle) for c in found):
                found.append(circle + [node])
            return
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for start in sorted(edges):
        visit(start, [])
    return found


def test_common_has_no_import_circle():
    assert cycles(graph(ROOT / "common")) == []


def test_no_private_name_is_imported_across_modules():
    """Checked over common/, the recipes, tools/ and benchmarks/ (tests may reach inside); hidden
    folders are not ours (benchmarks/speechbrain/.venv, .sb_repo: another project's environment)."""
    files = [p for d in ("common", "recipes", "tools", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))
             if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    private = [f"{p.relative_to(ROOT)}:{line}: from common.{m} import {n}"
               for p in files for m, names, line in imports(p) for n in names if n.startswith("_")]
    assert private == []


def test_the_checks_can_fail():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert imports(ROOT / "tests/common/test_imports.py") == []  # this file imports nothing of common/


def test_the_groups_are_read_as_modules():
    """Modules in common/'s groups are nodes of the graph under their dotted names, and
    `from common.data import source` is an import of `data.source`."""
    edges = graph(COMMON)
    assert {"data.source", "data.stream", "training.sealing", "model.encoder", "config"} <= set(edges)
    assert "data.stream" in edges["data.source"] and "training.sealing" in edges["data.source"]
    assert imports(ROOT / "tests/common/training/test_distributed.py")[0][0] == "training.distributed"


def test_the_model_card_module_does_not_import_transformers():
    """`write_model_card` and `write_code` (every recipe's export, the vocoder's included) cost no
    transformers import (~1 s): only the functions that write a transformers folder import it."""
    import subprocess
    import sys

    code = "import sys, common.model.hf_export; print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def map_rows(readme: str) -> dict[str, str]:
    """common/README.md's map: {module path under common/ ("training/run.py"): its last column, what a
    recipe calls}, from the table rows that name a module."""
    rows = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[\w/]+\.py`", cells[0]):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def unlisted(rows: dict[str, str], files: list[Path]) -> list[str]:
    """"file:line: module name" for each name `files` import from common/ that its module's row does not
    list (in backquotes, alone or as `name.attribute`), and for a module without a row."""
    missing = []
    for p in files:
        for module, names, line in imports(p):
            path = module.replace(".", "/") + ".py"
            cell = rows.get(path)
            missing += [f"{p}:{line}: {path} {n}" for n in (names or ["(its row)"])
                        if cell is None or not re.search(rf"`{re.escape(n)}[`.]", cell)]
    return missing


def test_the_map_has_a_row_for_every_module_and_every_name_the_recipes_import():
    """common/README.md is the one map of common/: a new module, or a name a recipe starts to import
    from common/, fails here until its row says so."""
    rows = map_rows((COMMON / "README.md").read_text())
    modules = sorted(str(p.relative_to(COMMON)) for p in COMMON.rglob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if m not in rows] == []
    assert unlisted(rows, sorted((ROOT / "recipes").glob("*/*.py"))) == []


def test_the_map_check_can_fail(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from common.training.run import start_run, start_logging\nfrom common.data import cache\n"
                      "from common.data.source import Source\n")
    rows = {"training/run.py": "`start_run`", "data/source.py": "`Source.open`"}  # data/cache.py: no row
    assert [m.split(": ", 1)[1] for m in unlisted(rows, [script])] == [
        "training/run.py start_logging", "data/cache.py (its row)"]
    readme = "| module | owns | calls |\n|---|---|---|\n| `training/run.py` | the start | `start_run` |\n"
    assert map_rows(readme) == {"training/run.py": "`start_run`"}
