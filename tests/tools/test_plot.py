import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from tools.plot import main, plot, read_metrics


@pytest.fixture
def metrics(tmp_path):
    m = tmp_path / "metrics.jsonl"
    # a loss that falls towards 0 (a 5 % margin below its minimum would be negative), a torn last line
    m.write_text("".join(json.dumps({"step": s, "loss": 5.0 / s ** 2, "lr": 0.1,
                                     **({"eval_loss": 4.0 / s, "eval_wer": 0.5} if s % 5 == 0 else {})}) + "\n"
                         for s in range(1, 41)) + '{"step": 41, "lo')
    return m


@pytest.mark.parametrize("name, magic", [("c.png", b"\x89PNG\r\n\x1a\n"), ("c.pdf", b"%PDF"), ("c.svg", b"<?xml")])
def test_the_format_follows_the_extension(metrics, tmp_path, name, magic):
    main([str(metrics), "-o", str(tmp_path / name)])
    assert (tmp_path / name).read_bytes().startswith(magic)


def test_svg_has_one_panel_per_key_with_its_title(metrics, tmp_path):
    main([str(metrics), "-o", str(tmp_path / "c.svg")])
    ET.parse(tmp_path / "c.svg")  # well-formed
    text = (tmp_path / "c.svg").read_text()  # matplotlib draws each text as glyphs after a comment holding it
    assert "<!-- loss -->" in text and "<!-- eval_loss -->" in text and "<!-- lr -->" not in text


def test_panels_read_well(metrics):
    fig = plot(read_metrics(metrics), ["loss", "eval_loss"], separate=True)
    for ax, key in zip(fig.axes, ["loss", "eval_loss"]):
        assert ax.get_title() == key
        assert ax.get_ylim()[0] >= 0  # positive quantities: no negative axis
        assert len([t for t in ax.get_xticks() if 1 <= t <= 40]) >= 3  # steps labelled along the axis, not only the ends


def test_a_metric_and_its_eval_twin_share_one_axes(metrics, tmp_path):
    fig = plot(read_metrics(metrics), ["eval_loss", "loss", "eval_wer"])
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in shown] == ["loss", "eval_wer"]
    assert [line.get_label() for line in shown[0].get_lines()] == ["loss", "eval_loss"]
    assert [t.get_text() for t in shown[0].get_legend().get_texts()] == ["loss", "eval_loss"]
    # the command line does the same by default, one panel per key with --separate
    main([str(metrics), "-o", str(tmp_path / "c.png")])
    main([str(metrics), "-o", str(tmp_path / "s.png"), "--separate"])
    assert len(plot(read_metrics(metrics), ["loss", "eval_loss"], separate=True).axes) == 2


def test_a_small_change_is_not_drawn_as_a_cliff(tmp_path):
    # eval_wer over 0.9893 -> 0.9874 (0.2 %) and a loss wobbling around 1.8685 late in a long run:
    # matplotlib alone zooms to the data's own range and labels both axes with offsets ("+1.868",
    # "+1e5") that read as if the curve fell off a cliff
    rows = [{"step": 100_000 + s, "eval_wer": 0.9893 - 0.0019 * s / 10, "loss": 1.8685 + 0.00004 * (s % 3)}
            for s in range(1, 11)]
    fig = plot(rows, ["eval_wer", "loss"])
    fig.canvas.draw()  # the offset text is set at draw time
    for ax, values in zip(fig.axes, ([r["eval_wer"] for r in rows], [r["loss"] for r in rows])):
        lo, hi = ax.get_ylim()
        assert hi - lo >= 0.1 * max(values) - 1e-12, (ax.get_title(), lo, hi)
        assert lo <= min(values) and hi >= max(values)
        for axis in (ax.xaxis, ax.yaxis):
            assert axis.get_major_formatter().get_offset() == "", axis.get_major_formatter().get_offset()
    # a large change keeps matplotlib's own zoom: the curve fills its panel
    fig = plot([{"step": s, "loss": 7.0 - 0.2 * s} for s in range(1, 11)], ["loss"])
    lo, hi = fig.axes[0].get_ylim()
    assert lo > 4.0 and hi < 7.5


def test_mistakes_are_one_line_and_exit_2(metrics, tmp_path):
    for args, says in ((["-o", str(tmp_path / "x.jpg")], "unknown format '.jpg'; use .png, .svg, .pdf"),
                       (["-o", str(tmp_path / "x")], "unknown format '(no extension)'"),
                       (["-o", str(tmp_path / "x.png"), "--keys", "nope"], "no column nope")):
        proc = subprocess.run([sys.executable, "-m", "tools.plot", str(metrics), *args], capture_output=True, text=True)
        assert proc.returncode == 2 and says in proc.stderr.splitlines()[-1], proc.stderr
    assert not (tmp_path / "x.jpg").exists() and not (tmp_path / "x").exists()
