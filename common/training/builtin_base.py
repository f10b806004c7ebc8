"""A recipe's own run on the built-in corpus, trained once per machine: the start of a small voice.

A user's voice of 20-60 minutes is too little for a model trained from scratch; started from the
same model trained on the built-in espeak-ng corpus first (transfer), the TTS speaks and the ASR reads
it (recipes/tts/README.md, "Transfer"; recipes/asr/README.md, "A new voice"). `builtin_base` makes that
the default path (`--init_from builtin`) without a second command: it trains the
recipe's `train.py` on the built-in corpus in a child process, once per cache folder (the built-in
corpus's: `--data_cache_dir`, `$SPEECH_RECIPES_CACHE` or `~/.cache/speech_recipes`), and returns
the folder of its `final/` export for `--init_from`. Every later voice with the same base settings
starts from the same folder.

- The folder's name holds a digest of the child's command and of the recipe's source and YAML: a
  change to either trains a new base (an old one might not load into the new model), never a stale one.
- Every process of a run may call it: one trains (`prepare_once`: a lock file and a completion marker,
  NFS-safe), the others wait. The child trains into `<folder>.run`, which a re-launch resumes
  exactly (the recipe's resume), so an interrupted base costs only the steps since its last checkpoint.
- The child does not outlive us: it is started with the marker `common.training.launcher.launched`
  looks for, so it watches its parent and saves and stops once we are gone; and it never sees this
  run's distributed environment (it is one process of its own).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from common.data.cache import cache_root
from common.training.prepare import prepare_once

KEYWORD = "builtin"  # the --init_from value that asks for this base
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


def base_args(cfg, fields) -> list[str]:
    """The base's arguments for a run of `cfg`: its `--base_config` YAML if any, the built-in corpus,
    from scratch, and `--name value` for each of `fields` (the settings a base shares with the run
    started from it: shape, units, exactness), as the recipe's parser reads them back."""
    flag = lambda v: "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    return [*(["--config", str(Path(cfg.base_config).resolve())] if cfg.base_config else []),
            "--data_dir", "none", "--dataset_name", "none", "--init_from", "none", "--report_to", "none",
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


def builtin_base(script: Path, args: list[str], data_cache_dir: str | None, log=print) -> Path:
    """Train `python script *args --output_dir <folder>.run` once (see the module docstring) and return
    the folder that holds a copy of its `final/` (an `--init_from` target). `args` must make it a run
    on the built-in corpus (`base_args`); the child's output goes to our stdout/stderr. Raises RunError
    (one line, naming the command) when the child fails."""
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
        env["ACCELERATE_MIXED_PRECISION"] = "no"  # launcher.launched(): the child stops once we are gone
        returncode = _wait_for(subprocess.Popen(command, env=env))
        if returncode != 0:
            from common.training.faults import RunError  # (torch: not for tools/corpus.py's cache_root)

            raise RunError(f"the built-in base's training failed (exit {returncode}); "
                           f"its command, to run and read by hand: {' '.join(command)}")
        shutil.copytree(work / "final", tmp / "final")

    return prepare_once(folder, build, timeout_s=6 * 3600.0, info={"command": command})
