from dataclasses import dataclass
from typing import Literal

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
    cfg = parse_config(Cfg, ["--config", str(y), "--max_steps", "30", f"--data_dir={tmp_path}", "--use_x"])
    assert cfg == Cfg(max_steps=30, learning_rate=0.5, data_dir=str(tmp_path), use_x=True)


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


def test_unknown_yaml_key_is_an_error(tmp_path, capsys):
    y = tmp_path / "c.yaml"
    y.write_text("nope: 1\n")
    with pytest.raises(SystemExit) as e:
        parse_config(Cfg, ["--config", str(y)])
    assert e.value.code == 2 and "unknown config key 'nope'" in capsys.readouterr().err


def test_save_and_hash(tmp_path):
    cfg = Cfg(max_steps=3)
    save_config(cfg, tmp_path / "c.yaml")
    assert parse_config(Cfg, ["--config", str(tmp_path / "c.yaml")]) == cfg
    d = config_to_dict(cfg)
    assert config_hash(d) == config_hash(dict(reversed(list(d.items()))))
    assert config_hash(d) != config_hash({**d, "learning_rate": 1.0})
    assert config_hash(d, ignore=["max_steps"]) == config_hash({**d, "max_steps": 99}, ignore=["max_steps"])


@dataclass
class Full:
    """A recipe-like config."""

    # --- data ---
    data_dir: str | None = None  # a folder
    on_bad_data: Literal["error", "skip"] = "error"  # what to do with bad entries
    # --- optimization ---
    learning_rate: float = 1e-3  # peak LR
    save_steps: int = 10  # optimizer steps between checkpoints
    mixed_precision: Literal["no", "bf16"] | None = None  # None: the profile's
    gradient_accumulation_steps: int = 1

    def validate(self):
        if self.save_steps % self.gradient_accumulation_steps:
            raise ValueError("--save_steps: must be a multiple of --gradient_accumulation_steps")


@pytest.mark.parametrize("argv,message", [
    (["--learning_rat", "1"], "unknown config key 'learning_rat' in command line; did you mean --learning_rate?"),
    (["--save_steps", "0"], "--save_steps: must be ≥ 1, got 0"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps: must be ≥ 1, got 0"),
    (["--learning_rate", "-1"], "--learning_rate: must be > 0, got -1.0"),
    (["--on_bad_data", "ignore"], "--on_bad_data: 'ignore' is not one of error, skip"),
    (["--mixed_precision", "fp8"], "--mixed_precision: 'fp8' is not one of no, bf16"),
    (["--save_steps", "ten"], "--save_steps: expected int, got 'ten'"),
    (["--config", "/no/such.yaml"], "--config /no/such.yaml: no such file"),
    (["--data_dir", "/no/such/folder"], "--data_dir: /no/such/folder does not exist"),
    (["--save_steps", "3", "--gradient_accumulation_steps", "2"],
     "--save_steps: must be a multiple of --gradient_accumulation_steps"),
])
def test_every_mistake_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(Full, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: {message}\n", err


def test_choices_and_optional_literals_parse(tmp_path):
    cfg = parse_config(Full, ["--on_bad_data", "skip", "--mixed_precision", "none", "--data_dir", str(tmp_path)])
    assert cfg.on_bad_data == "skip" and cfg.mixed_precision is None and cfg.data_dir == str(tmp_path)
    assert parse_config(Full, ["--mixed_precision", "bf16"]).mixed_precision == "bf16"


def test_help_lists_every_field_with_type_default_and_comment(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(Full, ["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "data:\n  --data_dir str | None = None\n      a folder" in out
    assert "  --on_bad_data {error,skip} = 'error'\n      what to do with bad entries" in out
    assert "optimization:\n  --learning_rate float (> 0) = 0.001\n      peak LR" in out
    assert "  --save_steps int (≥ 1) = 10\n      optimizer steps between checkpoints" in out
    assert "  --gradient_accumulation_steps int (≥ 1) = 1\n" in out
