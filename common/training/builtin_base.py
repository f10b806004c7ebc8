"""A recipe's own run on the built-in corpus, trained once per machine: the start of a small voice.

A user's voice of 20-60 minutes is too little for a model trained from scratch; started from the
same model trained on the built-in espeak-ng corpus first (transfer), the TTS speaks and the ASR reads
it (recipes/tts/README.md, "Transfer"; recipes/asr/README.md, "A new voice"). `builtin_base` makes that
the default path (`--init_from builtin`) without a second command: it trains the
recipe's `train.py` on the built-in corpus in a child process, once per cache folder (the built-in
corpus's: `--data_cache_dir`, `$SPEECH_RECIPES_CACHE` or `~/.cache/speech_recipes`), and returns
the folder of its `final/` export for `--init_from` (and of its last checkpoint, for a recipe whose
export leaves out what a start needs: the vocoder's discriminators). Every later voice with the same
base settings starts from the same folder.

- The folder's name holds a digest of the child's command and of the recipe's source and YAML: a
  change to either trains a new base (an old one might not load into the new model), never a stale one.
- Every process of a run may call it: one trains (`prepare_once`: a lock file and a completion marker,
  NFS-safe), the others wait. The child trains into `<folder>.run`, which a re-launch resumes
  exactly (the recipe's resume), so an interrupted base costs only the steps since its last checkpoint.
- The child does not outlive us: its environment names our pid (`launcher.LAUNCHER_PID_ENV`), so it
  watches us and saves and stops once we are gone (at once if we were gone before it looked); and it
  never sees this run's distributed environment (it is one process of its own).

`--init_from auto` (the recipes' config.yaml) takes the base only for small training data, below
AUTO_MAX_HOURS: the built-in corpus's 0.82 h of synthetic speech is what a voice of 20-60 minutes
lacks, and a small share of a larger corpus. `builtin` takes it always; `none` never. A fresh run says
in one log line which it chose, why, what the base costs (its steps and an approximate time) and how to
skip or force it (`start_from_base`). The choice is a pure function of the setting and of the training
data's hours, made only at a fresh start: a resume loads its checkpoint instead, and its data is the
checkpoint's (the data fingerprint, checked on resume). The saved config keeps `auto`, what was asked,
so that a re-launch of the same command compares equal; the log line records the choice.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from common.config_yaml import load_yaml
from common.data.cache import cache_root
from common.training.launcher import LAUNCHER_PID_ENV
from common.training.prepare import COMPLETE_MARKER, prepare_once

KEYWORD = "builtin"  # the --init_from value that asks for this base
AUTO = "auto"  # the --init_from value that asks for it on small training data only
AUTO_MAX_HOURS = 10.0  # hours of training audio from which `auto` trains from scratch (12x the base's corpus)
# What a launcher puts in a child's environment that must not reach the base's own process: it is a
# run of one process, not a member of this run's process group.
_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


def source_digest(recipe_dir: Path) -> str:
    """sha256 of the recipe folder's Python files and YAML configs (names and contents, sorted)."""
    h = hashlib.sha256()
    for path in sorted([*recipe_dir.glob("*.py"), *recipe_dir.glob("*.yaml")]):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def base_folder(script: Path, args: list[str], data_cache_dir: str | None) -> Path:
    """The base's folder for `script` trained with `args` (see the module docstring): the digest covers
    the recipe's source, the arguments and the contents of the `--config` YAML they name."""
    recipe_dir = script.resolve().parent
    yaml_text = Path(args[args.index("--config") + 1]).read_text() if "--config" in args else ""
    key = hashlib.sha256("\0".join([source_digest(recipe_dir), yaml_text, *args]).encode()).hexdigest()[:16]
    return cache_root(data_cache_dir) / f"{recipe_dir.name}_base-{key}"


def uses_builtin_corpus(cfg) -> bool:
    """Whether a run trains on the built-in corpus (no --data_dir, no --dataset_name): it is a base itself."""
    return cfg.data_dir is None and cfg.dataset_name is None


def wants_base(init_from: str | None, on_builtin_corpus: bool, hours: float | None) -> tuple[bool, str]:
    """Whether a fresh run with this `--init_from` starts from the base, and why (a clause for the log).
    `hours`: of the training data; None where it is not known before training (a stream's)."""
    if init_from not in (KEYWORD, AUTO):
        return False, "a folder or none: not the built-in base"
    if on_builtin_corpus:
        return False, "this run trains on the built-in corpus: from scratch (it is the base of other voices)"
    if init_from == KEYWORD:
        return True, "asked for, whatever the data's size"
    if hours is None:
        return False, "a streamed source (its hours are not read ahead; streams are for large data)"
    if hours >= AUTO_MAX_HOURS:
        return False, f"{hours:.1f} h of training data, {AUTO_MAX_HOURS:g} h or more"
    return True, f"{hours:.2f} h of training data, under {AUTO_MAX_HOURS:g} h"


def _base_max_steps(cfg) -> int | None:
    """The recipe's `base_max_steps` (a voice's cap need not be its base's), unless a --base_config YAML
    sets its own `max_steps`, which wins; None: neither, the base's YAML decides."""
    steps = getattr(cfg, "base_max_steps", None)
    if steps is None or (cfg.base_config and "max_steps" in load_yaml(Path(cfg.base_config))):
        return None
    return steps


def base_steps(script: Path, cfg) -> int:
    """The base's optimizer steps: the recipe's `base_max_steps` (`_base_max_steps`; `base_args` passes
    it), else `max_steps` of its YAML (--base_config, else the recipe's config.yaml), else the Config's
    default."""
    if (steps := _base_max_steps(cfg)) is not None:
        return steps
    yaml_path = Path(cfg.base_config) if cfg.base_config else script.resolve().with_name("config.yaml")
    default = type(cfg).max_steps
    return int(load_yaml(yaml_path).get("max_steps", default)) if yaml_path.is_file() else default


def plan_line(init_from: str, use: bool, why: str, steps: int, steps_per_s: float, cached: bool,
              on_builtin_corpus: bool) -> str:
    """The one log line of `start_from_base`: the choice, why, the base's cost, how to skip or force it.
    `steps_per_s`: the base's speed measured on a 2-core CPU (the recipe's README): the time is an
    estimate from the step count, said as one."""
    minutes = steps / steps_per_s / 60
    cost = (f"{steps} steps on the built-in corpus, once per machine: roughly {max(1, round(minutes))} min on "
            f"2 CPU cores at the {steps_per_s:g} steps/s measured there, less on a GPU")
    if use and cached:
        return (f"--init_from {init_from}: {why}: starting from the built-in base, trained on this machine "
                f"before (no wait); --init_from none trains from scratch")
    if use:
        return (f"--init_from {init_from}: {why}: first training the built-in base ({cost}), then this run "
                f"from it; --init_from none skips it (from scratch)")
    if init_from == AUTO and not on_builtin_corpus:  # auto chose none: builtin forces the base
        return (f"--init_from auto: {why}: from scratch; --init_from builtin starts from the built-in base "
                f"instead ({cost})")
    return f"--init_from {init_from}: {why}"


def start_from_base(script: Path, cfg, args: list[str], hours: float | None, steps_per_s: float, log=print) -> bool:
    """Whether a fresh run of `cfg` (`--init_from builtin` or `auto`) starts from the built-in base
    trained with `args` (`base_args`), said in one line (`log`; see the module docstring)."""
    on_builtin = uses_builtin_corpus(cfg)
    use, why = wants_base(cfg.init_from, on_builtin, hours)
    cached = (base_folder(script, args, cfg.data_cache_dir) / COMPLETE_MARKER).is_file()
    log(plan_line(cfg.init_from, use, why, base_steps(script, cfg), steps_per_s, cached, on_builtin))
    return use


def base_args(cfg, fields) -> list[str]:
    """The base's arguments for a run of `cfg`: its `--base_config` YAML if any, the built-in corpus,
    from scratch, its `--max_steps` where the recipe sets `base_max_steps` (`_base_max_steps`), and
    `--name value` for each of `fields` (the settings a base shares with the run started from it: shape,
    units, exactness), as the recipe's parser reads them back."""
    def flag(v) -> str:  # as the parser reads it back: none, true/false, a list comma-separated
        if isinstance(v, (list, tuple)):
            return ",".join(map(flag, v))
        return "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    return [*(["--config", str(Path(cfg.base_config).resolve())] if cfg.base_config else []),
            "--data_dir", "none", "--dataset_name", "none", "--init_from", "none", "--report_to", "none",
            *(["--max_steps", str(steps)] if (steps := _base_max_steps(cfg)) is not None else []),
            *[arg for name in fields for arg in (f"--{name}", flag(getattr(cfg, name)))]]


def _wait_for(child: subprocess.Popen, save_s: float = 600.0) -> int:
    """The child's exit code. If a signal stops us while it trains (SIGTERM, Ctrl-C: the exception it
    raises here), the child is asked to stop the same way (SIGTERM: it saves at its next step boundary;
    a second signal after Ctrl-C's is ignored by it) and given `save_s` seconds to do so, then we go on
    stopping: the re-launch resumes it. (subprocess.run would SIGKILL it at once.)"""
    try:
        return child.wait()
    except BaseException:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(save_s)
        except subprocess.TimeoutExpired:
            child.kill()
        raise


def builtin_base(script: Path, args: list[str], data_cache_dir: str | None, log=print,
                 checkpoint: bool = False) -> Path:
    """Train `python script *args --output_dir <folder>.run` once (see the module docstring) and return
    the folder that holds a copy of its `final/` (an `--init_from` target). `args` must make it a run
    on the built-in corpus (`base_args`); the child's output goes to our stdout/stderr. `checkpoint`:
    the folder also holds a copy of the run's last checkpoint, `checkpoints/step_*/` (what an export
    leaves out, e.g. a GAN's discriminators). Raises RunError (one line, naming the command) when the
    child fails, UsageError (one line, naming the cache folder to delete) when the cached base fails
    its seal."""
    folder = base_folder(script, args, data_cache_dir)
    work = folder.with_name(folder.name + ".run")
    # The cache is where the base lives, not part of its key: `--data_cache_dir` unset, or set to the
    # same folder, is the same base. The child builds its corpus there too.
    command = [sys.executable, str(script.resolve()), *args, "--data_cache_dir", str(folder.parent),
               "--output_dir", str(work)]

    def build(tmp: Path) -> None:
        log(f"the built-in base: training it once for this machine into {folder} (its run: {work}; "
            f"later voices with these settings start from it at once):\n  {' '.join(command)}")
        env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_ENV and not k.startswith("ACCELERATE_")}
        env[LAUNCHER_PID_ENV] = str(os.getpid())  # launcher.launched(): the child stops once we are gone
        returncode = _wait_for(subprocess.Popen(command, env=env))
        if returncode != 0:
            from common.training.faults import RunError  # (torch: not for tools/corpus.py's cache_root)

            raise RunError(f"the built-in base's training failed (exit {returncode}); "
                           f"its command, to run and read by hand: {' '.join(command)}")
        shutil.copytree(work / "final", tmp / "final")
        if checkpoint:  # the newest: the step final/ was exported from (a run that saves at its last step)
            from common.training.sealing import find_latest_checkpoint

            last = find_latest_checkpoint(work)
            shutil.copytree(last, tmp / "checkpoints" / last.name)

    prepare_once(folder, build, timeout_s=6 * 3600.0, info={"command": command})
    _check_cached(folder, work, checkpoint)
    return folder


def _check_cached(folder: Path, work: Path, checkpoint: bool) -> None:
    """Refuse a cached base whose `final/` (and with `checkpoint`, its checkpoint, or the lack of one)
    fails its seal (`seal_problem`), in one line that names the cache folder to delete: no training
    command made it, this run's own makes it again.

    Not rebuilt here: every process of this run, and any other run on the machine that shares the
    cache, may be reading the folder now (deleting it under them is not safe), and a sealed folder
    that changed was changed by something (a disk fault, a hand) the user should hear of."""
    from common.training.sealing import find_latest_checkpoint, seal_problem
    from common.training.faults import UsageError

    remedy = (f"it is a cache: delete {folder} and re-run this command, which rebuilds it (exported again "
              f"from its training run {work}, or trained again if that is gone)")
    kept = [folder / "final", *([find_latest_checkpoint(folder) or folder / "checkpoints"] if checkpoint else [])]
    for part in kept:
        problem = (seal_problem(part, remedy) if part.name != "checkpoints"
                   else f"no complete step_*/ folder in it (a base cached without its checkpoint): {remedy}")
        if problem:
            raise UsageError(f"--init_from builtin: the cached base {part}: {problem}")
