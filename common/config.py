"""Typed recipe configs: dataclass defaults < YAML file < `--key value` command-line flags.

Every recipe declares one `@dataclass` whose fields are its whole configuration, each with a trailing
`# comment` (its meaning and unit) and grouped by `# --- section ---` lines. Training recipes extend
`RunConfig`, the settings they all share. This module turns `sys.argv` into an instance and checks
every value before anything slow happens: it imports nothing heavy (no torch), so `--help` and every
mistake are answered in well under a second.

A field carries its own rules in its type, `Annotated[type, rule, ...]`, so that this module names
no recipe's field:

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
1.2's core schema (`_ConfigLoader`: `010` is 10, `1:30` and `0x10` are strings, a key given twice is
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
import difflib
import hashlib
import inspect
import io
import json
import logging
import math
import os
import re
import signal
import stat
import sys
import time
import tokenize
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml

from common.training.launcher import stop_reason, watch_launcher

T = TypeVar("T")

# Exit code of a process stopped by a signal before training (= common.training.faults.PREEMPTED_EXIT_CODE:
# that module imports torch, this one must not).
START_UP_SIGNAL_EXIT_CODE = 75


class ConfigError(ValueError):
    """A mistake in the configuration: reported as one line, exit code 2 (also by `run_main`)."""

    exit_code = 2


class FieldError(ConfigError):
    """A ConfigError about one field's value (`.field`): parse_config names the YAML file and line
    the value came from."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# ---------------------------------------------------------------------------------------------
# Rules a field carries: Annotated[type, rule, ...]
# ---------------------------------------------------------------------------------------------

class Rule:
    """A rule carried by a field. `check` returns what is wrong with a (non-None) value, or None;
    `str(rule)` is how `--help` shows it. `of_this_machine`: the rule checks what this machine has
    now (a path exists, a tracker is installed), not what the value means: a saved config read back
    elsewhere, or after its data moved (`load_config`), is not held to it."""

    of_this_machine = False

    def check(self, value: Any) -> str | None:
        return None


@dataclasses.dataclass(frozen=True)
class Range(Rule):
    """lo ≤ value ≤ hi (None: unbounded; `lo_open`/`hi_open`: strict). `finite=False` lets a float
    field take nan/inf, which every other float field refuses."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    finite: bool = True

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '≥'} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '≤'} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"

    def check(self, value: Any) -> str | None:
        if isinstance(value, float) and math.isnan(value):
            return None  # finiteness is checked on its own (see validate)
        too_low = self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo))
        too_high = self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi))
        return f"must be {self}, got {value}" if too_low or too_high else None


@dataclasses.dataclass(frozen=True)
class _ExistingPath(Rule):
    keywords: tuple[str, ...] = ()  # values that name something else than a path (ExistingPathOr)
    of_this_machine = True

    def __str__(self) -> str:
        return "must exist" + "".join(f", or {k}" for k in self.keywords)

    def check(self, value: Any) -> str | None:
        if value in self.keywords or Path(value).exists():
            return None
        return f"{value} does not exist" + (f" (nor is it {' or '.join(self.keywords)})" if self.keywords else "")


def ExistingPathOr(*keywords: str) -> _ExistingPath:  # noqa: N802 (a rule, spelled like the others)
    """A path that must exist, or one of `keywords` (e.g. `--init_from builtin`)."""
    return _ExistingPath(tuple(keywords))


@dataclasses.dataclass(frozen=True)
class _Folder(Rule):
    """A folder the run writes into: it may not exist yet, but it must not be a file, nor lie under
    one (that fails only at the first write, after the slow start-up)."""

    of_this_machine = True

    def __str__(self) -> str:
        return "a folder, made if missing"

    def check(self, value: Any) -> str | None:
        path = Path(value)
        for there in (path, *path.parents):  # the nearest that exists must be a folder
            if there.is_dir():
                return None
            if there.exists() or there.is_symlink():
                what = ("a file" if there.is_file() else "a broken link" if not there.exists()
                        else "not a folder")
                where = f"{value} is {what}" if there == path else f"{value} cannot be made: {there} is {what}"
                return f"{where}; name a folder (a new one, or a run's)"
        return None


@dataclasses.dataclass(frozen=True)
class _ResumeSafe(Rule):
    def __str__(self) -> str:
        return "may change on resume"


@dataclasses.dataclass(frozen=True)
class _Internal(Rule):
    """A field the program sets itself (recorded in the run's config.yaml, where a resume or a tool
    reads it): not listed by --help, refused on the command line. A YAML file may hold it (a run's
    own config.yaml, given as --config, has it); the program sets it again anyway."""

    def __str__(self) -> str:
        return "set by the program"


@dataclasses.dataclass(frozen=True)
class _MayBeEmpty(Rule):
    """A list field that may hold no values (`--key ''`): without it a list needs at least one, so
    that an empty value never silently turns a part off."""

    def __str__(self) -> str:
        return "may be empty"


@dataclasses.dataclass(frozen=True)
class _SpaceSeparated(Rule):
    """A list field whose command-line values follow its flag as separate arguments, up to the next
    `--flag` (`--audio a.wav b.flac`, what a shell makes of `--audio *.wav`): file names may hold commas."""

    def __str__(self) -> str:
        return "space-separated"


@dataclasses.dataclass(frozen=True)
class _Trackers(Rule):
    """`--report_to`: trackers accelerate knows and this environment has (common.training.logs.trackers;
    importing it is light: it looks modules up without importing them)."""

    of_this_machine = True

    def __str__(self) -> str:
        return "installed trackers, comma-separated, or all/none"

    def check(self, value: Any) -> str | None:
        from common.training.logs import trackers

        try:
            trackers(value)
        except ValueError as e:
            return str(e).split(": ", 1)[-1]
        return None


@dataclasses.dataclass(frozen=True)
class _Names(Rule):
    """A text field of comma-separated names (`train-clean-100,train-clean-360`): none may be empty,
    or `a,,b` would name the data folder itself as one of them."""

    def __str__(self) -> str:
        return "comma-separated names"

    def check(self, value: Any) -> str | None:
        if any(not name.strip() for name in str(value).split(",")):
            return f"an empty name in {_shown(value)} (names are comma-separated: a,b)"
        return None


Count = Range(1)  # how many of something: ≥ 1
NonNegative = Range(0)
Positive = Range(0, lo_open=True)
Fraction = Range(0, 1)  # a probability or a share
ExistingPath = _ExistingPath()
Folder = _Folder()
ResumeSafe = _ResumeSafe()
Internal = _Internal()
MayBeEmpty = _MayBeEmpty()
SpaceSeparated = _SpaceSeparated()
Trackers = _Trackers()
Names = _Names()


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
# Reading a Config class: types, rules, comments
# ---------------------------------------------------------------------------------------------

def _split_rules(tp: Any) -> tuple[Any, tuple[Rule, ...]]:
    """`Annotated[X, r1, r2]` → (X, (r1, r2)); also inside `Annotated[...] | None`. A list field's
    rules apply to each of its values: `list[Annotated[int, Count]]` → (list[int], (Count,)), the same
    as `Annotated[list[int], Count]`."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *extras = typing.get_args(tp)
        inner, rules = _split_rules(base)
        return inner, rules + tuple(r for r in extras if isinstance(r, Rule))
    if origin in (typing.Union, types.UnionType):
        parts = [_split_rules(a) for a in typing.get_args(tp)]
        if any(rules for _, rules in parts):
            return typing.Union[tuple(p for p, _ in parts)], sum((rules for _, rules in parts), ())
    if origin in (list, tuple) and typing.get_args(tp):  # list[Annotated[int, Count]]: every element's rules
        item, rules = _split_rules(typing.get_args(tp)[0])
        if rules:
            return origin[item], rules
    return tp, ()


def field_specs(cls: type) -> dict[str, tuple[Any, tuple[Rule, ...]]]:
    """{field: (type, rules)} of a Config class. A field re-declared by a subclass takes the
    subclass's type and default and keeps the rules of every declaration up its bases."""
    specs: dict[str, tuple[Any, tuple[Rule, ...]]] = {}
    for klass in reversed(cls.__mro__):
        own = vars(klass).get("__annotations__", {})
        if not own:
            continue
        module = sys.modules.get(klass.__module__)
        # A recipe's script imported under another name (tests) may be gone from sys.modules, or its
        # name may now be another module's (vocoder/evaluate.py vs the `evaluate` package): its
        # dataclass __init__ still holds the defining module's globals.
        defines = module is not None and getattr(module, klass.__name__, None) is klass
        namespace = vars(module) if defines else getattr(klass.__init__, "__globals__", {})
        for name, annotation in own.items():
            tp = eval(annotation, namespace) if isinstance(annotation, str) else annotation  # noqa: S307 — our own source
            tp, rules = _split_rules(tp)
            inherited = specs.get(name, (None, ()))[1]
            specs[name] = (tp, inherited + tuple(r for r in rules if r not in inherited))
    return {f.name: specs[f.name] for f in dataclasses.fields(cls) if f.name not in left_out(cls)}


def left_out(cls: type) -> dict[str, str]:
    """A Config's `LEFT_OUT` (RunConfig's docstring): {inherited field it has no use for: why}."""
    names = getattr(cls, "LEFT_OUT", {})
    wrong = [name for name in names if name not in {f.name for f in dataclasses.fields(cls)}]
    if wrong:  # the recipe's own mistake, found by its first run
        raise ConfigError(f"{cls.__name__}.LEFT_OUT names {wrong[0]!r}, which is not a field of it: name a shared field")
    return dict(names)


def resume_safe_keys(cfg_or_cls: Any) -> list[str]:
    """The fields marked `ResumeSafe`: they may differ between a checkpoint and its re-launch."""
    cls = cfg_or_cls if isinstance(cfg_or_cls, type) else type(cfg_or_cls)
    # A left-out field is read by nothing: a checkpoint written before it was left out holds its
    # value, which resuming without it changes nothing.
    return [name for name, (_, rules) in field_specs(cls).items() if ResumeSafe in rules] + list(left_out(cls))


def field_docs(cls: type) -> list[tuple[str | None, str, str]]:
    """[(section or None, field name, its trailing comment)], grouped by section.

    Reads the source of `cls` and of each dataclass it extends (base first). A field keeps the
    section and place where it was first declared; a re-declaration's comment, if any, wins.
    Sections come in order of first appearance, so a recipe's `# --- data ---` fields join
    RunConfig's data section and its own sections follow the shared ones."""
    names = list(field_specs(cls))  # without the fields it leaves out
    found: dict[str, list] = {}  # name -> [section, comment]
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        own = set(vars(klass).get("__annotations__", {}))
        section, line_field = None, {}
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        for i, tok in enumerate(tokens):
            if tok.type == tokenize.NAME and tok.string in own and tok.start[1] == 4 and i + 1 < len(tokens) \
                    and tokens[i + 1].string == ":":
                line_field[tok.start[0]] = tok.string
                found.setdefault(tok.string, [section, ""])
            elif tok.type == tokenize.COMMENT:
                text = tok.string.lstrip("#").strip()
                if tok.line.strip().startswith("#"):
                    if text.startswith("---"):
                        section = text.strip("- ").strip()
                elif tok.start[0] in line_field:
                    found[line_field[tok.start[0]]][1] = text
    sections = list(dict.fromkeys(found.get(n, [None])[0] for n in names))
    return [(s, n, found.get(n, [None, ""])[1]) for s in sections for n in names if found.get(n, [None])[0] == s]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " | ".join(_type_name(a) for a in args) + " | None"
    if origin is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if origin in (list, tuple):
        return f"list[{_type_name((typing.get_args(tp) or (str,))[0])}]"
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------------------------------------
# Values: conversion and checks
# ---------------------------------------------------------------------------------------------

def _shown(value: Any) -> str:
    """A value as a message shows it: repr, cut to one short line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_list(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_list(a) for a in typing.get_args(tp) if a is not type(None))
    return typing.get_origin(tp) in (list, tuple)


def _is_bool(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(_is_bool(a) for a in typing.get_args(tp) if a is not type(None))
    return tp is bool


def _convert(name: str, value: Any, tp: Any) -> Any:
    """Coerce a YAML value or a command-line string to the field's declared type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X] / X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _convert(name, value, args[0])
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise FieldError(name, f"--{name}: {_shown(value)} is not one of {', '.join(map(str, choices))}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (str,)
        if isinstance(value, str):  # the command line: comma-separated; '' is no values
            value = value.split(",") if value.strip() else []
            if any(not v.strip() for v in value):
                raise FieldError(name, f"--{name}: an empty value in {_shown(','.join(value))} (values are "
                                       f"comma-separated: 2,3,5)")
        if not isinstance(value, (list, tuple)):
            raise FieldError(name, f"--{name}: expected a list, got {_shown(value)}")
        return origin(_convert(name, v, item_tp) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise FieldError(name, f"--{name}: expected true or false, got {_shown(value)}")
    if tp in (int, float, str):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise FieldError(name, f"--{name}: expected {tp.__name__}, got {_shown(value)}")
        if tp is str:
            return str(value)
        if tp is int and isinstance(value, int):
            return value
        if isinstance(value, str) and not value.isascii():
            # int() and float() read any script's digits ('١٢' is 12, '０.５' is 0.5): a number is
            # written with 0-9 only, so that it means what every reader of the file sees.
            if any(c.isdigit() or c.isnumeric() for c in value if not c.isascii()):
                raise FieldError(name, f"--{name}: {_shown(value)} has digits other than 0-9 (write the number "
                                       f"with ASCII digits)")
            raise FieldError(name, f"--{name}: expected {tp.__name__}, got {_shown(value)}")
        if tp is int and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass  # "1e3" is 1000: read as a float below
        try:
            number = float(value)
        except (ValueError, OverflowError):
            raise FieldError(name, f"--{name}: expected {tp.__name__}, got {_shown(value)}") from None
        if tp is float:
            return number
        if not number.is_integer():  # 1.5, 1e400 (inf), nan: not integers (and no OverflowError)
            raise FieldError(name, f"--{name}: expected an integer, got {_shown(value)}")
        return int(number)
    return value


def _unknown(key: str, known: typing.Iterable[str], source: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"; did you mean --{close[0]}?" if close else " (--help lists them)"
    return ConfigError(f"unknown config key {key!r} in {source}{hint}")


def _not_a_setting(cls: type, key: str, source: str) -> ConfigError:
    """`key` (from `source`) is no field of `cls`: a field it leaves out (its reason), or a typo."""
    why = left_out(cls).get(key)
    if why is None:
        return _unknown(key, field_specs(cls), source)
    given = f"--{key}" if source == "command line" else f"{key!r} in {source}"
    return ConfigError(f"{given}: not a setting of this recipe ({why}): drop it")


def _apply(cfg: T, overrides: dict[str, Any], source: str, saved: bool = False) -> T:
    """`cfg` with `overrides` (from `source`: "command line" or a YAML file) converted to the fields'
    types. A bad value from a file names the file and the key's line, as a --config flag's (`saved`:
    raised as it is, for load_config to name the file its own way)."""
    specs = field_specs(type(cfg))
    for key in overrides:
        if not isinstance(key, str) or key not in specs:
            raise _not_a_setting(type(cfg), str(key), source)
        if source == "command line" and Internal in specs[key][1]:
            raise ConfigError(f"--{key} is set by the program itself (recorded in the run's config.yaml), "
                              f"not on the command line: drop it")
    try:
        converted = {k: _convert(k, v, specs[k][0]) for k, v in overrides.items()}
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


def validate(cfg: Any, plain: Any = None) -> None:
    """Check every field's rules (a list's: on each of its values), then the Config's own
    `validate_changes(plain)` (`plain`: what a plain run gets; None: the class defaults) and
    `validate()`; raises ConfigError."""
    _check_fields(cfg)
    try:
        if callable(getattr(cfg, "validate_changes", None)):
            cfg.validate_changes(plain if plain is not None else type(cfg)())
        if callable(getattr(cfg, "validate", None)):
            cfg.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_fields(cfg: Any, of_this_machine: bool = True) -> None:
    """Every field's rules (FieldError); `of_this_machine=False`: not those about this machine
    (`Rule.of_this_machine`)."""
    for name, (_, rules) in field_specs(type(cfg)).items():
        rules = tuple(r for r in rules if of_this_machine or not r.of_this_machine)
        value = getattr(cfg, name)
        if value is None or isinstance(value, bool):
            continue
        is_list = isinstance(value, (list, tuple))
        if is_list and not value and MayBeEmpty not in rules:
            separated = "space" if SpaceSeparated in rules else "comma"
            raise FieldError(name, f"--{name}: needs at least one value ({separated}-separated on the command line, "
                                   f"a list in the YAML)")
        for item in value if is_list else (value,):
            if isinstance(item, float) and not math.isfinite(item) and not any(
                    isinstance(r, Range) and not r.finite for r in rules):
                raise FieldError(name, f"--{name}: must be a finite number, got {item}")
            for rule in rules:
                problem = rule.check(item)
                if problem:
                    raise FieldError(name, f"--{name}: {problem}" + (f" (in {_shown(list(value))})" if is_list else ""))


# ---------------------------------------------------------------------------------------------
# YAML files
# ---------------------------------------------------------------------------------------------

# A config is a few kB: a mapping of about a hundred values and short lists. PyYAML reads a list of
# small items at about 20 kB/s (a 50 MB file parsed for minutes), so both the size and the number of
# values are capped far above any real config.
MAX_CONFIG_BYTES = 128 << 10  # bytes
MAX_YAML_NODES = 5000  # keys, values and list items
MAX_YAML_DEPTH = 8  # nested collections: a config is a mapping of scalars and lists of scalars (depth 3)


class YamlKeys(dict):
    """A YAML mapping, and `.lines`: {key: its 1-based line}, for messages about a value."""

    lines: dict[str, int]


class _ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader read as YAML 1.2's core schema, so that a value means what it reads as:

    - ints are decimal only: `010` is 10 (YAML 1.1: octal 8); `0x10`, `0o10` and `1_000` are strings,
      which an int field then refuses, as the command line does; `1:30` is a string (1.1: 90, base 60);
    - floats: `1.5`, `1e-3` (1.1: a string), `.inf`, `.nan`; bools: true/false only (`yes`, `no`,
      `on`, `off` are strings: `mixed_precision: no` is the choice "no", and a true/false field reads
      them as the command line does); no timestamps, no `<<` merge keys;
    - no anchors and aliases (`&a`, `*a`): a few hundred bytes of nested aliases ("billion laughs")
      expand to gigabytes wherever the value is walked; a config has no use for them;
    - a key given twice is refused (YAML keeps the last, silently); collections nest at most
      MAX_YAML_DEPTH deep (400 nested `[` exhausted Python's recursion), and hold at most
      MAX_YAML_NODES values in all."""

    yaml_implicit_resolvers: dict = {}  # filled below: 1.2 core only

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(None, None, "anchors and aliases (&name, *name) are not allowed in a config",
                                              event.start_mark)
        depth = getattr(self, "_depth", 0)
        if depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_YAML_DEPTH} levels deep (a config "
                                              f"is a mapping of values and lists)", event.start_mark)
        self._nodes = getattr(self, "_nodes", 0) + 1
        if self._nodes > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(None, None, f"more than {MAX_YAML_NODES} values (a config is a mapping "
                                              f"of values and short lists)", event.start_mark)
        self._depth = depth + 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth = depth

    def construct_mapping(self, node, deep=False):
        self.flatten_mapping(node)
        mapping, lines = YamlKeys(), {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                raise yaml.constructor.ConstructorError(None, None, "a key must be a name", key_node.start_mark)
            if key in mapping:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first on line {lines[key]}): keep one", key_node.start_mark)
            mapping[key] = self.construct_object(value_node, deep=deep)
            lines[key] = key_node.start_mark.line + 1
        mapping.lines = lines
        return mapping

    def _scalar(self, node, parse, what: str):
        """A scalar of an int/float/bool tag, implicit or explicit (`!!int 0x10`), or a marked error."""
        value = self.construct_scalar(node)
        try:
            return parse(value)
        except (ValueError, KeyError):
            raise yaml.constructor.ConstructorError(None, None, f"{value!r} is not {what}", node.start_mark) from None

    def construct_int(self, node):
        return self._scalar(node, lambda v: int(v) if _INT.fullmatch(v) else int("?"), "a decimal integer")

    def construct_float(self, node):
        special = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
        return self._scalar(node, lambda v: special[v.lower()] if v.lower() in special
                            else float(v) if _FLOAT.fullmatch(v) else float("?"), "a number")

    def construct_bool(self, node):
        return self._scalar(node, lambda v: {"true": True, "false": False}[v.lower()], "true or false")


_INT = re.compile(r"[-+]?[0-9]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                                    ["~", "n", "N", ""])
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(f"^{_INT.pattern}$"), list("-+0123456789"))
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(rf"^(?:{_FLOAT.pattern}|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+.0123456789"))
_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_int)
_ConfigLoader.add_constructor("tag:yaml.org,2002:float", _ConfigLoader.construct_float)
_ConfigLoader.add_constructor("tag:yaml.org,2002:bool", _ConfigLoader.construct_bool)
_ConfigLoader.add_constructor("tag:yaml.org,2002:map", lambda loader, node: loader.construct_mapping(node))


def _read_config_file(path: Path) -> bytes:
    """The bytes of a --config file: a regular file of at most MAX_CONFIG_BYTES. Checked before
    reading, and opened non-blocking: opening a FIFO for reading waits for a writer, forever."""
    try:
        before = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror})") from None
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a device"),
             (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))
    what = next((name for test, name in kinds if test(before.st_mode)), "not a regular file")
    if not stat.S_ISREG(before.st_mode):
        raise ConfigError(f"--config {path}: is {what}, not a file: name a YAML file")
    if before.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"--config {path}: {before.st_size} bytes, more than a config's {MAX_CONFIG_BYTES} "
                          f"(a config is a short list of settings): name the right file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot be read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced between the stat and the open
            raise ConfigError(f"--config {path}: not a regular file: name a YAML file")
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:  # grew since the stat
        raise ConfigError(f"--config {path}: more than a config's {MAX_CONFIG_BYTES} bytes: name the right file")
    return raw


def load_yaml(path: str | Path) -> YamlKeys:
    """A config YAML file as a mapping (with `.lines`); every problem is a ConfigError of one line."""
    path = Path(path)
    raw = _read_config_file(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    try:
        loaded = yaml.load(text, Loader=_ConfigLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}: " if mark else ""
        raise ConfigError(f"--config {path}: not valid YAML ({where}{e.problem or e.context})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except (RecursionError, MemoryError, ValueError, TypeError) as e:  # what PyYAML does not mark as its own
        raise ConfigError(f"--config {path}: not valid YAML ({type(e).__name__})") from None
    if loaded is None:
        loaded = YamlKeys()
        loaded.lines = {}
    if not isinstance(loaded, YamlKeys):
        raise ConfigError(f"--config {path}: expected a mapping of keys to values")
    return loaded


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
        if _is_list(tp):  # a list's bounds hold for each of its values
            shown_rules = [f"each {r}" if isinstance(r, Range) else str(r) for r in rules
                           if r not in (MayBeEmpty, SpaceSeparated)]
            shown_rules += ["may be empty" if MayBeEmpty in rules else "at least one",
                            str(SpaceSeparated) if SpaceSeparated in rules else "comma-separated"]
        rule_text = f" ({'; '.join(shown_rules)})" if shown_rules else ""
        if name in yaml_values:
            default = f"{yaml_values[name]!r} (from {Path(default_yaml).name})"
        else:
            default = repr(defaults[name])
        head = f"  --{name} {_type_name(tp)}{rule_text} = {default}"
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
            elif key in specs and _is_bool(specs[key][0]):
                value = "true"  # a bare boolean flag
            elif key == "config" or key in specs:
                raise ConfigError(f"--{key} needs a value (only true/false settings may be given bare)")
            else:
                raise _not_a_setting(cls, key, "command line")
        if key in given:  # as a YAML key given twice is: which one was meant is not ours to guess
            raise ConfigError(f"--{key} given twice on the command line ({given[key]!r}, then {value!r}): keep one")
        given[key] = value
        if key == "config":
            yaml_path = value
        else:
            pairs.append((key, value))
    return yaml_path, pairs


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
        _check_fields(cfg, of_this_machine=False)
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
