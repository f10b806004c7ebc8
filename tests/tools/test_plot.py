import json
import xml.etree.ElementTree as ET

import pytest

from tools.plot import main


def test_metrics_become_an_svg_with_one_panel_per_key(tmp_path, capsys):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s, "loss": 5.0 / s, "lr": 0.1, **({"eval_loss": 4.0} if s % 5 == 0 else {})})
                         + "\n" for s in range(1, 21)) + '{"step": 21, "lo')  # a torn last line
    main([str(m), "-o", str(tmp_path / "c.svg")])
    svg = ET.parse(tmp_path / "c.svg").getroot()  # well-formed
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "loss" in texts and "eval_loss" in texts and "lr" not in texts
    assert len(list(svg.iter("{http://www.w3.org/2000/svg}path"))) == 2
    with pytest.raises(SystemExit):
        main([str(m), "-o", str(tmp_path / "d.svg"), "--keys", "nope"])
