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
                                     **({"eval_loss": 4.0 / s} if s % 5 == 0 else {})}) + "\n"
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
    fig = plot(read_metrics(metrics), ["loss", "eval_loss"])
    for ax, key in zip(fig.axes, ["loss", "eval_loss"]):
        assert ax.get_title() == key
        assert ax.get_ylim()[0] >= 0  # positive quantities: no negative axis
        assert len([t for t in ax.get_xticks() if 1 <= t <= 40]) >= 3  # steps labelled along the axis, not only the ends


def test_mistakes_are_one_line_and_exit_2(metrics, tmp_path):
    for args, says in ((["-o", str(tmp_path / "x.jpg")], "unknown format '.jpg'; use .png, .svg, .pdf"),
                       (["-o", str(tmp_path / "x")], "unknown format '(no extension)'"),
                       (["-o", str(tmp_path / "x.png"), "--keys", "nope"], "no column nope")):
        proc = subprocess.run([sys.executable, "-m", "tools.plot", str(metrics), *args], capture_output=True, text=True)
        assert proc.returncode == 2 and says in proc.stderr.splitlines()[-1], proc.stderr
    assert not (tmp_path / "x.jpg").exists() and not (tmp_path / "x").exists()
