"""Typed recipe configs: dataclass defaults < YAML file < `--key value` command-line flags.

Every recipe declares one `@dataclass` whose fields are its whole configuration, each with a trailing
`# comment` (its meaning and unit) and grouped by `# --- section ---` lines. Training recipes extend
`RunConfig`, the settings they all share. This module turns `sys.argv` into an instance and checks
every value before anything slow happens: it imports nothing heavy (no torch), so `--help` and every
mistake are answered in well under a second.

A field carries its own rules in its type, `Annotated[type, rule, ...]` (the rules and how values are
held to them: `common.config_rules`), so that this module names no recipe's field:

    max_steps: Annotated[int, Count, ResumeSafe] = 1000  # optimizer steps
    mask_prob: Annotated[float, Range(0, 1)] = 0.01  # probability that a position starts a span
    init_from: Annotated[str | None, ExistingPath] = None  # a BEST-RQ output_dir

- `Range(lo, hi, lo_open=, hi_open=)` bounds a number (`Count` ≥ 1, `NonNegative` ≥ 0, `Positive`
  > 0, `Fraction` in [0, 1]). A float must be finite (no nan/inf) unless its Range says `finite=False`.
- `ExistingPath`: must exist when given (`ExistingPathOr("builtin")`: or be that word). `Folder`: a
  folder to write into, made if missing (not a file, nor under one). `typing.Literal[...]` fields
  take one of their values; `bool` fields take true/false (also yes/no, on/off, 1/0).
- A list field's rules hold for each of its values (`list[Annotated[int, Count]]`, or the rule on
  the field); a list needs at least one value unless the field carries `MayBeEmpty` (an empty value
  must never silently turn something off). On the command line it is comma-separated; one that
  carries `SpaceSeparated` takes every value after its flag up to the next `--flag` instead
  (`--audio *.wav`: a shell's glob, file names that may hold commas).
- `Names`: a text field of comma-separated names (`--train_split a,b`): none may be empty.
- `Internal`: written by the program (recorded in the run's config.yaml): not in `--help`, refused on
  the command line.
- `ResumeSafe`: may differ between a checkpoint and its re-launch (where to write, when to stop, how
  often to log); every other field must match for a resume (`resume_safe_keys`).
- A recipe re-declares a shared field to change its default (`max_steps: int = 1500`): the field
  keeps RunConfig's rules, comment and place. It leaves out one it has no use for with `LEFT_OUT`
  (RunConfig's docstring): not in `--help`, refused when given, not saved.
- A Config may add cross-field checks in a `validate(self)` method that raises ValueError, and
  checks of what the user changed in `validate_changes(self, plain)`, where `plain` is the Config a
  plain run gets (the recipe's YAML over the class defaults), passed in by parse_config.

Unknown keys are refused with the closest valid name (a typo must never silently train the
default). A number is written with the digits 0-9 (int() also reads '١٢'). YAML files are read as YAML
1.2's core schema (`common.config_yaml`: `010` is 10, `1:30` and `0x10` are strings, a key given twice is
refused; so is a flag given twice on the command line). A mistake is one line on stderr and exit code
2, no traceback; a bad value from a YAML file names the file and the key's line, and a cross-field
refusal (`validate`, `validate_changes`) the file and the lines of the keys it names that the file
set. A run's saved config.yaml, read back by a tool (`load_config`), is held to the same rules but
those about this machine, and a refusal names that file. `--help` lists every field with its type,
rules, effective default (the YAML's value where it sets one) and comment.
`exit_on_signals_during_start_up` makes a Ctrl-C during a training script's slow imports one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import os
import re
import signal
import sys
import time
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml

from common.config_rules import (ConfigError, Count, ExistingPath, FieldError, Folder, Internal, MayBeEmpty, NonNegative,
                                 Positive, Range, ResumeSafe, SpaceSeparated, Trackers, check_fields, convert_value,
                                 field_docs, field_specs, is_bool, is_list, left_out, not_a_setting, type_name, validate)
from common.config_yaml import YamlKeys, load_yaml
from common.training.launcher import stop_reason, watch_launcher

T = TypeVar("T")

# Exit code of a process stopped by a signal before training (= common.training.faults.PREEMPTED_EXIT_CODE:
# that module imports torch, this one must not).
START_UP_SIGNAL_EXIT_CODE = 75



# ---------------------------------------------------------------------------------------------
# The settings every training recipe shares
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class RunConfig:
    """Settings shared by the training recipes; a recipe's Config extends it with its own.

    A recipe that has no use for one of these (a vocoder has no log-mel statistics) leaves it out
    with a class attribute naming it and saying why:

        LEFT_OUT = {"stats_utterances": "the generator reads log-mels as they are (no mean/std)"}

    A left-out field is not in `--help`, not written into the run's config.yaml, and refused in a
    YAML file or on the command line with that reason; a saved config.yaml of the recipe that still
    holds it (written before it was left out) is read without it. The dataclass keeps the attribute
    (its default): the recipe's code must not read it."""

    # --- run ---
    output_dir: Annotated[str, Folder, ResumeSafe] = "outputs/run"  # checkpoints/, final/, metrics.jsonl; re-running with it resumes
    overwrite_output_dir: Annotated[bool, ResumeSafe] = False  # allow an --output_dir that holds files but is not a run of this recipe
    max_steps: Annotated[int, Count, ResumeSafe] = 1000  # optimizer steps
    resume: Annotated[bool, ResumeSafe] = True  # re-running with an --output_dir resumes from its newest intact checkpoint; false: start over from step 0 there (its checkpoints moved to checkpoints.before_<time>/, not deleted)
    seed: int = 42
    mixed_precision: Literal["no", "bf16", "fp16"] | None = None  # None: the accelerate profile's; set: overrides it
    num_threads: Annotated[int, NonNegative, ResumeSafe] = 0  # torch threads per process; 0 = auto (resume: the checkpoint's; else cores ÷ processes)
    deterministic: bool = False  # deterministic kernels: bit-exact resume on GPUs too (slower)
    ddp_timeout: Annotated[float, Positive, ResumeSafe] = 60.0  # seconds a collective waits for a peer before failing (a dead rank)
    # --- data ---
    data_dir: Annotated[str | None, ExistingPath] = None  # corpus root in the recipe's layout (its README); None = the built-in espeak-ng corpus
    builtin_corpus: Literal["default", "tiny", "ssl10h", "ssltiny"] = "default"  # built-in corpus profile when data_dir is None (tools/corpus.py; ssl*: ~10 h of unlabelled-style training audio)
    data_cache_dir: Annotated[str | None, Folder, ResumeSafe] = None  # where the built-in corpus is generated; None = ~/.cache/speech_recipes
    sample_rate: Annotated[int, Count] = 16000  # Hz
    wrong_sample_rate: Literal["resample", "refuse"] = "resample"  # audio at another rate: resampled on load, or refused
    min_seconds: Annotated[float, NonNegative] = 0.5  # shorter utterances are refused by the data check
    max_seconds: Annotated[float, Positive] = 30.0  # longer utterances are refused by the data check
    on_bad_data: Literal["error", "skip"] = "error"  # unusable entries: stop with a report, or drop them and log counts
    # How deeply files are read may change on resume: the entries it lets through are compared by the
    # data fingerprint instead.
    data_check: Annotated[Literal["header", "full"], ResumeSafe] = "header"  # audio check: "header" = header + the last block of each file decoded; "full" = every sample (also finds silent/NaN audio, mid-file damage; slower)
    allow_data_change: Annotated[bool, ResumeSafe] = False  # resume on purpose although the training data changed since the checkpoint (logged, recorded in the checkpoint)
    max_batch_seconds: Annotated[float, Positive] = 60.0  # padded seconds of audio per batch, per process
    num_buckets: Annotated[int, Count] = 10  # duration buckets for batching
    num_workers: Annotated[int | None, NonNegative, ResumeSafe] = None  # DataLoader workers per process; None = auto (CPU: 0, GPU: up to 4); results do not depend on it
    memory_cache_mb: Annotated[int, NonNegative, ResumeSafe] = 512  # per process and set: features kept in RAM after their first read, so later epochs skip decoding (only without data workers, the CPU default; 0 = off)
    stats_utterances: Annotated[int, Count] = 500  # training utterances used for the global mean/std of log-mels
    # --- optimization ---
    learning_rate: Annotated[float, Range(0, 1, lo_open=True)] = 2e-3  # peak LR after warm-up
    warmup_steps: Annotated[int, Count] = 200  # optimizer steps of linear warm-up, then lr_scheduler_type
    lr_scheduler_type: Literal["inverse_sqrt", "constant_with_warmup"] = "inverse_sqrt"  # after warm-up: LR ∝ 1/sqrt(step), or the peak LR throughout
    weight_decay: Annotated[float, NonNegative] = 0.01  # AdamW, on weight matrices only
    adam_beta1: Annotated[float, Range(0, 1, hi_open=True)] = 0.9
    adam_beta2: Annotated[float, Range(0, 1, hi_open=True)] = 0.98
    max_grad_norm: Annotated[float, Positive] = 5.0  # the global gradient norm is clipped to this
    max_nonfinite_updates: Annotated[int, Count, ResumeSafe] = 5  # consecutive NaN/Inf gradient updates skipped before the run stops
    # May change on resume: the global batch (processes × this) is checked instead (global_batch_plan).
    gradient_accumulation_steps: Annotated[int, Count, ResumeSafe] = 1  # batches per optimizer step
    # --- logging / checkpoints ---
    logging_steps: Annotated[int, Count, ResumeSafe] = 10  # optimizer steps between metrics.jsonl lines
    eval_steps: Annotated[int, NonNegative, ResumeSafe] = 250  # optimizer steps between validation passes (0 = never)
    save_steps: Annotated[int, Count, ResumeSafe] = 250  # optimizer steps between checkpoints
    save_total_limit: Annotated[int, NonNegative, ResumeSafe] = 2  # complete checkpoints kept (oldest pruned after a new one is complete; 0 = all)
    report_to: Annotated[str, Trackers, ResumeSafe] = "tensorboard"  # trackers besides metrics.jsonl: tensorboard, wandb, mlflow, ... (comma-separated), all, none
    dump_batch_ids: Annotated[bool, ResumeSafe] = False  # write each rank's utterance ids per batch (audits DDP sharding)
    # --- early stopping ---
    # common/training/early_stopping.py. The same command stops at the same step (the counters are run state), so the patience and the
    # threshold may change on resume as --max_steps may: a larger patience continues a stopped run.
    metric_for_best_model: str = "eval_loss"  # the validation metric early stopping watches (a recipe names its choices)
    greater_is_better: bool | None = None  # None: false for a metric ending in loss or er (eval_loss, eval_cer), else true
    early_stopping_patience: Annotated[int | None, NonNegative, ResumeSafe] = 0  # validations in a row without an improvement after which the run stops, final/ then holding the best validation's weights (0 = never); None = auto: the recipe's AUTO_EARLY_STOPPING_PATIENCE on training data of your own under 10 h, else 0
    early_stopping_threshold: Annotated[float, NonNegative, ResumeSafe] = 0.0  # an improvement must beat the best by more than this (absolute, in the metric's unit)

    def validate(self) -> None:
        """Cross-field checks of a recipe's Config (raise ValueError): none shared."""


@dataclasses.dataclass
class DatasetConfig(RunConfig):
    """RunConfig plus a `datasets` source (common/data/source.py), with the names of transformers'
    run_speech_recognition_ctc.py; the recipes that can train from one extend this instead."""

    # --- data ---
    dataset_name: str | None = None  # a `datasets` source instead of --data_dir: a local folder of data files (e.g. data/train-*.parquet) or a name `datasets` resolves; None = --data_dir
    dataset_config_name: str | None = None  # its configuration, when it has several
    train_split_name: str = "train"  # --dataset_name's split to train on
    eval_split_name: str = "validation"  # --dataset_name's split to validate on
    audio_column_name: str = "audio"  # its audio column (a datasets Audio column or encoded bytes; decoded with soundfile)
    text_column_name: str = "text"  # its transcript column (recipes that read transcripts)
    streaming: bool = False  # read --dataset_name's parquet shards in place, in order, resumable in O(1) (common/data/stream.py), instead of loading it whole
    per_device_train_batch_size: Annotated[int | None, Count] = None  # --streaming only, and needed there: utterances per batch per process (streamed batches are counted in utterances, not seconds)
    stream_partitions: Annotated[int | None, Count] = None  # --streaming: fixed parts of every epoch, a multiple of processes × data workers and of the global batch; they decide the batches. None = auto: up to 64, fewer where a small split would leave batches short of --per_device_train_batch_size (a resume keeps its checkpoint's)
    stream_block_rows: Annotated[int, Count] = 1000  # --streaming: consecutive rows shuffled and bucketed together (the shuffle buffer of each part)

    # What a `datasets` source does not do (no duration or sample-rate rules; streams: no seconds-sized
    # batches, no RAM cache): these must keep their defaults there, or the run would silently do
    # something else. Both kinds check their rows (--data_check, --on_bad_data: common/data/source.py).
    NOT_FOR_DATASETS = ("wrong_sample_rate", "min_seconds", "max_seconds")
    NOT_FOR_MAP_STYLE = ()
    NOT_FOR_STREAMS = ("max_batch_seconds", "num_buckets", "memory_cache_mb")
    # A recipe's settings of a --data_dir folder that a source replaces: {field: what to use instead}
    FOLDER_ONLY = {}
    READS_TEXT = True  # False: the recipe reads no transcripts (--text_column_name is refused)
    # Further columns a recipe reads from a --dataset_name source, carried into its rows as the transcript
    # is: each `key` here (e.g. "speaker") needs a field `<key>_column_name` naming the source's column,
    # and a row's `key` holds its value (a folder's rows have none: the recipe derives them, e.g. from ids).
    EXTRA_COLUMNS = ()

    def validate_changes(self, plain: "DatasetConfig") -> None:
        """A source's rules: settings it ignores must keep what `plain` (a plain run: the recipe's YAML
        over the class defaults) has."""
        changed = lambda keys: [k for k in keys if getattr(self, k) != getattr(plain, k)]  # noqa: E731
        stream_only = ("per_device_train_batch_size", "stream_partitions", "stream_block_rows")
        undeclared = [key for key in self.EXTRA_COLUMNS if not hasattr(self, f"{key}_column_name")]
        if undeclared:  # the recipe's own mistake, found by its first --help-less run
            raise ValueError(f"{type(self).__name__}.EXTRA_COLUMNS names {undeclared[0]!r}: declare a field "
                             f"{undeclared[0]}_column_name (the source's column it is read from)")
        extra = tuple(f"{key}_column_name" for key in self.EXTRA_COLUMNS)
        if self.dataset_name is None:
            given = changed(("dataset_config_name", "train_split_name", "eval_split_name", "audio_column_name",
                             "text_column_name", "streaming") + extra + stream_only)
            if given:
                raise ValueError(f"--{given[0]} applies to a --dataset_name source; give --dataset_name, or drop it")
            return
        if self.data_dir is not None:
            raise ValueError("--dataset_name and --data_dir both name the training data: give one")
        if not self.READS_TEXT and changed(("text_column_name",)):
            raise ValueError("--text_column_name: this recipe reads no transcripts; drop it")
        for key in changed(tuple(self.FOLDER_ONLY)):
            raise ValueError(f"--{key} applies to a --data_dir folder: with --dataset_name {self.FOLDER_ONLY[key]}")
        for key in changed(self.NOT_FOR_DATASETS + (self.NOT_FOR_STREAMS if self.streaming else self.NOT_FOR_MAP_STYLE)):
            what = ("a streamed source" if key in self.NOT_FOR_STREAMS else "a --dataset_name source without --streaming"
                    if key in self.NOT_FOR_MAP_STYLE else "a --dataset_name source (no duration or sample-rate check)")
            raise ValueError(f"--{key} does not apply to {what}: drop it"
                             + ("; streamed batches hold --per_device_train_batch_size utterances"
                                if key == "max_batch_seconds" else ""))
        if self.streaming and self.per_device_train_batch_size is None:
            raise ValueError("--streaming needs --per_device_train_batch_size (utterances per batch per process: "
                             "streamed batches are counted in utterances, not seconds)")
        if not self.streaming and changed(stream_only):
            raise ValueError(f"--{changed(stream_only)[0]} sets streamed batches; a map-style source's are sized "
                             f"in seconds (--max_batch_seconds): drop it, or add --streaming true")


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def format_help(cls: type, prog: str, default_yaml: str | Path | None, yaml_values: dict[str, Any] | None = None) -> str:
    """Every field with its type, rules, effective default and comment. `yaml_values`: the
    (converted) values the YAML file sets; shown as the defaults, marked with the file's name."""
    specs = field_specs(cls)
    yaml_values = yaml_values or {}
    defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
                for f in dataclasses.fields(cls)}
    lines = [f"usage: {prog} [--config YAML] [--key value ...]", "", inspect.cleandoc(cls.__doc__ or ""), "",
             f"  --config YAML  settings file; --key value flags override it (default: {default_yaml})"]
    shown = None
    for section, name, comment in field_docs(cls):
        tp, rules = specs[name]
        if Internal in rules:  # not a setting: the program writes it
            continue
        if section != shown:
            lines += ["", f"{section}:"]
            shown = section
        shown_rules = [str(r) for r in rules]
        if is_list(tp):  # a list's bounds hold for each of its values
            shown_rules = [f"each {r}" if isinstance(r, Range) else str(r) for r in rules
                           if r not in (MayBeEmpty, SpaceSeparated)]
            shown_rules += ["may be empty" if MayBeEmpty in rules else "at least one",
                            str(SpaceSeparated) if SpaceSeparated in rules else "comma-separated"]
        rule_text = f" ({'; '.join(shown_rules)})" if shown_rules else ""
        if name in yaml_values:
            default = f"{yaml_values[name]!r} (from {Path(default_yaml).name})"
        else:
            default = repr(defaults[name])
        head = f"  --{name} {type_name(tp)}{rule_text} = {default}"
        lines.append(head + (f"\n      {comment}" if comment else ""))
    return "\n".join(lines) + "\n"


SILENT_RANK_WAIT_S = 30.0  # how long a process that does not print waits for the one that does


def _fail(message: str) -> typing.NoReturn:
    # Under a multi-process launcher every process reads the same command line and files: the
    # first process of each machine says it (one write, so that lines never interleave). The others
    # must not exit first: the launcher would stop the speaking process before it has printed (seen
    # on a loaded machine: only "SIGTERM during start-up" was left). They wait, and die quietly on
    # the SIGTERM the launcher sends once the speaking process has exited.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(SILENT_RANK_WAIT_S)
    raise SystemExit(2)


def _inside_an_import(frame) -> bool:
    """Whether `frame` (where a signal interrupted) runs under an `import` statement."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def exit_on_signals_during_start_up() -> None:
    """Until the training installs its own handlers (`common.training.faults.Preemption`), SIGINT (Ctrl-C),
    SIGTERM and SIGUSR1 end the process with one line and exit code 75, as Preemption does during
    start-up, instead of a KeyboardInterrupt traceback from the middle of `import torch`. A
    training script calls it first thing. Under a launcher it also starts `watch_launcher`: once
    the launcher is gone, this process gets a SIGTERM (it stops, or saves and stops, with it)."""
    def stop(signum, frame):
        print(f"{stop_reason(signum)} during start-up: stopping (nothing to save yet; exit code "
              f"{START_UP_SIGNAL_EXIT_CODE})", file=sys.stderr, flush=True)
        if _inside_an_import(frame):
            # An exception raised in the middle of a library's import is not ours to deliver: a
            # library may catch it, or leave a half-imported module behind that fails later in
            # another way (seen: numpy's lazy submodules recursing). Nothing of ours is held yet.
            os._exit(START_UP_SIGNAL_EXIT_CODE)
        raise SystemExit(START_UP_SIGNAL_EXIT_CODE)  # a SystemExit: every `finally` still runs

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, stop)
    watch_launcher()  # from now on, the launcher's end is a SIGTERM: the workers stop with it


def _split_argv(cls: type, argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """(the --config value or None, [(key, value)]) from `--key value` / `--key=value` / bare `--flag`."""
    specs = field_specs(cls)
    yaml_path, pairs, i, given = None, [], 0, {}
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument {tok!r} (flags are --key value)")
        key, has_value, value = tok[2:].partition("=")
        key = key.replace("-", "_")  # --max-steps works too
        i += 1
        if key in specs and SpaceSeparated in specs[key][1]:  # --audio a.wav b.flac: up to the next --flag
            values = [value] if has_value else []
            while i < len(argv) and not argv[i].startswith("--"):
                values, i = values + [argv[i]], i + 1
            pairs.append((key, values))
            continue
        if not has_value:
            if i < len(argv) and not argv[i].startswith("--"):
                value, i = argv[i], i + 1
            elif key in specs and is_bool(specs[key][0]):
                value = "true"  # a bare boolean flag
            elif key == "config" or key in specs:
                raise ConfigError(f"--{key} needs a value (only true/false settings may be given bare)")
            else:
                raise not_a_setting(cls, key, "command line")
        if key in given:  # as a YAML key given twice is: which one was meant is not ours to guess
            raise ConfigError(f"--{key} given twice on the command line ({given[key]!r}, then {value!r}): keep one")
        given[key] = value
        if key == "config":
            yaml_path = value
        else:
            pairs.append((key, value))
    return yaml_path, pairs


def _apply(cfg: T, overrides: dict[str, Any], source: str, saved: bool = False) -> T:
    """`cfg` with `overrides` (from `source`: "command line" or a YAML file) converted to the fields'
    types. A bad value from a file names the file and the key's line, as a --config flag's (`saved`:
    raised as it is, for load_config to name the file its own way)."""
    specs = field_specs(type(cfg))
    for key in overrides:
        if not isinstance(key, str) or key not in specs:
            raise not_a_setting(type(cfg), str(key), source)
        if source == "command line" and Internal in specs[key][1]:
            raise ConfigError(f"--{key} is set by the program itself (recorded in the run's config.yaml), "
                              f"not on the command line: drop it")
    try:
        converted = {k: convert_value(k, v, specs[k][0]) for k, v in overrides.items()}
    except FieldError as e:
        raise (e if source == "command line" or saved else _from_file(e, source, overrides)) from None
    return dataclasses.replace(cfg, **converted)


def _from_file(error: FieldError, path: str, loaded: Any) -> ConfigError:
    """`error` about a value read from the YAML file `path`: its line names the file and the key's line."""
    line = getattr(loaded, "lines", {}).get(error.field)
    return FieldError(error.field, f"{error} (--config {path}{f', line {line}' if line else ''})")


def _keys_from_file(error: ConfigError, path: str, loaded: Any, given: dict) -> ConfigError:
    """`error` from a cross-field check, naming the YAML file `path` and the lines of the `--key`s
    its message names that the file set and the command line did not (unchanged where none)."""
    lines = getattr(loaded, "lines", {})
    keys = [k for k in dict.fromkeys(re.findall(r"--(\w+)", str(error))) if k in loaded and k not in given]
    if not keys:
        return error
    where = ", ".join(f"{k} on line {lines[k]}" if k in lines else k for k in keys)
    return ConfigError(f"{error} (--config {path}: {where})")


def parse_config(cls: type[T], argv: list[str] | None = None, default_yaml: str | Path | None = None) -> T:
    """Build `cls` from defaults, then `--config` YAML (or `default_yaml`), then `--key value` flags.

    `--key=value` and `--key value` both work; a bare `--key` means true, for booleans only.
    `-h/--help` prints every field and exits 0; a mistake prints one line and exits 2.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    want_help = "-h" in argv or "--help" in argv
    try:
        yaml_path, pairs = _split_argv(cls, [a for a in argv if a not in ("-h", "--help")])
        yaml_path = yaml_path if yaml_path is not None else default_yaml
        cfg = cls()
        loaded: dict = {}
        if yaml_path is not None:
            loaded = load_yaml(yaml_path)
            cfg = _apply(cfg, loaded, str(yaml_path))
        if want_help:
            print(format_help(cls, Path(sys.argv[0]).name, yaml_path, {k: getattr(cfg, k) for k in loaded}), end="")
            raise SystemExit(0)
        cfg = _apply(cfg, dict(pairs), "command line")
        # What a plain run gets (the recipe's own YAML over the class defaults): a `validate` can tell
        # what the user changed from it (DatasetConfig refuses changed settings a source ignores).
        plain = cfg if yaml_path == default_yaml and not pairs else None
        if plain is None:
            plain = _apply(cls(), load_yaml(default_yaml), str(default_yaml)) if default_yaml else cls()
        # Settings a recipe reads from elsewhere (the vocoder's --tts_run: that TTS run's data), filled in
        # before the checks: `complete(given)` returns the config, `given` the keys the user set (the command
        # line's, a --config file's); a ValueError is a refusal.
        if callable(getattr(cfg, "complete", None)):
            try:
                cfg = cfg.complete({*dict(pairs), *(loaded if yaml_path != default_yaml else ())})
            except ValueError as e:
                raise ConfigError(str(e)) from None
        try:
            validate(cfg, plain)
        except FieldError as e:  # a value the YAML set and the command line kept: name the file
            if e.field in loaded and e.field not in dict(pairs):
                raise _from_file(e, str(yaml_path), loaded) from None
            raise
        except ConfigError as e:  # a cross-field check (validate, validate_changes): name the YAML's keys it names
            raise _keys_from_file(e, str(yaml_path), loaded, dict(pairs)) from None
        return cfg
    except ConfigError as e:
        _fail(str(e))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config as a plain dict, in `--help`'s order (sections)."""
    values = dataclasses.asdict(cfg)
    return {name: values[name] for _, name, _ in field_docs(type(cfg))}


def save_config(cfg: Any, path: str | Path) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)


def load_config(folder: str | Path, cls: type[T]) -> T:
    """The `config.yaml` that `save_config` wrote into `folder` (a run, its final/, a checkpoint), as
    the recipe's Config `cls`, each value converted to its field's type. A config written before a
    field existed takes that field's class default, said in one logged line (the code that wrote it
    behaved as the default does: the rule for adding a field). A key `cls` does not have (a config of
    a newer version, or of another recipe) is refused: dropping it could silently change what the
    tool rebuilds. A key of a field `cls` leaves out (`LEFT_OUT`) is dropped: the recipe reads none.

    Values are checked as parse_config checks them (every field's rules, then `validate()`), but for
    the rules about this machine (a run's data_dir may be gone since: `Rule.of_this_machine`), so that
    a changed file is refused here, not met as a crash deep in a tool. Not `validate_changes`: a run's
    settings are compared with a plain run's on its own command line. Every problem is a ConfigError
    of one line that names the file (and the key's line): no --config flag gave it."""
    path = Path(folder) / "config.yaml"
    try:
        loaded = load_yaml(path)
    except ConfigError as e:  # load_yaml's messages name the --config flag: this file is no flag's
        raise ConfigError(str(e).removeprefix("--config ")) from None
    names = list(field_specs(cls))
    unknown = [str(k) for k in loaded if k not in names and k not in left_out(cls)]
    if unknown:
        raise ConfigError(f"{path}: {unknown[0]!r}{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''} "
                          f"is not a setting of {cls.__module__}.{cls.__name__}: written by a newer version of this "
                          f"code, or by another recipe; use the code (and recipe) that trained it")
    kept = YamlKeys({k: v for k, v in loaded.items() if k in names})
    kept.lines = loaded.lines
    try:
        cfg = _apply(cls(), kept, str(path), saved=True)
        check_fields(cfg, of_this_machine=False)
        if callable(getattr(cfg, "validate", None)):
            cfg.validate()
    except (ValueError, ConfigError) as e:  # FieldError is both
        field = getattr(e, "field", None)
        line = kept.lines.get(field) if field in kept else None
        where = f"{path}, line {line}" if line else str(path)
        raise ConfigError(f"{where}: {str(e).removeprefix('--')} (changed since its run wrote it, or written by "
                          f"another version of this code: use the run's own file, or the code that trained it)") from None
    missing = [n for n in names if n not in loaded]
    if missing:
        shown = ", ".join(f"{n}={getattr(cfg, n)!r}" for n in missing)
        logging.getLogger(__name__).warning(f"{path}: written before {len(missing)} setting(s) existed; "
                                            f"they take their defaults: {shown}")
    return cfg


def config_hash(cfg_dict: dict[str, Any], ignore: typing.Iterable[str] = ()) -> str:
    """Short stable hash of the config minus `ignore`d keys (the ones safe to change on resume)."""
    kept = {k: v for k, v in sorted(cfg_dict.items()) if k not in set(ignore)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]
