"""`--init_from auto`/`builtin` (common/training/builtin_base.py): which fresh runs start from the built-in
base, the one log line that says so with the base's cost, --help, and what the run's config records.
Unit level: the base itself is trained by the slow tests of tests/recipes/test_asr.py and test_tts.py."""

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import config_to_dict, parse_config
from common.training.builtin_base import (AUTO, AUTO_MAX_HOURS, COMPLETE_MARKER, KEYWORD, base_args, base_folder, base_steps,
                                          builtin_base, start_from_base, wants_base)
from common.training.sealing import MARKER, seal_export
from common.training.faults import UsageError
from tests.harness.recipe_import import recipe_modules

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("init_from,on_builtin,hours,use", [
    (AUTO, False, 0.5, True),  # a voice of 30 minutes: the base
    (AUTO, False, AUTO_MAX_HOURS - 0.01, True),
    (AUTO, False, AUTO_MAX_HOURS, False),  # a large corpus gains nothing from 0.82 h of synthetic speech
    (AUTO, False, 960.0, False),
    (AUTO, False, None, False),  # a stream: its hours are not read ahead
    (AUTO, True, 0.82, False),  # the built-in corpus is the base's own data
    (KEYWORD, False, 960.0, True),  # builtin: always
    (KEYWORD, True, 0.82, False),
    (None, False, 0.5, False),
])
def test_auto_takes_the_base_for_small_data_only_and_builtin_always(init_from, on_builtin, hours, use):
    assert wants_base(init_from, on_builtin, hours)[0] is use


def _asr_cfg(tmp_path, *argv):
    """ASR's config as a plain run on a voice of one's own gets it (config.yaml's init_from)."""
    train = recipe_modules("asr", "train").train
    cfg = parse_config(train.Config, ["--data_dir", str(tmp_path), "--data_cache_dir", str(tmp_path / "cache"), *argv],
                       default_yaml=ROOT / "recipes" / "asr" / "config.yaml")
    return train, cfg


def test_a_fresh_run_says_its_choice_the_bases_cost_and_how_to_skip_or_force_it_in_one_line(tmp_path):
    train, cfg = _asr_cfg(tmp_path)
    script, args = ROOT / "recipes" / "asr" / "train.py", base_args(cfg, train.BASE_FIELDS)
    lines = []
    assert start_from_base(script, cfg, args, 0.5, train.BASE_STEPS_PER_S, log=lines.append) is True
    assert lines == ["--init_from auto: 0.50 h of training data, under 10 h: first training the built-in base "
                     "(3500 steps on the built-in corpus, once per machine: roughly 6 min on 2 CPU cores at the 10.3 "
                     "steps/s measured there, less on a GPU), then this run from it; --init_from none skips it "
                     "(from scratch)"]
    assert start_from_base(script, cfg, args, 25.0, train.BASE_STEPS_PER_S, log=lines.append) is False
    assert lines[1] == ("--init_from auto: 25.0 h of training data, 10 h or more: from scratch; --init_from builtin "
                        "starts from the built-in base instead (3500 steps on the built-in corpus, once per machine: "
                        "roughly 6 min on 2 CPU cores at the 10.3 steps/s measured there, less on a GPU)")
    folder = base_folder(script, args, cfg.data_cache_dir)  # trained before on this machine: no wait
    folder.mkdir(parents=True)
    (folder / COMPLETE_MARKER).write_text("{}")
    assert start_from_base(script, cfg, args, 0.5, train.BASE_STEPS_PER_S, log=lines.append) is True
    assert lines[2] == ("--init_from auto: 0.50 h of training data, under 10 h: starting from the built-in base, "
                        "trained on this machine before (no wait); --init_from none trains from scratch")
    assert all("\n" not in line for line in lines)


def test_the_bases_steps_are_its_yamls(tmp_path):
    """The time is estimated from the steps the base will train: --base_config's max_steps."""
    base_yaml = tmp_path / "base.yaml"
    base_yaml.write_text("max_steps: 470\n")
    train, cfg = _asr_cfg(tmp_path, "--init_from", "builtin", "--base_config", str(base_yaml))
    lines = []
    start_from_base(ROOT / "recipes" / "asr" / "train.py", cfg, base_args(cfg, train.BASE_FIELDS), 50.0,
                    train.BASE_STEPS_PER_S, log=lines.append)
    assert lines == ["--init_from builtin: asked for, whatever the data's size: first training the built-in base "
                     "(470 steps on the built-in corpus, once per machine: roughly 1 min on 2 CPU cores at the 10.3 "
                     "steps/s measured there, less on a GPU), then this run from it; --init_from none skips it "
                     "(from scratch)"]


def test_a_voice_caps_at_max_steps_and_its_base_trains_base_max_steps(tmp_path):
    """config.yaml's base is shorter than a voice's cap: the base's command carries its own --max_steps
    (and its estimate counts those); a --base_config YAML that sets max_steps wins over base_max_steps."""
    train, cfg = _asr_cfg(tmp_path)
    args = base_args(cfg, train.BASE_FIELDS)
    assert (cfg.max_steps, cfg.base_max_steps) == (4000, 3500)
    assert args[args.index("--max_steps") + 1] == "3500"
    assert base_steps(ROOT / "recipes" / "asr" / "train.py", cfg) == 3500
    base_yaml = tmp_path / "base.yaml"
    base_yaml.write_text("max_steps: 470\n")
    train, cfg = _asr_cfg(tmp_path, "--base_config", str(base_yaml), "--base_max_steps", "900")
    assert "--max_steps" not in base_args(cfg, train.BASE_FIELDS)
    assert base_steps(ROOT / "recipes" / "asr" / "train.py", cfg) == 470
    base_yaml.write_text("learning_rate: 0.002\n")  # no max_steps of its own: base_max_steps decides
    args = base_args(cfg, train.BASE_FIELDS)
    assert args[args.index("--max_steps") + 1] == "900"


def test_auto_above_the_threshold_starts_from_scratch_without_the_base(tmp_path, monkeypatch, caplog):
    """The recipe's own seam: no base is trained (builtin_base is not called), and the line is logged."""
    train, cfg = _asr_cfg(tmp_path)
    monkeypatch.setattr(train, "builtin_base", lambda *a, **k: pytest.fail("the base was trained"))
    with caplog.at_level(logging.INFO):
        assert train.init_folder(cfg, 12.5) is None
    assert "--init_from auto: 12.5 h of training data, 10 h or more: from scratch" in caplog.text


def test_the_vocoders_base_shares_its_lists_and_says_its_cost(tmp_path):
    """The vocoder's base: its list fields (periods, ...) given as the parser reads them back; the plan line
    with config.yaml's 1000 steps at the speed measured on 2 cores; the built-in voice itself from scratch."""
    train = recipe_modules("vocoder", "train").train
    yaml_path = ROOT / "recipes" / "vocoder" / "config.yaml"
    cfg = parse_config(train.Config, ["--data_dir", str(tmp_path), "--data_cache_dir", str(tmp_path / "cache"),
                                      "--periods", "2,3"], default_yaml=yaml_path)
    args = base_args(cfg, train.BASE_FIELDS)
    assert args[args.index("--periods") + 1] == "2,3" and args[args.index("--magnitude_prior") + 1] == "true"
    assert parse_config(train.Config, args, default_yaml=yaml_path).periods == [2, 3]
    lines = []
    assert start_from_base(ROOT / "recipes" / "vocoder" / "train.py", cfg, args, 0.3, train.BASE_STEPS_PER_S,
                           log=lines.append) is True
    assert lines == ["--init_from auto: 0.30 h of training data, under 10 h: first training the built-in base (1000 steps "
                     "on the built-in corpus, once per machine: roughly 10 min on 2 CPU cores at the 1.65 steps/s measured "
                     "there, less on a GPU), then this run from it; --init_from none skips it (from scratch)"]
    itself = parse_config(train.Config, [], default_yaml=yaml_path)
    assert start_from_base(ROOT / "recipes" / "vocoder" / "train.py", itself, args, 0.82, train.BASE_STEPS_PER_S,
                           log=lines.append) is False
    assert lines[1] == ("--init_from auto: this run trains on the built-in corpus: from scratch (it is the base of "
                        "other voices)")


@pytest.mark.parametrize("recipe", ["asr", "tts", "vocoder"])
def test_help_says_what_auto_does_and_the_saved_config_keeps_auto(recipe):
    """--help (where a user decides) says that auto trains a second model first below the threshold; a
    run records `auto` as asked, so that a re-launch of the same command resumes (the choice is made
    at a fresh start only, from the training data's hours, which a resume's data check pins)."""
    train = recipe_modules(recipe, "train").train
    yaml_path = ROOT / "recipes" / recipe / "config.yaml"
    # The script itself (answered before its heavy imports): --help reads the comments from its source.
    out = subprocess.run([sys.executable, str(ROOT / "recipes" / recipe / "train.py"), "--help"], capture_output=True,
                         text=True, check=True).stdout
    rule = "must exist, or builtin, auto, or a Hub id owner/name" if recipe == "asr" else "must exist, or builtin, or auto"
    head = f"  --init_from str | None ({rule}) = 'auto' (from config.yaml)\n"
    assert head in out
    comment = out.split(head)[1].splitlines()[0]
    assert f"auto: under {AUTO_MAX_HOURS:g} h of training data, first trains a second model" in comment
    assert "none: from scratch" in comment
    assert config_to_dict(parse_config(train.Config, [], default_yaml=yaml_path))["init_from"] == "auto"


def test_a_damaged_cached_base_names_the_cache_folder_to_delete(tmp_path):
    """A cached base is made by no training command of the user's: its refusal names the cache folder to
    delete (the next run rebuilds it), in one line, before anything reads it; no child is started."""
    script = tmp_path / "recipe" / "train.py"
    script.parent.mkdir()
    script.write_text("raise SystemExit('never run: the base is cached')\n")
    args = ["--data_dir", "none"]
    folder = base_folder(script, args, str(tmp_path / "cache"))
    (folder / "final").mkdir(parents=True)
    (folder / "final" / "model.safetensors").write_bytes(b"weights")
    seal_export(folder / "final")
    (folder / COMPLETE_MARKER).write_text(json.dumps({"command": []}))
    assert builtin_base(script, args, str(tmp_path / "cache")) == folder
    (folder / "final" / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(UsageError) as e:
        builtin_base(script, args, str(tmp_path / "cache"))
    assert str(e.value) == (f"--init_from builtin: the cached base {folder}/final: damaged (model.safetensors is "
                            f"corrupted (digest mismatch)): it is a cache: delete {folder} and re-run this command, "
                            f"which rebuilds it (exported again from its training run {folder}.run, or trained "
                            f"again if that is gone)")
    (folder / "final" / MARKER).unlink()
    with pytest.raises(UsageError, match=f"no COMPLETE marker.*it is a cache: delete {folder} and re-run"):
        builtin_base(script, args, str(tmp_path / "cache"))


def test_a_base_kept_with_its_checkpoint_refuses_one_without_it_or_with_it_damaged(tmp_path):
    """`checkpoint=True` (the vocoder's: its discriminators are in its checkpoints only): the cached base's
    last checkpoint is sealed like its final/, and a cache that lacks it or holds it damaged is refused in one
    line naming the cache folder to delete."""
    script = tmp_path / "recipe" / "train.py"
    script.parent.mkdir()
    script.write_text("raise SystemExit('never run: the base is cached')\n")
    args, cache = ["--data_dir", "none"], str(tmp_path / "cache")
    folder = base_folder(script, args, cache)
    for part in ("final", "checkpoints/step_00000003"):
        (folder / part).mkdir(parents=True)
        (folder / part / "model.safetensors").write_bytes(b"weights")
        seal_export(folder / part)
    (folder / COMPLETE_MARKER).write_text(json.dumps({"command": []}))
    assert builtin_base(script, args, cache, checkpoint=True) == folder
    (folder / "checkpoints" / "step_00000003" / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(UsageError, match=rf"^--init_from builtin: the cached base {folder}/checkpoints/step_00000003: "
                                         rf"damaged \(model.safetensors is corrupted \(digest mismatch\)\): it is a cache: "
                                         rf"delete {folder} and re-run"):
        builtin_base(script, args, cache, checkpoint=True)
    shutil.rmtree(folder / "checkpoints")
    assert builtin_base(script, args, cache) == folder  # a recipe that keeps final/ only: complete
    with pytest.raises(UsageError, match=rf"^--init_from builtin: the cached base {folder}/checkpoints: no complete "
                                         rf"step_\*/ folder in it \(a base cached without its checkpoint\): it is a cache"):
        builtin_base(script, args, cache, checkpoint=True)
