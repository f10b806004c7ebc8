"""The SpeechBrain CSV bridge (benchmarks/speechbrain/bridge.py): no SpeechBrain, no network."""

import csv
import importlib.util
from pathlib import Path

import pytest
import soundfile as sf

from common.data.manifest import DataError

BRIDGE = Path(__file__).resolve().parents[2] / "benchmarks" / "speechbrain" / "bridge.py"


def load_bridge():
    spec = importlib.util.spec_from_file_location("speechbrain_bridge", BRIDGE)  # benchmarks/ is not a package
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_csv_has_speechbrains_columns_and_every_utterance(tiny_corpus, tmp_path):
    bridge = load_bridge()
    root = tiny_corpus / "librispeech"
    durations = bridge.write_speechbrain_csv(root, "train", tmp_path / "train.csv")
    with open(tmp_path / "train.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["ID", "duration", "wav", "spk_id", "wrd"]
    assert [r["ID"] for r in rows] == sorted(durations) and len(rows) == len(list(root.glob("train/*/*/*.flac")))
    for r in rows:
        info = sf.info(r["wav"])  # an absolute path SpeechBrain's read_audio can open
        assert Path(r["wav"]).is_absolute()
        assert float(r["duration"]) == pytest.approx(info.frames / info.samplerate, abs=1e-6)
        assert r["ID"].startswith(r["spk_id"] + "-") and r["wrd"]


def test_broken_corpus_is_refused_not_written(bad_corpus, tmp_path):
    with pytest.raises(DataError):
        load_bridge().write_speechbrain_csv(bad_corpus, "train", tmp_path / "train.csv")
    assert not (tmp_path / "train.csv").exists()
