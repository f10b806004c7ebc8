"""The rules a Config field carries and how values are held to them: `Annotated[type, rule, ...]`
(`Range`, `Count`, `ExistingPath`, `Folder`, `ResumeSafe`, `Internal`, `MayBeEmpty`, `SpaceSeparated`,
`Names`, ...), reading a Config class's fields, rules and comments (`field_specs`, `field_docs`),
converting a YAML value or a command-line string to a field's type (`convert_value`), and checking
every field (`validate`). `ConfigError` is every refusal: one line, exit code 2. What the rules
mean is common/config.py's docstring; parsing a command line is there too. No heavy import: every
script reads its settings before it imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import io
import math
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

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


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " | ".join(type_name(a) for a in args) + " | None"
    if origin is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if origin in (list, tuple):
        return f"list[{type_name((typing.get_args(tp) or (str,))[0])}]"
    return getattr(tp, "__name__", str(tp))


# ---------------------------------------------------------------------------------------------
# Values: conversion and checks
# ---------------------------------------------------------------------------------------------

def _shown(value: Any) -> str:
    """A value as a message shows it: repr, cut to one short line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_list(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(is_list(a) for a in typing.get_args(tp) if a is not type(None))
    return typing.get_origin(tp) in (list, tuple)


def is_bool(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(is_bool(a) for a in typing.get_args(tp) if a is not type(None))
    return tp is bool


def convert_value(name: str, value: Any, tp: Any) -> Any:
    """Coerce a YAML value or a command-line string to the field's declared type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X] / X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return convert_value(name, value, args[0])
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
        return origin(convert_value(name, v, item_tp) for v in value)
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


def not_a_setting(cls: type, key: str, source: str) -> ConfigError:
    """`key` (from `source`) is no field of `cls`: a field it leaves out (its reason), or a typo."""
    why = left_out(cls).get(key)
    if why is None:
        return _unknown(key, field_specs(cls), source)
    given = f"--{key}" if source == "command line" else f"{key!r} in {source}"
    return ConfigError(f"{given}: not a setting of this recipe ({why}): drop it")


def validate(cfg: Any, plain: Any = None) -> None:
    """Check every field's rules (a list's: on each of its values), then the Config's own
    `validate_changes(plain)` (`plain`: what a plain run gets; None: the class defaults) and
    `validate()`; raises ConfigError."""
    check_fields(cfg)
    try:
        if callable(getattr(cfg, "validate_changes", None)):
            cfg.validate_changes(plain if plain is not None else type(cfg)())
        if callable(getattr(cfg, "validate", None)):
            cfg.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_fields(cfg: Any, of_this_machine: bool = True) -> None:
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


