"""common/ stays readable in one sitting per piece: no module over ~600 lines, no function over ~60
(docstring included). The limits below leave a small margin, so that a one-line fix does not trip
them; a module or function that outgrows them is split by concern (the way checkpoint.py became
sealing.py, state.py, checkpoint.py, checkpoint_checks.py and resume.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 640  # ~600
MAX_FUNCTION_LINES = 62  # ~60, from the `def` line to the last line of the body (its docstring included)


def oversized(files: list[Path]) -> list[str]:
    """"path: N lines" for each file over MAX_MODULE_LINES, "path:line name: N lines" for each
    function or method over MAX_FUNCTION_LINES."""
    found = []
    for path in files:
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_or_function_of_common_outgrows_its_size():
    assert oversized(sorted((ROOT / "common").rglob("*.py"))) == []


def test_the_size_check_can_fail(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # the def line makes it one too long
    (tmp_path / "big.py").write_text("def long():\n" + body + "\n" * MAX_MODULE_LINES)
    lines = 1 + MAX_FUNCTION_LINES + MAX_MODULE_LINES
    assert oversized([tmp_path / "big.py"]) == [f"big.py: {lines} lines", f"big.py:1 long: {MAX_FUNCTION_LINES + 1} lines"]
