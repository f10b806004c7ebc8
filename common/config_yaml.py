"""YAML config files read as YAML 1.2's core schema (`load_yaml`): `010` is 10, `1:30` and `0x10` are
strings, a key given twice is refused; size, value count and nesting capped far above any real
config; every refusal one line naming the file (and the line).
"""

from __future__ import annotations

import math
import os
import re
import stat
import typing
from pathlib import Path

import yaml

from common.config_rules import ConfigError

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


