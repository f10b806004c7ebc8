import dataclasses
import os
import signal
import subprocess
import sys
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import pytest
import yaml

from common.config import START_UP_SIGNAL_EXIT_CODE, RunConfig, config_hash, config_to_dict, parse_config, save_config
from common.config_rules import (Count, ExistingPath, ExistingPathOr, Internal, MayBeEmpty, NonNegative, Positive,
                                 Range, ResumeSafe, SpaceSeparated, field_specs, resume_safe_keys)
from common.config_yaml import MAX_CONFIG_BYTES, MAX_YAML_NODES
from tests.harness.recipe_import import RECIPES, recipe_modules

ROOT = Path(__file__).resolve().parents[2]


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
    assert parse_config(Cfg, ["--max_steps", "1e3"]).max_steps == 1000


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
    data_dir: Annotated[str | None, ExistingPath] = None  # a folder
    init_from: Annotated[str | None, ExistingPathOr("builtin")] = None  # a folder, or the word
    on_bad_data: Literal["error", "skip"] = "error"  # what to do with bad entries
    # --- optimization ---
    learning_rate: Annotated[float, Positive] = 1e-3  # peak LR
    save_steps: Annotated[int, Count] = 10  # optimizer steps between checkpoints
    mixed_precision: Literal["no", "bf16"] | None = None  # None: the profile's
    gradient_accumulation_steps: Annotated[int, Count] = 1
    dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.1
    temperature: Annotated[float, Range(0, lo_open=True, finite=False)] = 1.0  # inf allowed
    scale: float = 1.0  # no rule: any finite number

    def validate(self):
        if self.save_steps % self.gradient_accumulation_steps:
            raise ValueError("--save_steps: must be a multiple of --gradient_accumulation_steps")


@pytest.mark.parametrize("argv,message", [
    (["--learning_rat", "1"], "unknown config key 'learning_rat' in command line; did you mean --learning_rate?"),
    (["--save_steps", "0"], "--save_steps: must be ≥ 1, got 0"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps: must be ≥ 1, got 0"),
    (["--learning_rate", "-1"], "--learning_rate: must be > 0, got -1.0"),
    (["--learning_rate", "nan"], "--learning_rate: must be a finite number, got nan"),
    (["--scale", "inf"], "--scale: must be a finite number, got inf"),
    (["--scale", "-nan"], "--scale: must be a finite number, got nan"),
    (["--dropout", "1"], "--dropout: must be in [0, 1), got 1.0"),
    (["--temperature", "0"], "--temperature: must be > 0, got 0.0"),
    (["--on_bad_data", "ignore"], "--on_bad_data: 'ignore' is not one of error, skip"),
    (["--mixed_precision", "fp8"], "--mixed_precision: 'fp8' is not one of no, bf16"),
    (["--save_steps", "ten"], "--save_steps: expected int, got 'ten'"),
    (["--save_steps", "1.5"], "--save_steps: expected an integer, got '1.5'"),
    (["--save_steps", "1e400"], "--save_steps: expected an integer, got '1e400'"),
    (["--config", "/no/such.yaml"], "--config /no/such.yaml: no such file"),
    (["--data_dir", "/no/such/folder"], "--data_dir: /no/such/folder does not exist"),
    (["--init_from", "Builtin"], "--init_from: Builtin does not exist (nor is it builtin)"),
    (["--save_steps", "3", "--gradient_accumulation_steps", "2"],
     "--save_steps: must be a multiple of --gradient_accumulation_steps"),
    # only booleans may be given bare
    (["--data_dir"], "--data_dir needs a value (only true/false settings may be given bare)"),
    (["--save_steps", "--dropout", "0.2"], "--save_steps needs a value (only true/false settings may be given bare)"),
    (["--config"], "--config needs a value (only true/false settings may be given bare)"),
    (["--nope"], "unknown config key 'nope' in command line (--help lists them)"),
])
def test_every_mistake_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(Full, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: {message}\n", err


def test_rules_allow_what_they_say():
    cfg = parse_config(Full, ["--temperature", "inf", "--dropout", "0", "--scale", "-3", "--init_from", "builtin"])
    assert cfg.temperature == float("inf") and cfg.dropout == 0 and cfg.scale == -3 and cfg.init_from == "builtin"
    assert parse_config(Full, ["--init_from", "."]).init_from == "."


def test_choices_and_optional_literals_parse(tmp_path):
    cfg = parse_config(Full, ["--on_bad_data", "skip", "--mixed_precision", "none", "--data_dir", str(tmp_path)])
    assert cfg.on_bad_data == "skip" and cfg.mixed_precision is None and cfg.data_dir == str(tmp_path)
    assert parse_config(Full, ["--mixed_precision", "bf16"]).mixed_precision == "bf16"


def test_help_lists_every_field_with_type_rules_default_and_comment(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(Full, ["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "data:\n  --data_dir str | None (must exist) = None\n      a folder" in out
    assert "  --on_bad_data {error,skip} = 'error'\n      what to do with bad entries" in out
    assert "optimization:\n  --learning_rate float (> 0) = 0.001\n      peak LR" in out
    assert "  --save_steps int (≥ 1) = 10\n      optimizer steps between checkpoints" in out
    assert "  --gradient_accumulation_steps int (≥ 1) = 1\n" in out
    assert "  --dropout float (in [0, 1)) = 0.1\n" in out


@dataclass
class Files:
    """A tool that takes files (recipes/asr/transcribe.py)."""

    audio: list[Annotated[str, ExistingPath, SpaceSeparated]] = dataclasses.field(default_factory=list)  # files
    tags: list[str] = dataclasses.field(default_factory=lambda: ["a"])  # comma-separated as ever
    top_k: int = 1


def test_a_space_separated_list_takes_every_value_up_to_the_next_flag(tmp_path, capsys):
    """`--audio a.wav b,c.wav` (a shell's glob; a name with a comma): every argument up to the next
    --flag, anywhere on the line; each must exist; none is refused saying how to give them."""
    names = [tmp_path / "a.wav", tmp_path / "b,c.wav"]
    for name in names:
        name.write_bytes(b"")
    cfg = parse_config(Files, ["--top_k", "2", "--audio", *map(str, names), "--tags", "x,y"])
    assert (cfg.audio, cfg.tags, cfg.top_k) == ([str(n) for n in names], ["x", "y"], 2)
    assert parse_config(Files, [f"--audio={names[1]}", str(names[0])]).audio == [str(names[1]), str(names[0])]
    for argv, message in (([], "--audio: needs at least one value (space-separated on the command line, a list in "
                                "the YAML)"),
                          (["--audio", str(names[0]), str(tmp_path / "gone.wav")],
                           f"--audio: {tmp_path / 'gone.wav'} does not exist (in [")):
        with pytest.raises(SystemExit):
            parse_config(Files, argv)
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        parse_config(Files, ["--help"])
    assert "  --audio list[str] (must exist; at least one; space-separated) = []" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Rules live in the fields: common/ knows no recipe
# ---------------------------------------------------------------------------------------------

@dataclass
class Vocoder:
    """A new recipe's config, with rules only its own fields carry."""

    upsample_rates: Annotated[int, Range(2, 8)] = 4  # its own rule
    segment_seconds: Annotated[float, Positive] = 0.5
    feature_loss_weight: Annotated[float, NonNegative] = 2.0
    preview_every: Annotated[int, Count, ResumeSafe] = 100
    max_steps: int = 10  # a name the shared settings also use, but here without any rule
    output_dir: str = "out"  # likewise: no ResumeSafe mark
    learning_rate: float = 1e-3
    data_dir: str | None = None


@pytest.mark.parametrize("argv,message", [
    (["--upsample_rates", "9"], "--upsample_rates: must be in [2, 8], got 9"),
    (["--segment_seconds", "0"], "--segment_seconds: must be > 0, got 0.0"),
    (["--feature_loss_weight", "-1"], "--feature_loss_weight: must be ≥ 0, got -1.0"),
])
def test_a_new_config_carries_its_own_rules(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(Vocoder, argv)
    assert capsys.readouterr().err == f"error: {message}\n"


def test_no_rule_comes_from_a_field_name():
    """A field named like a shared one gets no bound, no path check and no resume mark from its name:
    common/ keeps no list of recipe field names."""
    cfg = parse_config(Vocoder, ["--max_steps", "0", "--learning_rate", "-1", "--data_dir", "/no/such/folder"])
    assert (cfg.max_steps, cfg.learning_rate, cfg.data_dir) == (0, -1.0, "/no/such/folder")
    assert resume_safe_keys(Vocoder) == ["preview_every"]


@dataclass
class Sub(RunConfig):
    """A recipe config on top of the shared settings."""

    max_steps: int = 7
    # --- data ---
    n_mels: Annotated[int, Count] = 80  # log-mel bins
    # --- model ---
    width: Annotated[int, Count] = 16  # channels


def test_a_redeclared_shared_field_keeps_its_rules_comment_and_place(capsys):
    assert Sub().max_steps == 7
    with pytest.raises(SystemExit):
        parse_config(Sub, ["--max_steps", "0"])
    assert capsys.readouterr().err == "error: --max_steps: must be ≥ 1, got 0\n"
    assert "max_steps" in resume_safe_keys(Sub)
    with pytest.raises(SystemExit):
        parse_config(Sub, ["--help"])
    out = capsys.readouterr().out
    assert "  --max_steps int (≥ 1; may change on resume) = 7\n      optimizer steps\n" in out  # RunConfig's comment
    # sections: RunConfig's, the recipe's data fields joining its data section, then the recipe's own
    sections = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert sections == ["run", "data", "optimization", "logging / checkpoints", "early stopping", "model"]
    assert out.index("--stats_utterances") < out.index("--n_mels") < out.index("optimization:")
    assert list(config_to_dict(Sub()))[:3] == ["output_dir", "overwrite_output_dir", "max_steps"]
    assert list(config_to_dict(Sub()))[-1] == "width"


def test_a_flag_given_twice_is_refused_as_a_yaml_key_given_twice_is(capsys):
    assert _refused(Cfg, ["--max_steps", "4", "--max_steps", "5"], capsys) == (
        "error: --max_steps given twice on the command line ('4', then '5'): keep one\n")
    assert "--max_steps given twice" in _refused(Cfg, ["--max-steps=4", "--max_steps", "4"], capsys)
    assert "--use_x given twice" in _refused(Cfg, ["--use_x", "--use_x", "false"], capsys)
    assert "--config given twice" in _refused(Cfg, ["--config", "a.yaml", "--config", "b.yaml"], capsys)


@pytest.mark.parametrize("recipe", ["asr", "best_rq", "speaker_id"])
def test_an_empty_name_in_a_comma_separated_split_is_refused(recipe, capsys):
    """`--train_split a,,b` named the data folder itself as a split (its '' part)."""
    assert recipe_config(recipe)().train_split == "train"
    for value in ("a,,b", "a,", ",", " "):
        assert _refused(recipe_config(recipe), ["--train_split", value], capsys) == (
            f"error: --train_split: an empty name in {value!r} (names are comma-separated: a,b)\n")
    assert parse_config(recipe_config(recipe), ["--train_split", "a,b"]).train_split == "a,b"


def test_asr_decode_refuses_an_empty_split_name(capsys, tmp_path):
    decode = recipe_modules("asr", "decode").decode
    assert "--split: an empty name in 'test,'" in _refused(decode.EvalConfig, ["--checkpoint", str(tmp_path),
                                                                              "--split", "test,"], capsys)


def test_a_recipe_leaves_out_a_shared_field_it_has_no_use_for(tmp_path, capsys):
    """The vocoder has no log-mel statistics: `stats_utterances` is not in its --help, refused on the
    command line and in a YAML file with the recipe's reason, not saved; its older saved configs
    (and checkpoints) that hold it are read (and resumed) without it. The other recipes keep it."""
    from common.config import load_config
    from common.config_rules import ConfigError

    vocoder = recipe_config("vocoder")
    yaml_path = ROOT / "recipes" / "vocoder" / "config.yaml"
    with pytest.raises(SystemExit):
        parse_config(vocoder, ["--help"], default_yaml=yaml_path)
    assert "stats_utterances" not in capsys.readouterr().out
    assert _refused(vocoder, ["--stats_utterances", "3"], capsys, yaml_path) == (
        "error: --stats_utterances: not a setting of this recipe (the generator reads log-mels as they are, "
        "without mean/std statistics): drop it\n")
    (tmp_path / "c.yaml").write_text("stats_utterances: 3\n")
    assert f"'stats_utterances' in {tmp_path / 'c.yaml'}: not a setting of this recipe" in _refused(
        vocoder, ["--config", str(tmp_path / "c.yaml")], capsys)
    save_config(vocoder(), tmp_path / "config.yaml")
    assert "stats_utterances" not in (tmp_path / "config.yaml").read_text()
    old = tmp_path / "config.yaml"
    old.write_text(old.read_text() + "stats_utterances: 500\n")  # written before it was left out
    assert load_config(tmp_path, vocoder) == vocoder()
    assert "stats_utterances" in resume_safe_keys(vocoder)  # an older checkpoint's value changes nothing
    for recipe in ("asr", "best_rq", "speaker_id", "tts"):
        assert "stats_utterances" in config_to_dict(recipe_config(recipe)())

    @dataclass
    class Wrong(RunConfig):
        LEFT_OUT = {"stats_utterance": "a typo"}

    with pytest.raises(ConfigError, match="^Wrong.LEFT_OUT names 'stats_utterance', which is not a field of it"):
        config_to_dict(Wrong())


def test_run_config_resume_safe_keys():
    safe = set(resume_safe_keys(RunConfig))
    assert {"output_dir", "max_steps", "save_steps", "save_total_limit", "logging_steps", "eval_steps",
            "num_workers", "report_to", "ddp_timeout", "allow_data_change", "num_threads",
            "gradient_accumulation_steps", "data_check"} <= safe
    assert not safe & {"seed", "learning_rate", "max_batch_seconds", "sample_rate", "mixed_precision", "data_dir"}


# ---------------------------------------------------------------------------------------------
# The shipped recipes
# ---------------------------------------------------------------------------------------------

def recipe_config(recipe):
    return recipe_modules(recipe, "train").train.Config


@pytest.mark.parametrize("recipe,argv,message", [
    ("best_rq", ["--learning_rate", "nan"], "--learning_rate: must be a finite number, got nan"),
    ("best_rq", ["--dropout", "2"], "--dropout: must be in [0, 1), got 2.0"),
    ("best_rq", ["--mask_prob", "2"], "--mask_prob: must be in (0, 1], got 2.0"),
    ("asr", ["--max_batch_seconds", "inf"], "--max_batch_seconds: must be a finite number, got inf"),
    ("tts", ["--min_seconds", "-5"], "--min_seconds: must be ≥ 0, got -5.0"),
    ("tts", ["--max_grad_norm", "0"], "--max_grad_norm: must be > 0, got 0.0"),
    ("best_rq", ["--noise_std", "nan"], "--noise_std: must be a finite number, got nan"),
    ("asr", ["--max_steps", "1e400"], "--max_steps: expected an integer, got '1e400'"),
    ("asr", ["--output_dir"], "--output_dir needs a value (only true/false settings may be given bare)"),
    ("tts", ["--max_steps"], "--max_steps needs a value (only true/false settings may be given bare)"),
])
def test_recipe_mistakes_are_refused(recipe, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(recipe_config(recipe), argv, default_yaml=ROOT / "recipes" / recipe / "config.yaml")
    assert e.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"


def test_tts_sample_settings_may_change_on_resume():
    assert {"num_samples", "griffin_lim_iters"} <= set(resume_safe_keys(recipe_config("tts")))


def test_help_shows_the_defaults_a_plain_run_gets(capsys):
    with pytest.raises(SystemExit):
        parse_config(recipe_config("asr"), ["--help"], default_yaml=ROOT / "recipes" / "asr" / "config.yaml")
    out = capsys.readouterr().out
    assert "--max_steps int (≥ 1; may change on resume) = 4000 (from config.yaml)\n" in out
    assert "--learning_rate float (in (0, 1]) = 0.001 (from config.yaml)\n" in out
    assert "--seed int = 42\n" in out
    # and the --config given with --help
    with pytest.raises(SystemExit):
        parse_config(recipe_config("asr"), ["--help", "--config", str(ROOT / "recipes/asr/config_librispeech_100h.yaml")])
    assert "--max_steps int (≥ 1; may change on resume) = 100000 (from config_librispeech_100h.yaml)\n" \
        in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Hostile or broken YAML files
# ---------------------------------------------------------------------------------------------

BILLION_LAUGHS = """\
save_steps:
  - &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
  - &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
  - &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
  - &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
  - &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
  - &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
  - &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
  - &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
  - &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def _composed(monkeypatch) -> list:
    """A list that grows by one for every YAML node the config loader composes."""
    from common.config_yaml import _ConfigLoader

    nodes, compose = [], _ConfigLoader.compose_node

    def counted(self, parent, index):
        nodes.append(1)
        return compose(self, parent, index)

    monkeypatch.setattr(_ConfigLoader, "compose_node", counted)
    return nodes


def test_yaml_alias_bomb_is_refused_at_once(tmp_path, capsys, monkeypatch):
    y = tmp_path / "bomb.yaml"
    y.write_text(BILLION_LAUGHS)
    nodes = _composed(monkeypatch)
    with pytest.raises(SystemExit) as e:
        parse_config(Full, ["--config", str(y)])
    assert len(nodes) < 10  # refused at the first anchor, a few nodes in: nothing expanded (9**9 lists)
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"error: --config {y}: not valid YAML (line 2: anchors and aliases (&name, *name) are not allowed in a config)\n")


@pytest.mark.parametrize("text,message", [
    (b"save_steps: 5\nnote: caf\xe9\n", "not UTF-8 text (byte 0xe9 at offset 23)"),
    (b"save_steps: 1e400\n", None),
    (b"save_steps: 1.0e400\n", None),
    (b"save_steps: [1, 2\n", "not valid YAML (line 2: expected ',' or ']', but got '<stream end>')"),
    (b"- 1\n", "expected a mapping of keys to values"),
])
def test_broken_yaml_is_one_line(tmp_path, capsys, text, message):
    y = tmp_path / "c.yaml"
    y.write_bytes(text)
    with pytest.raises(SystemExit) as e:
        parse_config(Full, ["--config", str(y)])
    err = capsys.readouterr().err
    expected = f"error: --config {y}: {message}\n" if message else \
        f"error: --save_steps: expected an integer, got inf (--config {y}, line 1)\n"
    assert e.value.code == 2 and err == expected


# ---------------------------------------------------------------------------------------------
# Resume: the fields' marks decide what may change
# ---------------------------------------------------------------------------------------------

@dataclass
class Toy:
    lr: Annotated[float, Positive] = 0.1
    max_steps: Annotated[int, Count, ResumeSafe] = 10
    previews: Annotated[int, NonNegative, ResumeSafe] = 2


def _save_and_resume(tmp_path, saved_state, state):
    import torch
    from accelerate import Accelerator

    from common.training.checkpoint import save_checkpoint
    from common.training.resume import choose_checkpoint, resume_from_checkpoint

    def objects():
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        model, optimizer = accelerator.prepare(model, optimizer)
        return accelerator, dict(models=model, optimizers=optimizer, schedulers=sched)

    accelerator, parts = objects()
    saved_state.step, saved_state.stage = 1, "boundary"  # as end_step leaves it
    save_checkpoint(accelerator, tmp_path, saved_state, **parts, save_total_limit=None)
    accelerator, parts = objects()
    return resume_from_checkpoint(accelerator, choose_checkpoint(accelerator, tmp_path), state, **parts)


def test_resume_compares_by_the_fields_marks(tmp_path):
    from common.training.state import TrainState

    state = TrainState.for_run(Toy(), 1, 1)
    assert state.resume_safe == ["max_steps", "previews"] and state.config == {"lr": 0.1, "max_steps": 10, "previews": 2}
    assert _save_and_resume(tmp_path, state, TrainState.for_run(Toy(max_steps=99, previews=0), 1, 1)) is not None
    with pytest.raises(RuntimeError, match=r"lr: checkpoint 0.1 != now 0.2"):
        _save_and_resume(tmp_path / "2", TrainState.for_run(Toy(), 1, 1), TrainState.for_run(Toy(lr=0.2), 1, 1))


def test_a_checkpoint_of_the_old_key_list_still_resumes(tmp_path):
    """A checkpoint written before the marks were stored (no `resume_safe`, its hash over the old list
    of keys, TTS's sample settings not in it) resumes when only marked fields changed."""
    from common.training.state import TrainState

    old_list = ("output_dir", "max_steps", "save_steps", "save_total_limit", "logging_steps", "eval_steps",
                "num_workers", "memory_cache_mb", "report_to", "data_cache_dir", "ddp_timeout",
                "max_nonfinite_updates", "dump_batch_ids", "overwrite_output_dir", "data_check",
                "gradient_accumulation_steps", "num_threads")
    tts = recipe_config("tts")
    old_config = {k: v for k, v in config_to_dict(tts()).items() if k != "allow_data_change"}  # a newer field
    old = TrainState(config=old_config, config_hash=config_hash(old_config, ignore=old_list))
    now = TrainState.for_run(tts(max_steps=2000, num_samples=4), 1, 1)
    assert _save_and_resume(tmp_path, old, now) is not None
    assert now.resume_safe == resume_safe_keys(tts) and now.config["max_steps"] == 2000
    with pytest.raises(RuntimeError, match=r"learning_rate: checkpoint 0.001 != now 0.002"):
        _save_and_resume(tmp_path / "2", old, TrainState.for_run(tts(learning_rate=2e-3), 1, 1))


def test_a_field_added_after_the_checkpoint_resumes_at_its_default_only(tmp_path):
    """A checkpoint written before a field existed (ASR's layer_decay, say) resumes when this launch
    uses the field's default, which is how the older code behaved; another value is a change."""
    from common.training.state import TrainState

    old_config = {"lr": 0.1, "max_steps": 10, "previews": 2}  # Toy, written before `decay` existed
    old = TrainState(config=old_config, config_hash=config_hash(old_config, ignore=("max_steps",)))

    @dataclass
    class Newer(Toy):
        decay: Annotated[float, Positive] = 1.0

    assert _save_and_resume(tmp_path, old, TrainState.for_run(Newer(), 1, 1)) is not None
    with pytest.raises(RuntimeError, match=r"decay: checkpoint None != now 0.5"):
        _save_and_resume(tmp_path / "2", old, TrainState.for_run(Newer(decay=0.5), 1, 1))


def test_a_key_the_checkpoint_marked_safe_and_this_config_dropped_is_ignored(tmp_path):
    from common.training.state import TrainState

    saved = TrainState.for_run(Toy(), 1, 1)

    @dataclass
    class Later:  # the next version of Toy: `previews` removed
        lr: Annotated[float, Positive] = 0.1
        max_steps: Annotated[int, Count, ResumeSafe] = 10

    assert _save_and_resume(tmp_path, saved, TrainState.for_run(Later(), 1, 1)) is not None


# ---------------------------------------------------------------------------------------------
# Signals before training: one line, not a traceback
# ---------------------------------------------------------------------------------------------

def test_start_up_exit_code_is_the_preemption_one():
    from common.training.faults import PREEMPTED_EXIT_CODE

    assert START_UP_SIGNAL_EXIT_CODE == PREEMPTED_EXIT_CODE


def test_ctrl_c_during_the_imports_of_a_recipe_is_one_line(tmp_path):
    """Ctrl-C while train.py imports torch & co (~2-8 s after --help would have answered). The signal
    is sent once the recipe's own imports have begun: `-X importtime` writes a line as each module
    is imported, and the first torch module comes after the start-up handlers (train.py's order)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-X", "importtime", str(ROOT / "recipes" / "best_rq" / "train.py"),
                             "--output_dir", str(tmp_path / "out")], env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # "import time: <µs> | <cumulative µs> | <module>"
        lines.append(line)
        if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip().startswith("torch"):
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)  # only a hung process fails here
    err = "".join(line for line in [*lines, *rest.splitlines(keepends=True)] if not line.startswith("import time:"))
    assert proc.returncode == START_UP_SIGNAL_EXIT_CODE, err
    assert err == f"SIGINT during start-up: stopping (nothing to save yet; exit code {START_UP_SIGNAL_EXIT_CODE})\n"
    assert not (tmp_path / "out").exists()


def test_ctrl_c_inside_an_import_that_swallows_it_still_stops(tmp_path):
    """A library whose import catches every exception (or breaks on one) cannot keep the run going:
    a signal that lands inside an import ends the process there, in one line, exit 75."""
    (tmp_path / "greedy_library.py").write_text(
        "import time\ntry:\n    time.sleep(30)\nexcept BaseException:\n    pass\n")
    script = ("import sys; from common.config import exit_on_signals_during_start_up\n"
              "exit_on_signals_during_start_up(); print('ready', flush=True)\n"
              "import greedy_library\nprint('went on after the signal', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.5)  # inside greedy_library's sleep
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == START_UP_SIGNAL_EXIT_CODE and "went on" not in out, (out, err)
    assert err == f"SIGINT during start-up: stopping (nothing to save yet; exit code {START_UP_SIGNAL_EXIT_CODE})\n"


def test_parse_config_installs_no_signal_handler():
    """Only a training script asks for the start-up handlers (the tools keep Python's Ctrl-C)."""
    before = signal.getsignal(signal.SIGINT)
    parse_config(Cfg, [])
    assert signal.getsignal(signal.SIGINT) is before


# ---------------------------------------------------------------------------------------------
# A YAML value means what it reads as (YAML 1.2 core schema); a bad one names the file and line
# ---------------------------------------------------------------------------------------------

def _refused(cls, argv, capsys, default_yaml=None) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(cls, argv, default_yaml=default_yaml)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def test_yaml_numbers_read_as_written(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("save_steps: 010\nlearning_rate: 1e-3\nmixed_precision: no\nscale: .5\n")
    cfg = parse_config(Full, ["--config", str(y)])
    # YAML 1.1 (yaml.safe_load): 8 (octal), the string '1e-3', False (refused by the choice)
    assert (cfg.save_steps, cfg.learning_rate, cfg.mixed_precision, cfg.scale) == (10, 1e-3, "no", 0.5)
    y.write_text("use_x: yes\nsplits: [on, off]\n")
    cfg = parse_config(Cfg, ["--config", str(y)])
    assert cfg.use_x is True and cfg.splits == ["on", "off"]  # a true/false field reads yes as the command line does


@pytest.mark.parametrize("text,message", [
    ("save_steps: 1:30\n", "--save_steps: expected int, got '1:30' (--config {y}, line 1)"),  # YAML 1.1: 90
    ("save_steps: 5\n\nsave_steps: 0x10\n", "--config {y}: not valid YAML (line 3: key 'save_steps' given twice "
                                           "(first on line 1): keep one)"),
    ("learning_rate: 1e-3\nsave_steps: 0x10\n", "--save_steps: expected int, got '0x10' (--config {y}, line 2)"),
    ("save_steps: 0o10\n", "--save_steps: expected int, got '0o10' (--config {y}, line 1)"),
    ("save_steps: !!int 0x10\n", "--config {y}: not valid YAML (line 1: '0x10' is not a decimal integer)"),
    ("save_steps: '١٢'\n", "--save_steps: '١٢' has digits other than 0-9 (write the number with ASCII digits) "
                           "(--config {y}, line 1)"),
    ("dropout: ０.５\n", "--dropout: '０.５' has digits other than 0-9 (write the number with ASCII digits) "
                        "(--config {y}, line 1)"),
    # a rule broken by a YAML value (checked after the command line) names the file too
    ("\nlearning_rate: 1e-3\nsave_steps: 0\n", "--save_steps: must be ≥ 1, got 0 (--config {y}, line 3)"),
    ("save_steps: " + "[" * 400 + "\n", "--config {y}: not valid YAML (line 1: nested more than 8 levels deep "
                                        "(a config is a mapping of values and lists))"),
])
def test_yaml_surprises_are_refused_in_one_line(tmp_path, capsys, text, message):
    y = tmp_path / "c.yaml"
    y.write_text(text)
    assert _refused(Full, ["--config", str(y)], capsys) == f"error: {message.format(y=y)}\n"


def test_a_value_the_command_line_overrides_is_not_blamed_on_the_yaml(tmp_path, capsys):
    y = tmp_path / "c.yaml"
    y.write_text("save_steps: 4\n")
    err = _refused(Full, ["--config", str(y), "--save_steps", "0"], capsys)
    assert err == "error: --save_steps: must be ≥ 1, got 0\n"


@pytest.mark.parametrize("value", ["١٢", "１２", "1e٣"])
def test_command_line_numbers_are_ascii(capsys, value):
    err = _refused(Full, ["--save_steps", value], capsys)
    assert err == f"error: --save_steps: {value!r} has digits other than 0-9 (write the number with ASCII digits)\n"


def test_a_huge_yaml_is_refused_at_once(tmp_path, capsys, monkeypatch):
    y = tmp_path / "big.yaml"
    y.write_text("save_steps: [" + "1," * MAX_CONFIG_BYTES + "1]\n")
    nodes = _composed(monkeypatch)
    err = _refused(Full, ["--config", str(y)], capsys)
    assert not nodes  # refused from its size, before parsing
    assert err == (f"error: --config {y}: {y.stat().st_size} bytes, more than a config's {MAX_CONFIG_BYTES} (a config "
                   f"is a short list of settings): name the right file\n")
    # under the size cap, a list of many values (~65,000) stops at the value cap: no node composed past it
    y.write_text("save_steps: [" + "1," * (MAX_CONFIG_BYTES // 2 - 16) + "1]\n")
    assert "more than 5000 values" in _refused(Full, ["--config", str(y)], capsys)
    assert len(nodes) == MAX_YAML_NODES + 1


def test_config_that_is_not_a_file_is_named_and_never_opened(tmp_path, capsys, monkeypatch):
    opened, open_ = [], os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or open_(path, *a, **k))
    assert _refused(Full, ["--config", str(tmp_path)], capsys) == \
        f"error: --config {tmp_path}: is a directory, not a file: name a YAML file\n"
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    assert _refused(Full, ["--config", str(fifo)], capsys) == \
        f"error: --config {fifo}: is a FIFO (named pipe), not a file: name a YAML file\n"
    assert _refused(Full, ["--config", "/dev/zero"], capsys) == \
        "error: --config /dev/zero: is a device, not a file: name a YAML file\n"
    assert not {str(tmp_path), str(fifo), "/dev/zero"} & set(opened)


# ---------------------------------------------------------------------------------------------
# List values carry their field's rules, and are never silently empty
# ---------------------------------------------------------------------------------------------

@dataclass
class Lists:
    periods: list[Annotated[int, Count]] = dataclasses.field(default_factory=lambda: [2, 3])  # each a rule
    widths: Annotated[list[float], Positive] = dataclasses.field(default_factory=lambda: [1.0])  # the field's rule, on each
    extras: Annotated[list[str], MayBeEmpty] = dataclasses.field(default_factory=list)  # empty: none


@pytest.mark.parametrize("argv,message", [
    (["--periods", "0"], "--periods: must be ≥ 1, got 0 (in [0])"),
    (["--periods", "2,-3"], "--periods: must be ≥ 1, got -3 (in [2, -3])"),
    (["--periods", ""], "--periods: needs at least one value (comma-separated on the command line, a list in the YAML)"),
    (["--periods", "2,,3"], "--periods: an empty value in '2,,3' (values are comma-separated: 2,3,5)"),
    (["--periods", "1.5"], "--periods: expected an integer, got '1.5'"),
    (["--widths", "1,0"], "--widths: must be > 0, got 0.0 (in [1.0, 0.0])"),
    (["--widths", "1,nan"], "--widths: must be a finite number, got nan"),
])
def test_every_value_of_a_list_is_checked(argv, message, capsys):
    assert _refused(Lists, argv, capsys) == f"error: {message}\n"


def test_a_list_field_says_its_rules_and_may_be_empty_where_it_says_so(capsys):
    cfg = parse_config(Lists, ["--periods", "5,7", "--extras", ""])
    assert cfg.periods == [5, 7] and cfg.extras == []
    with pytest.raises(SystemExit):
        parse_config(Lists, ["--help"])
    out = capsys.readouterr().out
    assert "--periods list[int] (each ≥ 1; at least one; comma-separated) = [2, 3]\n" in out
    assert "--extras list[str] (may be empty; comma-separated) = []\n" in out


def test_a_list_in_the_yaml_is_checked_and_names_the_file(tmp_path, capsys):
    y = tmp_path / "c.yaml"
    y.write_text("periods: []\n")
    assert _refused(Lists, ["--config", str(y)], capsys) == (
        f"error: --periods: needs at least one value (comma-separated on the command line, a list in the YAML) "
        f"(--config {y}, line 1)\n")


VOCODER_YAML = ROOT / "recipes" / "vocoder" / "config.yaml"
SEGMENT_LINE = next(n for n, line in enumerate(VOCODER_YAML.read_text().splitlines(), 1) if line.startswith("segment_frames:"))


@pytest.mark.parametrize("argv,message", [
    # each crashed at the first adversarial step (ZeroDivisionError, a view of a negative size)
    (["--periods", "0"], "--periods: must be ≥ 1, got 0 (in [0])"),
    (["--periods", "-3"], "--periods: must be ≥ 1, got -3 (in [-3])"),
    (["--resolutions", "1"], "--resolutions: must be ≥ 4, got 1 (in [1])"),  # hop n_fft / 4 = 0
    (["--period_channels", "0"], "--period_channels: must be ≥ 1, got 0 (in [0])"),
    # trained with no period discriminator, silently
    (["--periods", ""], "--periods: needs at least one value (comma-separated on the command line, a list in the YAML)"),
    (["--resolutions", "512,20000"], "--resolutions: 20000 is longer than a training segment (8192 samples = "
                                     "--segment_frames 32 × --hop_length 256): lower it or raise --segment_frames "
                                     f"(--config {VOCODER_YAML}: segment_frames on line {SEGMENT_LINE})"),  # the recipe's YAML set it
])
def test_vocoder_discriminator_lists_are_checked(argv, message, capsys):
    assert _refused(recipe_modules("vocoder", "train").train.Config, argv, capsys, VOCODER_YAML) == f"error: {message}\n"


def test_every_list_field_of_a_recipe_config_has_rules_for_its_values():
    """A list's values are checked by its field's rules: a number list without a Range takes 0 or -3."""
    for recipe in RECIPES:
        for name, (tp, rules) in field_specs(recipe_modules(recipe, "train").train.Config).items():
            if typing.get_origin(tp) is list and typing.get_args(tp)[0] in (int, float):
                assert any(isinstance(r, Range) for r in rules), f"{recipe} --{name}: no Range for its values"


# ---------------------------------------------------------------------------------------------
# Paths checked at parse time; fields the program sets
# ---------------------------------------------------------------------------------------------

def test_an_output_dir_that_is_a_file_is_refused_at_once(tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("x")
    assert _refused(RunConfig, ["--output_dir", str(f)], capsys) == \
        f"error: --output_dir: {f} is a file; name a folder (a new one, or a run's)\n"
    assert _refused(RunConfig, ["--output_dir", str(f / "run")], capsys) == \
        f"error: --output_dir: {f / 'run'} cannot be made: {f} is a file; name a folder (a new one, or a run's)\n"
    assert parse_config(RunConfig, ["--output_dir", str(tmp_path / "new" / "run")]).output_dir == str(tmp_path / "new/run")


@dataclass
class WithInternal:
    """A config with a field the program writes."""

    max_steps: int = 1  # steps
    derived: Annotated[bool, ResumeSafe, Internal] = False  # written by the program


def test_an_internal_field_is_not_a_setting(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_config(WithInternal, ["--help"])
    assert "--derived" not in capsys.readouterr().out
    assert _refused(WithInternal, ["--derived", "true"], capsys) == (
        "error: --derived is set by the program itself (recorded in the run's config.yaml), not on the command "
        "line: drop it\n")
    # a run's own config.yaml records it, and may be given back as --config
    save_config(WithInternal(derived=True), tmp_path / "config.yaml")
    assert parse_config(WithInternal, ["--config", str(tmp_path / "config.yaml")]).derived is True


def test_tts_symbols_derived_is_internal(capsys):
    tts = recipe_modules("tts", "train").train
    with pytest.raises(SystemExit):
        parse_config(tts.Config, ["--help"], default_yaml=ROOT / "recipes" / "tts" / "config.yaml")
    assert "symbols_derived" not in capsys.readouterr().out
    assert "set by the program itself" in _refused(tts.Config, ["--symbols_derived", "true"], capsys)
    assert "symbols_derived" in resume_safe_keys(tts.Config)  # resume: see test_tts_frontend


@pytest.mark.parametrize("argv,message", [
    (["--lm_alphas", "0.5,nan"], "--lm_alphas: must be a finite number, got nan"),  # was a grid with a nan weight
    (["--lm_alphas", "-1"], "--lm_alphas: must be ≥ 0, got -1.0 (in [-1.0])"),
    (["--lm_betas", ""], "--lm_betas: needs at least one value (comma-separated on the command line, a list in the YAML)"),
])
def test_asr_decode_lm_grids_are_checked_lists(argv, message, capsys, tmp_path):
    decode = recipe_modules("asr", "decode").decode
    checkpoint = ["--checkpoint", str(tmp_path)]
    assert parse_config(decode.EvalConfig, checkpoint).lm_betas == [0.0, 0.5, 1.0, 2.0, 3.0]
    assert _refused(decode.EvalConfig, checkpoint + argv, capsys) == f"error: {message}\n"


# ---------------------------------------------------------------------------------------------
# A run's saved config, read back as its Config (load_config)
# ---------------------------------------------------------------------------------------------

def test_load_config_reads_a_saved_config_as_the_class(tmp_path):
    from common.config import load_config

    save_config(Cfg(max_steps=7, splits=["a", "b"], use_x=True), tmp_path / "config.yaml")
    cfg = load_config(tmp_path, Cfg)
    assert type(cfg) is Cfg and cfg == Cfg(max_steps=7, splits=["a", "b"], use_x=True)


def test_load_config_fills_an_older_config_from_the_class_defaults_in_one_log_line(tmp_path, caplog):
    from common.config import load_config

    (tmp_path / "config.yaml").write_text("max_steps: 7\nlearning_rate: 0.5\n")  # written before the other fields
    with caplog.at_level("INFO"):
        cfg = load_config(tmp_path, Cfg)
    assert cfg == Cfg(max_steps=7, learning_rate=0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"{tmp_path / 'config.yaml'}: written before 4 setting(s) existed; they take their defaults: "
                     f"output_dir='out', data_dir=None, use_x=False, splits=None"]


@pytest.mark.parametrize("text,message", [
    ("max_steps: 7\nwarmup: 3\n", "'warmup' is not a setting of tests.common.test_config.Cfg: written by a newer "
                                  "version of this code, or by another recipe; use the code (and recipe) that trained it"),
    ("warmup: 3\nhop: 2\n", "'warmup' (and 1 more) is not a setting of"),
    ("max_steps: ten\n", "config.yaml, line 1: max_steps: expected int, got 'ten'"),
    ("- a\n", "config.yaml: expected a mapping of keys to values"),
    ("a: [\n", "config.yaml: not valid YAML"),
])
def test_load_config_refuses_what_the_class_cannot_hold_in_one_line(tmp_path, text, message):
    from common.config import load_config
    from common.config_rules import ConfigError

    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path, Cfg)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not str(refused.value).startswith("--config")  # no flag named it: the file did


def test_load_config_holds_a_saved_config_to_the_fields_rules_and_validate_naming_the_file(tmp_path):
    """A sealed final/config.yaml with `num_heads: 0` reached a ZeroDivisionError in decode.py: a saved
    config is checked as the command line is (the rules, then `validate()`), in one line naming the
    file and the key's line, never a --config flag nobody gave."""
    from common.config import load_config
    from common.config_rules import ConfigError

    asr, vocoder = recipe_config("asr"), recipe_config("vocoder")
    path = tmp_path / "config.yaml"
    save_config(asr(num_heads=0), path)
    line = path.read_text().splitlines().index("num_heads: 0") + 1
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path, asr)
    assert str(refused.value) == (f"{path}, line {line}: num_heads: must be ≥ 1, got 0 (changed since its run wrote "
                                  f"it, or written by another version of this code: use the run's own file, or the "
                                  f"code that trained it)")
    save_config(vocoder(periods=[2, 9000]), path)  # validate(): a period longer than a training segment
    with pytest.raises(ConfigError, match=rf"^{path}: periods: 9000 is longer than a training segment") as refused:
        load_config(tmp_path, vocoder)
    assert "--config" not in str(refused.value) and "\n" not in str(refused.value)


def test_load_config_does_not_hold_a_saved_config_to_what_this_machine_has(tmp_path):
    """The rules about this machine (a path exists, a tracker or a subset file is there) are not a saved
    config's: its run's data may have moved since, and a tool is given the data another way."""
    from common.config import load_config

    asr = recipe_config("asr")
    gone = str(tmp_path / "moved_away")
    save_config(asr(data_dir=gone, char_map=gone, train_subset=gone, output_dir=gone), tmp_path / "config.yaml")
    assert load_config(tmp_path, asr).data_dir == gone


def test_load_config_of_a_folder_without_one_says_so(tmp_path):
    from common.config import load_config
    from common.config_rules import ConfigError

    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'config.yaml'}: no such file$"):
        load_config(tmp_path, Cfg)


def test_a_parsed_config_carries_nothing_beside_its_fields_and_its_checks_survive_replace(tmp_path):
    """What a plain run gets is passed to `validate_changes`, not kept on the Config: a copy made with
    dataclasses.replace (common/training/run.py makes one) is the same Config."""
    asr = recipe_config("asr")
    yaml_path = ROOT / "recipes" / "asr" / "config.yaml"
    cfg = parse_config(asr, ["--dataset_name", "x/y"], default_yaml=yaml_path)
    assert set(vars(cfg)) == {f.name for f in dataclasses.fields(asr)}
    from common.config_rules import ConfigError, validate

    changed = dataclasses.replace(cfg, min_seconds=0.1)  # a setting a `datasets` source ignores
    with pytest.raises(ConfigError, match="--min_seconds does not apply to a --dataset_name source"):
        validate(changed, parse_config(asr, [], default_yaml=yaml_path))


def test_a_field_added_after_the_checkpoint_still_resumes_from_a_copied_state(tmp_path):
    """The class defaults that judge an added field travel in the TrainState's fields: a copy made
    with dataclasses.replace resumes as the original does."""
    from common.training.state import TrainState

    old_config = {"lr": 0.1, "max_steps": 10, "previews": 2}  # Toy, written before `decay` existed
    old = TrainState(config=old_config, config_hash=config_hash(old_config, ignore=("max_steps",)))

    @dataclass
    class Newer(Toy):
        decay: Annotated[float, Positive] = 1.0

    assert _save_and_resume(tmp_path, old, dataclasses.replace(TrainState.for_run(Newer(), 1, 1))) is not None


def test_a_cross_field_mistake_from_the_yaml_names_the_file_and_its_keys(tmp_path, capsys):
    """A value that only a cross-field check refuses (validate_changes here) names the YAML file and
    the lines of the keys it set; a key the command line gave is not attributed to the file."""
    from common.config import DatasetConfig

    @dataclass
    class WithFolderSplit(DatasetConfig):
        train_split: str = "train"
        FOLDER_ONLY = {"train_split": "use --train_split_name"}
        READS_TEXT = False

    y = tmp_path / "c.yaml"
    y.write_text("learning_rate: 1e-3\ndataset_name: corpus\ntrain_split: other\n")
    assert _refused(WithFolderSplit, ["--config", str(y)], capsys) == (
        f"error: --train_split applies to a --data_dir folder: with --dataset_name use --train_split_name "
        f"(--config {y}: train_split on line 3, dataset_name on line 2)\n")
    assert _refused(WithFolderSplit, ["--config", str(y), "--train_split", "again"], capsys) == (
        f"error: --train_split applies to a --data_dir folder: with --dataset_name use --train_split_name "
        f"(--config {y}: dataset_name on line 2)\n")
    y.write_text("dataset_name: corpus\n")  # nothing from the file in the message: unchanged
    assert _refused(WithFolderSplit, ["--config", str(y), "--streaming", "true"], capsys) == (
        "error: --streaming needs --per_device_train_batch_size (utterances per batch per process: streamed "
        "batches are counted in utterances, not seconds)\n")


def test_an_extra_column_flag_belongs_to_a_dataset_source(capsys):
    """A recipe's EXTRA_COLUMNS flag (--speaker_column_name) is refused without --dataset_name, as
    --text_column_name is; an EXTRA_COLUMNS key without its field is the recipe's mistake, named."""
    from common.config import DatasetConfig

    @dataclass
    class WithSpeaker(DatasetConfig):
        speaker_column_name: str = "speaker"  # the speaker label's column of a --dataset_name source
        EXTRA_COLUMNS = ("speaker",)

    assert parse_config(WithSpeaker, ["--dataset_name", "x", "--speaker_column_name", "spk"]).speaker_column_name == "spk"
    assert _refused(WithSpeaker, ["--speaker_column_name", "spk"], capsys) == (
        "error: --speaker_column_name applies to a --dataset_name source; give --dataset_name, or drop it\n")

    @dataclass
    class Undeclared(DatasetConfig):
        EXTRA_COLUMNS = ("speaker",)

    assert _refused(Undeclared, [], capsys) == ("error: Undeclared.EXTRA_COLUMNS names 'speaker': declare a field "
                                                "speaker_column_name (the source's column it is read from)\n")
