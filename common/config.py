"""Typed recipe configs: dataclass defaults < YAML file < `--key value` command-line flags.

Every recipe declares one `@dataclass` whose fields are its whole configuration, each with a trailing
`# comment` (its meaning and unit) and grouped by `# --- section ---` lines. This module turns
`sys.argv` into an instance of it and checks every value before anything slow happens: it imports
nothing heavy (no torch), so `--help` and every mistake are answered in well under a second.

- Unknown keys are refused with the closest valid name (a typo must never silently train the default).
- `typing.Literal[...]` fields take one of their values; `bool` fields take true/false.
- `COUNTS` must be ≥ 1 and `NON_NEGATIVE` ≥ 0; `EXISTING_PATHS` must exist when given.
- A Config may add cross-field checks in a `validate(self)` method that raises ValueError.
A mistake is one line on stderr and exit code 2, no traceback. `--help` lists every field with its
type, default and comment.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import io
import json
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

# Fields that count something and must be ≥ 1, or ≥ 0, whatever the recipe (the HF-named ones and
# our batching/model sizes). Units are in each field's comment.
COUNTS = ("max_steps", "save_steps", "logging_steps", "gradient_accumulation_steps", "warmup_steps",
          "sample_rate", "n_mels", "num_buckets", "stack_frames", "codebook_size", "code_dim", "hidden_size",
          "num_layers", "num_heads", "ffn_dim", "conv_kernel", "max_nonfinite_updates", "stats_utterances",
          "bpe_vocab_size", "dim", "encoder_layers", "decoder_layers", "win_length", "hop_length",
          "duration_channels", "attention_dim", "griffin_lim_iters", "beam_size")
NON_NEGATIVE = ("eval_steps", "memory_cache_mb", "save_total_limit", "num_workers", "num_threads", "freeze_encoder_steps", "num_valid", "num_test",
                "binarization_start_steps", "num_samples", "dropout", "weight_decay", "max_grad_norm",
                "speed_perturb", "freq_masks", "time_masks", "mask_prob", "noise_std")
POSITIVE = ("learning_rate", "max_batch_seconds", "max_seconds", "ddp_timeout")
EXISTING_PATHS = ("data_dir", "init_from", "checkpoint", "text_file", "asr_checkpoint")


class ConfigError(ValueError):
    """A mistake in the configuration: reported as one line, exit code 2."""


def _field_types(cls: type) -> dict[str, Any]:
    module = sys.modules.get(cls.__module__)
    # A recipe's train.py imported under another name (tests) is not in sys.modules as `train`:
    # its string annotations then resolve against typing's names.
    namespace = vars(module) if module is not None else {"Literal": typing.Literal, "Optional": typing.Optional}
    hints = typing.get_type_hints(cls, globalns=namespace)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " | ".join(_type_name(a) for a in args) + " | None"
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if origin in (list, tuple):
        return f"list[{_type_name((typing.get_args(tp) or (str,))[0])}]"
    return getattr(tp, "__name__", str(tp))


def _convert(name: str, value: Any, tp: Any) -> Any:
    """Coerce a YAML value or a command-line string to the field's declared type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X] / X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _convert(name, value, args[0])
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"--{name}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (str,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        return origin(_convert(name, v, item_tp) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{name}: expected true or false, got {value!r}")
    if tp in (int, float, str):
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"--{name}: expected an integer, got {value!r}")
        if tp is not str and isinstance(value, bool):
            raise ConfigError(f"--{name}: expected {tp.__name__}, got {value!r}")
        try:
            return tp(float(value)) if tp is int and isinstance(value, str) and "e" in value else tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"--{name}: expected {tp.__name__}, got {value!r}") from None
    return value


def _unknown(key: str, known: typing.Iterable[str], source: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"; did you mean --{close[0]}?" if close else " (--help lists them)"
    return ConfigError(f"unknown config key {key!r} in {source}{hint}")


def _apply(cfg: T, overrides: dict[str, Any], source: str) -> T:
    types_ = _field_types(type(cfg))
    for key in overrides:
        if key not in types_:
            raise _unknown(key, types_, source)
    converted = {k: _convert(k, v, types_[k]) for k, v in overrides.items()}
    return dataclasses.replace(cfg, **converted)


def validate(cfg: Any) -> None:
    """The value checks described in the module docstring; raises ConfigError."""
    values = dataclasses.asdict(cfg)
    for name, value in values.items():
        if value is None or isinstance(value, bool):
            continue
        if name in COUNTS and value < 1:
            raise ConfigError(f"--{name}: must be ≥ 1, got {value}")
        if name in NON_NEGATIVE and value < 0:
            raise ConfigError(f"--{name}: must be ≥ 0, got {value}")
        if name in POSITIVE and value <= 0:
            raise ConfigError(f"--{name}: must be > 0, got {value}")
        if name in EXISTING_PATHS and not Path(value).exists():
            raise ConfigError(f"--{name}: {value} does not exist")
    check = getattr(cfg, "validate", None)
    if callable(check):
        try:
            check()
        except ValueError as e:
            raise ConfigError(str(e)) from None


def field_docs(cls: type) -> list[tuple[str | None, str, str]]:
    """[(section or None, field name, its trailing comment)] in source order."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return [(None, f.name, "") for f in dataclasses.fields(cls)]
    names = {f.name for f in dataclasses.fields(cls)}
    docs, section, line_field = [], None, {}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NAME and tok.string in names and tok.start[1] == 4 and i + 1 < len(tokens) \
                and tokens[i + 1].string == ":":
            line_field[tok.start[0]] = tok.string
            docs.append([section, tok.string, ""])
        elif tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.line.strip().startswith("#"):
                if text.startswith("---"):
                    section = text.strip("- ").strip()
            elif tok.start[0] in line_field:
                docs[[d[1] for d in docs].index(line_field[tok.start[0]])][2] = text
    return [tuple(d) for d in docs]


def format_help(cls: type, prog: str, default_yaml: str | Path | None) -> str:
    types_ = _field_types(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    lines = [f"usage: {prog} [--config YAML] [--key value ...]", "", (cls.__doc__ or "").strip(), "",
             f"  --config YAML  settings file; --key value flags override it (default: {default_yaml})"]
    shown = None
    for section, name, comment in field_docs(cls):
        if section != shown:
            lines += ["", f"{section}:"]
            shown = section
        bound = " (≥ 1)" if name in COUNTS else " (≥ 0)" if name in NON_NEGATIVE else " (> 0)" if name in POSITIVE else ""
        head = f"  --{name} {_type_name(types_[name])}{bound} = {defaults[name]!r}"
        lines.append(head + (f"\n      {comment}" if comment else ""))
    return "\n".join(lines) + "\n"


def _fail(message: str) -> typing.NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_config(cls: type[T], argv: list[str] | None = None, default_yaml: str | Path | None = None) -> T:
    """Build `cls` from defaults, then `--config` YAML (or `default_yaml`), then `--key value` flags.

    `--key=value` and `--key value` both work; a bare boolean flag `--key` means true. `-h/--help`
    prints every field and exits 0; a mistake prints one line and exits 2.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(format_help(cls, Path(sys.argv[0]).name, default_yaml), end="")
        raise SystemExit(0)
    try:
        yaml_path, pairs = default_yaml, []
        i = 0
        while i < len(argv):
            tok = argv[i]
            if not tok.startswith("--"):
                raise ConfigError(f"unexpected argument {tok!r} (flags are --key value)")
            key = tok[2:]
            if "=" in key:
                key, value = key.split("=", 1)
                i += 1
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
                i += 2
            else:  # bare flag: only meaningful for booleans
                value = "true"
                i += 1
            key = key.replace("-", "_")  # --max-steps works too
            if key == "config":
                yaml_path = value
            else:
                pairs.append((key, value))
        cfg = cls()
        if yaml_path is not None:
            path = Path(yaml_path)
            if not path.is_file():
                raise ConfigError(f"--config {path}: no such file")
            try:
                loaded = yaml.safe_load(path.read_text()) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"--config {path}: expected a mapping of keys to values")
            cfg = _apply(cfg, loaded, str(path))
        cfg = _apply(cfg, dict(pairs), "command line")
        validate(cfg)
        return cfg
    except ConfigError as e:
        _fail(str(e))


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)


def config_hash(cfg_dict: dict[str, Any], ignore: typing.Iterable[str] = ()) -> str:
    """Short stable hash of the config minus `ignore`d keys (the ones safe to change on resume)."""
    kept = {k: v for k, v in sorted(cfg_dict.items()) if k not in set(ignore)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]
