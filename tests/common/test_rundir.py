"""One run per output folder, and only a run of this recipe (common/rundir.py)."""

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from common.rundir import LOCK, RUN_MARKER, claim_output_dir

MAIN = SimpleNamespace(is_main_process=True, num_processes=1)


def test_claim_writes_the_marker_and_a_live_lock_refuses_a_second_run(tmp_path):
    out = tmp_path / "run"
    claim_output_dir(MAIN, out, "best_rq")
    assert json.loads((out / RUN_MARKER).read_text())["recipe"] == "best_rq"
    holder = json.loads((out / LOCK).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(SystemExit, match=f"is in use by {socket.gethostname()}:{os.getpid()}"):
        claim_output_dir(MAIN, out, "best_rq")


def test_a_dead_local_holder_is_taken_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text(json.dumps({"recipe": "asr"}))
    dead = subprocess.run([sys.executable, "-c", "import os, time; print(os.getpid(), time.time())"],
                          capture_output=True, text=True).stdout.split()
    (out / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead[0]), "started": float(dead[1])}))
    claim_output_dir(MAIN, out, "asr")
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()


@pytest.mark.parametrize("age_s,refused", [(5, True), (3600, False)])
def test_a_remote_holder_is_judged_by_its_heartbeat(tmp_path, age_s, refused):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text(json.dumps({"recipe": "tts"}))
    (out / LOCK).write_text(json.dumps({"host": "other-node", "pid": 1, "started": 0.0}))
    os.utime(out / LOCK, (time.time() - age_s, time.time() - age_s))
    if refused:
        with pytest.raises(SystemExit, match="in use by other-node:1"):
            claim_output_dir(MAIN, out, "tts")
    else:
        claim_output_dir(MAIN, out, "tts")


def test_foreign_or_other_recipe_folders_are_refused_unless_overwrite(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"not a run of this repository \(notes.txt\).*--overwrite_output_dir"):
        claim_output_dir(MAIN, out, "asr")
    assert not (out / LOCK).exists() and not (out / RUN_MARKER).exists()
    claim_output_dir(MAIN, out, "asr", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    (out / LOCK).unlink()
    with pytest.raises(SystemExit, match="holds a run of the 'asr' recipe, not 'tts'"):
        claim_output_dir(MAIN, out, "tts")
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_output_dir(MAIN, empty, "tts")  # an empty folder is fine
