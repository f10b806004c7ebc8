import subprocess
import sys

import pytest

from tests.harness.harness import ROOT

# A recipe's main that fails the given way, run by run_main in a process of its own (it ends in os._exit).
MAIN = """
import errno, sys
from common.training.faults import NonFiniteError, run_main
def main():
    kind = sys.argv[1]
    if kind == "disk_full":
        raise OSError(errno.ENOSPC, "No space left on device", "/data/cache/manifest.jsonl")
    if kind == "nonfinite":
        raise NonFiniteError("5 consecutive non-finite updates; stopping (last good checkpoint kept). Lower --learning_rate?")
    if kind == "segfault":  # a crash in native code: no Python exception, no except clause runs
        import ctypes
        ctypes.string_at(0)
    raise ValueError("a bug")
run_main(main)
"""


@pytest.mark.parametrize("kind,line", [
    ("disk_full", "[rank 0] error: the disk is full writing /data/cache/manifest.jsonl (No space left on device): "
                  "free space there, or point --output_dir / --data_cache_dir at a disk with room; re-running "
                  "resumes from the last complete checkpoint\n"),
    ("nonfinite", "[rank 0] error: 5 consecutive non-finite updates; stopping (last good checkpoint kept). Lower "
                  "--learning_rate?\n"),
])
def test_failures_with_a_known_fix_are_one_line(kind, line):
    done = subprocess.run([sys.executable, "-c", MAIN, kind], cwd=ROOT, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (1, line)


def test_a_bug_keeps_its_traceback():
    done = subprocess.run([sys.executable, "-c", MAIN, "bug"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" in done.stderr and "FAILED with ValueError" in done.stderr


def test_a_native_crash_prints_where_it_happened():
    """A segfault (in a kernel, a communication library, a decoder) ends the process without an
    exception: the Python stack of every thread is printed instead of nothing."""
    done = subprocess.run([sys.executable, "-c", MAIN, "segfault"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == -11 and "Fatal Python error: Segmentation fault" in done.stderr
    assert "in string_at" in done.stderr and "in main" in done.stderr, done.stderr
