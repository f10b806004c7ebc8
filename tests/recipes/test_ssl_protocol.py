"""The SSL evaluation protocol's mechanics (recipes/asr/ssl_protocol.sh): the fixed labelled subsets
committed in recipes/asr/subsets/, `--train_subset` training on exactly those utterances, and the
fine-tuning option `--layer_decay`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tests.harness.recipe_import import recipe_modules
from tests.harness.harness import ROOT, python, run
from tests.recipes.test_asr import TINY
from tests.tools.test_report import read_page
from tools import corpus

asr = recipe_modules("asr", "train")
SUBSETS = ROOT / "recipes" / "asr" / "subsets"


def _ids(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


def test_committed_subsets_are_the_selection_rule_applied_to_ssl10h(tmp_path):
    """10min.txt (and 1h.txt, once ssl_protocol.sh wrote it) are the first clean ssl10h training
    utterances in hash order (what `python -m tools.corpus --profile ssl10h --subset SECONDS` prints),
    nested, lasting what their header says. Planned without audio: durations are the headers'."""
    jobs, _ = corpus._plan_ssl(tmp_path, "ssl10h")
    train = [(Path(job[0]).stem, job[5]) for job in jobs if job[5] is not None]
    clean = sorted((utt_id for utt_id, aug in train if aug.clean),
                   key=lambda utt_id: hashlib.blake2b(utt_id.encode(), digest_size=8).digest())
    subsets = {600: SUBSETS / "10min.txt", 3600: SUBSETS / "1h.txt"}
    assert subsets[600].is_file()
    for seconds, path in subsets.items():
        if not path.is_file():
            continue
        ids = _ids(path)
        assert ids == sorted(clean[: len(ids)])
        header = path.read_text().splitlines()[0]
        assert "profile ssl10h" in header and f"--subset {seconds})" in header
        stated = float(header.split(" s (")[0].rsplit(", ", 1)[1])
        assert seconds <= stated < seconds + 10
        assert seconds / 3.5 < len(ids) < seconds / 2  # ~2.5 s per utterance
    if subsets[3600].is_file():
        assert set(_ids(subsets[600])) < set(_ids(subsets[3600]))


def test_layer_decay_groups(tmp_path):
    cfg = asr.train.Config(num_layers=3, hidden_size=32, num_heads=2, ffn_dim=64, learning_rate=1e-3,
                           encoder_lr_scale=0.5, layer_decay=0.5)
    models = asr.train.build_models(cfg, SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=29), resumes=False, summary={}, recorded={}))
    model, optimizer = models["model"], asr.train.build_optimizers(cfg, models)[0]["model"]
    lrs = {id(p): g["initial_lr"] for g in optimizer.param_groups for p in g["params"]}  # lr: after the warm-up factor
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(lrs) == len(list(model.parameters()))
    assert {lrs[id(p)] for p in model.head.parameters()} == {1e-3}
    layers = model.encoder.encoder.layers
    for k, layer in enumerate(layers):  # the top block at 0.5 × 1e-3, each lower one halved
        assert [lrs[id(p)] for p in layer.parameters()] == pytest.approx([5e-4 * 0.5 ** (len(layers) - 1 - k)]
                                                                         * len(list(layer.parameters())))
    assert lrs[id(model.encoder.feature_projection.projection.weight)] == pytest.approx(5e-4 * 0.5**3)
    # 1 (the default): the head's two groups and the encoder's two, at encoder_lr_scale
    plain = asr.train.build_optimizers(asr.train.Config(encoder_lr_scale=0.5, learning_rate=1e-3), asr.train.build_models(
        asr.train.Config(), SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=29), resumes=False, summary={}, recorded={})))[0]["model"]
    assert [g["initial_lr"] for g in plain.param_groups] == [1e-3, 1e-3, 5e-4, 5e-4]


@pytest.mark.parametrize("args, message", [
    (["--train_subset", "2h"], "--train_subset: 2h is not 10min, 1h"),
    (["--train_subset", "10min", "--train_fraction", "0.5"], "set one"),
])
def test_train_subset_config_mistakes(args, message):
    proc = python([ROOT / "recipes" / "asr" / "train.py", *args])
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_train_subset_trains_on_exactly_its_ids(ssltiny_corpus, tmp_path):
    """A subset file (a comment line and 3 ids): every batch of the run is drawn from those 3; a file
    naming an utterance the data lacks is refused in one line (the named subsets are ssl10h's)."""
    chosen = corpus.labelled_subset_ids(ssltiny_corpus, 5)[:3]
    subset = tmp_path / "three.txt"
    subset.write_text("# three clean utterances\n" + "\n".join(chosen) + "\n")
    out = tmp_path / "asr"
    run("asr", 1, ["--data_dir", str(ssltiny_corpus / "librispeech"), "--output_dir", str(out), *TINY,
                   "--train_subset", str(subset), "--max_steps", "3", "--eval_steps", "0", "--save_steps", "3",
                   "--dump_batch_ids", "true"])
    batches = [json.loads(line)["ids"] for line in (out / "batch_ids.rank0.jsonl").read_text().splitlines()]
    assert len(batches) >= 3 and {i for ids in batches for i in ids} == set(chosen)
    log = run("asr", 1, ["--data_dir", str(ssltiny_corpus / "librispeech"), "--output_dir", str(tmp_path / "named"),
                         *TINY, "--train_subset", "10min", "--max_steps", "1"], expect_rc=1)
    assert "--train_subset 10min: " in log and "utterance ids are missing" in log and "ssl10h" in log


# Stand-ins for `accelerate` and `python` (ssl_protocol.sh's ACCELERATE and PYTHON): each "run"
# writes the output its stage waits for, after SLEEP seconds; a training run whose output_dir
# contains $FAIL fails. The report (python -) is the real interpreter.
_FAKE_LAUNCHER = r"""#!/usr/bin/env bash
shift; script=$1; shift; out=""; ckpt=""; output=""
while [ $# -gt 0 ]; do case $1 in --output_dir) out=$2; shift;; --checkpoint) ckpt=$2; shift;; --output) output=$2; shift;; esac; shift; done
echo "$script ${out}${ckpt}${output:+ lm}" >> "$RUNS_LOG"
sleep "${SLEEP:-0}"
case $script in
  */train.py) if [ -n "${FAIL:-}" ] && [[ $out == *"$FAIL" ]]; then exit 1; fi
              mkdir -p "$out/final"; printf 'max_batch_seconds: 60\nseed: 42\n' > "$out/final/config.yaml"; touch "$out/final/COMPLETE";;
  */decode.py) if [ -n "$output" ]; then mkdir -p "$output"; echo '{"cer": 0.1, "wer": 0.3}' > "$output/test-lm.json"
               else mkdir -p "$ckpt/decode/final"; echo '{"cer": 0.2, "wer": 0.5}' > "$ckpt/decode/final/test-greedy.json"; fi;;
esac
"""
_FAKE_PYTHON = r"""#!/usr/bin/env bash
case $1 in
  -m) exit 0;;  # tools.corpus
  recipes/asr/lm.py) mkdir -p "$OUT/lm";;
  recipes/asr/decode.py) echo "  --lm DIR";;  # --help
  *) exec "$REAL_PYTHON" "$@";;
esac
"""


def _protocol(tmp_path, **env):
    for name, text in (("accelerate", _FAKE_LAUNCHER), ("python", _FAKE_PYTHON)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    full = {**os.environ, "ACCELERATE": str(tmp_path / "accelerate"), "PYTHON": str(tmp_path / "python"),
            "REAL_PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "RUNS_LOG": str(tmp_path / "runs.log"),
            "SUBSETS": "10min", "PROBE_STEPS": "1000", **env}
    return subprocess.Popen(["bash", str(ROOT / "recipes/asr/ssl_protocol.sh")], env=full, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_protocol_script_runs_stages_in_parallel_stops_on_failure_and_resumes(tmp_path):
    """JOBS=2: the fine-tunings run two at a time; one that fails stops the script after the others
    end, naming the stage and its log; re-running runs only what is missing and reports the wall
    times of the stages done before (not "done before")."""
    out, runs_log = tmp_path / "out", tmp_path / "runs.log"
    first = _protocol(tmp_path, JOBS="2", FAIL="best_rq_10min", SLEEP="1")
    text, _ = first.communicate(timeout=120)
    assert first.returncode == 1, text
    assert "stage failed: ASR 10min, BEST-RQ init (its log: " in text
    assert (out / "logs" / "ASR_10min__BEST-RQ_init.log").is_file()
    ran = runs_log.read_text().splitlines()
    assert len(ran) == 4 and not any("decode.py" in line for line in ran)  # pre-training + 3 fine-tunings
    times = dict(line.split("\t") for line in (out / "times.tsv").read_text().splitlines())
    assert times["ASR 10min, scratch"].isdigit() and "ASR 10min, BEST-RQ init" not in times

    runs_log.unlink()
    second = _protocol(tmp_path, JOBS="2")
    text, _ = second.communicate(timeout=120)
    assert second.returncode == 0, text
    ran = runs_log.read_text().splitlines()
    assert [line for line in ran if "train.py" in line] == [f"recipes/asr/train.py {out}/best_rq_10min"]
    assert len([line for line in ran if "decode.py" in line]) == 6  # 3 runs, greedy and LM
    table = text.split("| stage | wall time |")[1]
    assert "done before" not in table and re.search(r"\| BEST-RQ pre-training, 12000 steps \| 0 min \d+ s \|", table)
    assert "| 10min | scratch | 20.0 | 50.0 | 10.0 | 30.0 |" in text
    shown, page = read_page(out / "report.html")  # the same table as a page
    assert [(r["id"], r["cer"], r["wer"], r["lm_cer"], r["lm_wer"]) for r in page["rows"]] == [
        (run, 0.2, 0.5, 0.1, 0.3) for run in ("scratch_10min", "best_rq_10min", "best_rq-step1000_10min")]
    assert shown["corpus"] == "ssl10h" and "bash recipes/asr/ssl_protocol.sh" in (out / "report.html").read_text()


def test_protocol_script_interrupted_stops_its_runs(tmp_path):
    """A TERM to the script reaches the trap at once (a stage runs in the background, the script
    waits) and ends every run in flight: no training outlives the script."""
    proc = _protocol(tmp_path, JOBS="2", SLEEP="30")
    def sleeping(children):
        names = []
        for child in children:
            try:
                names.append(" ".join(child.cmdline()))
            except psutil.Error:  # gone meanwhile
                pass
        return any(name.startswith("sleep") for name in names)

    deadline = time.monotonic() + 120  # until the first stand-in run is in its sleep (only a hang fails)
    children = []
    while not sleeping(children) and time.monotonic() < deadline:
        time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
    assert sleeping(children)
    proc.terminate()
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [c.cmdline() for c in alive]
