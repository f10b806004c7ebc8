from dataclasses import dataclass

import pytest
import yaml

from common.config import config_hash, config_to_dict, parse_config, save_config


@dataclass
class Cfg:
    output_dir: str = "out"
    max_steps: int = 10
    learning_rate: float = 1e-3
    data_dir: str | None = None
    use_x: bool = False
    splits: list[str] | None = None


def test_defaults_yaml_then_cli(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(yaml.safe_dump({"max_steps": 20, "learning_rate": 0.5}))
    cfg = parse_config(Cfg, ["--config", str(y), "--max_steps", "30", "--data_dir=/d", "--use_x"])
    assert cfg == Cfg(max_steps=30, learning_rate=0.5, data_dir="/d", use_x=True)


def test_default_yaml_and_types(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("max_steps: 5\n")
    cfg = parse_config(Cfg, ["--learning_rate", "2e-4", "--use_x", "false", "--splits", "a,b",
                             "--data_dir", "none"], default_yaml=y)
    assert cfg.max_steps == 5 and cfg.learning_rate == 2e-4 and cfg.use_x is False
    assert cfg.splits == ["a", "b"] and cfg.data_dir is None


@pytest.mark.parametrize("argv", [["--max_stepz", "3"], ["--max_steps", "ten"], ["stray"]])
def test_bad_input_is_an_error(argv):
    with pytest.raises((SystemExit, ValueError)):
        parse_config(Cfg, argv)


def test_unknown_yaml_key_is_an_error(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("nope: 1\n")
    with pytest.raises(SystemExit, match="nope"):
        parse_config(Cfg, ["--config", str(y)])


def test_save_and_hash(tmp_path):
    cfg = Cfg(max_steps=3)
    save_config(cfg, tmp_path / "c.yaml")
    assert parse_config(Cfg, ["--config", str(tmp_path / "c.yaml")]) == cfg
    d = config_to_dict(cfg)
    assert config_hash(d) == config_hash(dict(reversed(list(d.items()))))
    assert config_hash(d) != config_hash({**d, "learning_rate": 1.0})
    assert config_hash(d, ignore=["max_steps"]) == config_hash({**d, "max_steps": 99}, ignore=["max_steps"])
