"""tools/report.py: the evaluation page's pieces (edit marks, the embedded rows, the atomic write, the
files beside it); the pages each evaluation tool writes are checked in that tool's end-to-end test
(`read_page` below), and in a real browser in tests/tools/test_browser.py."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from tools import report


def read_page(path: Path) -> tuple[dict[str, str], dict]:
    """(headline figures as shown: name → text, the embedded table: {"columns", "rows", ...}) of a report."""
    page = Path(path).read_text(encoding="utf-8")
    summary = re.search(r"<table class=summary>(.*?)</table>", page, re.S).group(1)
    shown = {html.unescape(k): html.unescape(v) for k, v in re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", summary)}
    data = json.loads(re.search(r'<script id=data type="application/json">(.*?)</script>', page, re.S).group(1))
    return shown, data


def assert_page_rows(page: Path, expected: list[dict], keys: list[str], files: tuple[str, ...] = ()):
    """The report's rows are `expected`'s (the tool's JSON lines) in order, with the same `keys`, and
    each of `files` names a file beside the page with something in it; → (headline, rows)."""
    shown, data = read_page(page)
    assert [r["id"] for r in data["rows"]] == [e["id"] for e in expected]
    for row, want in zip(data["rows"], expected):
        assert {k: row[k] for k in keys} == pytest.approx({k: want[k] for k in keys})
        assert all((page.parent / row[k]).is_file() and (page.parent / row[k]).stat().st_size for k in files), row
    return shown, data["rows"]


def test_edit_segments_mark_substitutions_deletions_and_insertions():
    assert report.edit_segments("the cat sat on mat", "the bat sat on the mat x") == [
        ["=", "the", "the"], ["S", "cat", "bat"], ["=", "sat on", "sat on"], ["I", "", "the"], ["=", "mat", "mat"],
        ["I", "", "x"]]
    assert report.edit_segments("a b c", "a c") == [["=", "a", "a"], ["D", "b", ""], ["=", "c", "c"]]
    assert report.edit_segments("abc", "abd", unit="chars") == [["=", "ab", "ab"], ["S", "c", "d"]]
    rates = report.error_rates("a b c d", "a x c")
    assert rates["wer"] == pytest.approx(0.5) and rates["cer"] == pytest.approx(3 / 7)
    assert report.error_rates("", "noise") == {"wer": None, "cer": None, "edits": [["I", "", "noise"]]}


def test_write_report_embeds_the_rows_escaped_and_writes_atomically(tmp_path):
    page = tmp_path / "test-greedy.html"
    page.write_text("an older page")
    rows = [{"id": "a", "text": "</script><b>x</b>", "wer": 0.5}, {"id": "b", "text": "ok", "wer": None}]
    summary = {"wer": 0.25, "split": "test", "asr": {"cer": 0.1}}
    report.write_report(page, "t", summary, [("id", "id", "text"), ("text", "text", "text"), ("wer", "WER", "pct")],
                        rows, report.command_line(["recipes/asr/decode.py", "--split", "test clean"]), sort="wer")
    shown, data = read_page(page)
    assert data["rows"] == rows and data["sort"] == "wer"  # "</script>" in a transcript did not end the script
    assert shown["wer"] == "0.25" and shown["split"] == "test" and json.loads(shown["asr"]) == {"cer": 0.1}
    text = page.read_text()
    assert "python recipes/asr/decode.py --split &#x27;test clean&#x27;" in text
    assert "http" not in text.replace("http-equiv", "")  # nothing fetched from the network
    assert [p.name for p in tmp_path.iterdir()] == [page.name]  # no temporary file left
    with pytest.raises(ValueError):  # NaN is no figure: refused, never written as invalid JSON
        report.write_report(page, "t", {}, [("wer", "WER", "num")], [{"wer": float("nan")}])
    assert read_page(page)[1]["rows"] == rows  # the page before the refusal is still whole


def test_files_beside_the_report_and_training_curves(tmp_path):
    page = tmp_path / "out" / "eval.html"
    page.parent.mkdir()
    src = tmp_path / "a.flac"
    src.write_bytes(b"fLaC")
    assert report.place(src, page, "audio/a.flac") == "eval_files/audio/a.flac"
    assert (tmp_path / "out" / "eval_files" / "audio" / "a.flac").read_bytes() == b"fLaC"
    assert report.training_curves(tmp_path / "none.jsonl", page) is None  # a copied final/: no curves, no error
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1 / s, "lr": 0.1}) + "\n" for s in range(1, 5)))
    assert report.training_curves(metrics, page) == "eval_files/training_curves.png"
    assert (tmp_path / "out" / "eval_files" / "training_curves.png").read_bytes()[:4] == b"\x89PNG"
