"""The SSL evaluation protocol's mechanics (recipes/asr/ssl_protocol.sh): the fixed labelled subsets
committed in recipes/asr/subsets/, `--train_subset` training on exactly those utterances, and the
fine-tuning option `--layer_decay`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.recipe_import import recipe_modules
from tests.recipes.harness import ROOT, python, run
from tests.recipes.test_asr import TINY
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
    models = asr.train.build_models(cfg, SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=29)))
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
        asr.train.Config(), SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=29))))[0]["model"]
    assert [g["initial_lr"] for g in plain.param_groups] == [1e-3, 1e-3, 5e-4, 5e-4]


@pytest.mark.parametrize("args, message", [
    (["--train_subset", "2h"], "--train_subset 2h: no such file"),
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
