"""Typed recipe configs: dataclass defaults < YAML file < `--key value` command-line flags.

Every recipe declares one `@dataclass` whose fields are its whole configuration. This module turns
`sys.argv` into an instance of it, refuses unknown keys (a typo must never silently train the
default), and writes/hashes the resolved config so every checkpoint says how it was made.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _convert(name: str, value: Any, tp: Any) -> Any:
    """Coerce a YAML value or a command-line string to the field's declared type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X] / X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _convert(name, value, args[0])
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
        raise ValueError(f"--{name}: expected a boolean, got {value!r}")
    if tp in (int, float, str):
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(f"--{name}: expected an integer, got {value!r}")
        try:
            return tp(float(value)) if tp is int and isinstance(value, str) and "e" in value else tp(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--{name}: expected {tp.__name__}, got {value!r}") from e
    return value


def _apply(cfg: T, overrides: dict[str, Any], source: str) -> T:
    types_ = _field_types(type(cfg))
    unknown = sorted(set(overrides) - set(types_))
    if unknown:
        raise SystemExit(
            f"error: unknown config key(s) in {source}: {', '.join(unknown)}\n"
            f"known keys: {', '.join(sorted(types_))}"
        )
    converted = {k: _convert(k, v, types_[k]) for k, v in overrides.items()}
    return dataclasses.replace(cfg, **converted)


def parse_config(cls: type[T], argv: list[str] | None = None, default_yaml: str | Path | None = None) -> T:
    """Build `cls` from defaults, then `--config` YAML (or `default_yaml`), then `--key value` flags.

    `--key=value` and `--key value` both work; a bare boolean flag `--key` means true.
    """
    parser = argparse.ArgumentParser(add_help=True, description=cls.__doc__)
    parser.add_argument("--config", default=None, help=f"YAML file (default: {default_yaml})")
    args, rest = parser.parse_known_args(argv)

    cfg = cls()
    yaml_path = args.config or default_yaml
    if yaml_path is not None:
        with open(yaml_path) as f:
            cfg = _apply(cfg, yaml.safe_load(f) or {}, str(yaml_path))

    overrides: dict[str, Any] = {}
    i = 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("--"):
            raise SystemExit(f"error: unexpected argument {tok!r} (flags are --key value)")
        key = tok[2:].replace("-", "_")
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            value = rest[i + 1]
            i += 2
        else:  # bare flag: only meaningful for booleans
            value = "true"
            i += 1
        overrides[key] = value
    return _apply(cfg, overrides, "command line")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)


def config_hash(cfg_dict: dict[str, Any], ignore: typing.Iterable[str] = ()) -> str:
    """Short stable hash of the config minus `ignore`d keys (the ones safe to change on resume)."""
    kept = {k: v for k, v in sorted(cfg_dict.items()) if k not in set(ignore)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]
