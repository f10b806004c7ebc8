"""Two simulated nodes on one machine (`--num_machines 2`, one process each): the built-in corpus
is prepared once per cache folder, whether the folder is shared by both nodes or local to each,
with the second node starting later than the first."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.harness import ROOT, cpu_tokens, free_port, kill_tree, metrics, on_cores
from tests.recipes.test_best_rq import TINY

pytestmark = pytest.mark.slow


def launch_node(rank: int, port: int, out: Path, cache: Path, log: Path, cpus) -> subprocess.Popen:
    """Node `rank`'s launcher, on the core cpus[rank] of the test's CPU tokens (None: any core)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "2",
           "--machine_rank", str(rank), "--num_processes", "2", "--main_process_ip", "127.0.0.1",
           "--main_process_port", str(port), "--rdzv_backend", "static", "--mixed_precision", "no",
           "--dynamo_backend", "no",
           str(ROOT / "recipes" / "best_rq" / "train.py"), "--builtin_corpus", "tiny",
           "--data_cache_dir", str(cache), "--output_dir", str(out), *TINY,
           "--max_batch_seconds", "16", "--max_steps", "3"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=on_cores(cpus and [cpus[rank % len(cpus)]]))


@pytest.mark.parametrize("shared", [True, False], ids=["shared-cache", "node-local-cache"])
def test_two_nodes_prepare_the_corpus_once_per_cache(tmp_path, shared):
    port, out = free_port(), tmp_path / "run"
    caches = [tmp_path / "cache"] * 2 if shared else [tmp_path / "node0-cache", tmp_path / "node1-cache"]
    logs = [tmp_path / f"node{r}.log" for r in (0, 1)]
    with cpu_tokens(2) as cpus:
        nodes = [launch_node(0, port, out, caches[0], logs[0], cpus)]
        time.sleep(4)  # the second node comes later
        nodes.append(launch_node(1, port, out, caches[1], logs[1], cpus))
        try:
            for node in nodes:
                node.wait(timeout=300)
        finally:
            for node in nodes:
                if node.poll() is None:
                    kill_tree(node)
    texts = [log.read_text(errors="replace") for log in logs]
    assert [n.returncode for n in nodes] == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    builds = [len(re.findall(r"preparing \S*espeak_corpus", t)) for t in texts]
    if shared:
        assert sum(builds) == 1  # one node built, the other waited for the marker
        assert sum(len(re.findall(r"waiting for \S*espeak_corpus", t)) for t in texts) == 1
    else:
        assert builds == [1, 1]  # each node its own copy
    for cache in set(caches):
        [corpus] = cache.glob("espeak_corpus-tiny-*")
        assert (corpus / ".complete").is_file()
        assert not list(cache.glob("*.lock")) and not list(cache.glob("*.tmp-*"))
    assert "2 process(es)" in texts[0]  # one process group across the two nodes
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
