"""benchmarks/paired_cer.py: the CERs it prints are decode.py's counts, and it refuses files it cannot pair."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "paired_cer.py"


def load_script():
    spec = importlib.util.spec_from_file_location("paired_cer", SCRIPT)  # benchmarks/ is not a package
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "ref": r, "hyp": h}) + "\n" for i, r, h in rows))
    return path


def test_it_prints_both_cers_and_an_interval_around_their_difference(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", [("u1", "abcd", "abcd"), ("u2", "efgh", "efgx"), ("u3", "ij", "ij")])
    b = write(tmp_path / "b.jsonl", [("u2", "efgh", "exgx"), ("u1", "abcd", "abc"), ("u3", "ij", "ij")])
    load_script().main([str(a), str(b), "--resamples", "200"])
    out = capsys.readouterr().out
    assert "3 utterances, 10 reference characters" in out
    assert "A 10.00 %  B 30.00 %  B - A +20.00 points" in out  # 1 edit of 10 against 3 (ids paired, not lines)
    low, high = (float(x) for x in out.split("interval [")[1].split("]")[0].split(","))
    assert 0 <= low <= 20 <= high
    c = write(tmp_path / "c.jsonl", [("u1", "xy", "x")])  # another split: its id may repeat A's
    d = write(tmp_path / "d.jsonl", [("u1", "xy", "xy")])
    load_script().main([f"{a},{c}", f"{b},{d}", "--resamples", "200"])
    assert "4 utterances, 12 reference characters" in capsys.readouterr().out  # pooled: 2 edits of 12 against 3


def test_files_of_other_utterances_or_references_are_refused(tmp_path):
    script = load_script()
    a = write(tmp_path / "a.jsonl", [("u1", "abcd", "abcd")])
    with pytest.raises(SystemExit, match="different utterances"):
        script.main([str(a), str(write(tmp_path / "b.jsonl", [("u2", "abcd", "abcd")]))])
    with pytest.raises(SystemExit, match="references differ"):
        script.main([str(a), str(write(tmp_path / "c.jsonl", [("u1", "abce", "abcd")]))])
    with pytest.raises(SystemExit, match="1 files against 2"):
        script.main([str(a), f"{a},{a}"])
    with pytest.raises(SystemExit, match="names an utterance id twice"):
        script.main([str(a), str(write(tmp_path / "d.jsonl", [("u1", "abcd", "abcd"), ("u1", "abcd", "abc")]))])
