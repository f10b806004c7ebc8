"""What installing this repository claims, and which `common`/`tools` a recipe imports: generic
top-level names are another project's too (an installed `tools` hid another project's `tools/`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_distribution_installs_no_importable_name(tmp_path):
    """The wheel `pip install .` would install (an editable install maps the same packages) holds
    only its metadata: no top-level `common` or `tools` in site-packages. Built from a copy (the
    build writes beside its sources), without the network."""
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    for folder in ("common", "tools"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"speech_recipes-0.1.0.dist-info"}, tops


def test_a_recipe_imports_its_own_common_beside_anothers_on_the_path(tmp_path):
    """Another project's `common/` and `tools/`, in the working folder and first on PYTHONPATH, do not
    hide this checkout's from a recipe script (which puts its checkout's root first)."""
    theirs = tmp_path / "project"
    for name in ("common", "tools"):
        (theirs / name).mkdir(parents=True)
        (theirs / name / "__init__.py").write_text(f"raise ImportError('their {name}, imported by the recipe')\n")
    env = {**os.environ, "PYTHONPATH": str(theirs)}
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "asr" / "decode.py"), "--help"], cwd=theirs, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--checkpoint" in proc.stdout, proc.stderr[-2000:]
