"""How a command's options are declared once: a frozen dataclass per command, one field per
option, the field's metadata holding its flag, help, argparse type, choices and rules.

From that one declaration come
- the argparse parser (`add_command`): every field an argument, in the field's order;
- the defaults validation fills in (`fill_defaults`): an option declared `later=True` is left
  None by the parser, so that validation can tell a flag given from its default;
- the frozen, typed options object the handlers and the pipeline get (`complete`), never a
  Namespace: lists become tuples;
- a child process's argv (`argv`): every field that differs from its default, as its flag.

This module declares the options many commands share (the row, the platform, Docker and the CA);
arguments.py and jobs/options.py declare the commands. A new option is one field there, and its
handler's use of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar

from . import matrix

KEY = "option"  # the field metadata's key


@dataclass(frozen=True)
class Opt:
    """One option's declaration, beside its field's name, type and default."""

    help: str | None = None
    type: Callable[[str], Any] | None = None  # argparse's conversion (str when None)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    kind: str = "value"  # value, flag (store_true), append, positional, rest (argparse.REMAINDER), many (nargs="*")
    required: bool = False
    group: str | None = None  # a mutually exclusive group of the command (Command.groups)
    later: bool = False  # the parser leaves it None (given or not can be told); validation fills the default
    env: str | None = None  # the parser's default is this environment variable's value
    write: Callable[[Any], str] = str  # the value as a child's argv writes it


def opt(default: Any = None, help: str | None = None, **kw: Any) -> Any:
    """A field declaring an option: its default (the value when not given) and its Opt."""
    meta = {KEY: Opt(help=help, **kw)}
    if isinstance(default, (list, tuple)):
        return dataclasses.field(default=tuple(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag(help: str | None = None, **kw: Any) -> Any:
    """A store_true option: False unless given."""
    return opt(False, help, kind="flag", **kw)


def many(help: str | None = None, **kw: Any) -> Any:
    """A repeatable option: every value given, in order."""
    return opt((), help, kind="append", **kw)


@dataclass(frozen=True)
class Command:
    """What every command takes: the matrix file (given before the command)."""

    NAME: ClassVar[str] = ""
    HELP: ClassVar[str] = ""
    PARSER: ClassVar[dict[str, Any]] = {}  # add_parser's description, epilog, formatter_class
    GROUPS: ClassVar[dict[str, bool]] = {}  # mutually exclusive group -> required
    # The rules that read two of its options (validate.py checks them, each problem one line):
    NEEDS: ClassVar[tuple[tuple[str, str, str], ...]] = ()  # (option, the option it needs, what it is for)
    CLASHES: ClassVar[tuple[tuple[str, str, str], ...]] = ()  # (option, option, why they do not go together)
    ONLY_WITH: ClassVar[tuple[tuple[str, str, tuple[str, ...], str], ...]] = ()  # (option, other, its values, why)

    matrix: Path | None = opt(None, "matrix file (default: the project's matrix.yaml)", type=Path, kind="global")


C = TypeVar("C", bound=Command)


def options(cls: type[Command]) -> list[tuple[dataclasses.Field, Opt]]:
    """The command's own options (not --matrix, which the top parser takes), in their order."""
    return [(f, f.metadata[KEY]) for f in dataclasses.fields(cls) if KEY in f.metadata and f.metadata[KEY].kind != "global"]


def flag_of(name: str) -> str:
    """A field's flag: `keep_storage` -> --keep-storage; a trailing _ (a field named after a Python
    keyword, `from_`) is not part of it: --from."""
    return "--" + name.rstrip("_").replace("_", "-")


def add_command(sub: Any, cls: type[Command]) -> argparse.ArgumentParser:
    """The command's subparser, one argument per field."""
    p: argparse.ArgumentParser = sub.add_parser(cls.NAME, help=cls.HELP, **cls.PARSER)
    groups: dict[str, Any] = {}
    for f, o in options(cls):
        where: Any = p
        if o.group is not None:
            where = groups.get(o.group) or groups.setdefault(o.group, p.add_mutually_exclusive_group(required=cls.GROUPS[o.group]))
        where.add_argument(*_names(f.name, o), **_settings(f, o))
    return p


def _names(name: str, o: Opt) -> list[str]:
    return [name] if o.kind in ("positional", "rest", "many") else [flag_of(name)]


def _settings(f: dataclasses.Field, o: Opt) -> dict[str, Any]:
    kw: dict[str, Any] = {"help": o.help}
    if o.kind not in ("positional", "rest", "many"):
        kw["dest"] = f.name  # the field's own name, also where the flag drops a keyword's trailing _
    if o.kind == "flag":
        return {**kw, "action": "store_true"}
    if o.kind == "rest":
        return {**kw, "nargs": argparse.REMAINDER}
    if o.kind == "many":
        kw["nargs"] = "*"
    if o.kind == "append":
        kw.update(action="append", default=[])
    elif o.kind not in ("positional", "many"):
        kw["default"] = None if o.later else os.environ.get(o.env) if o.env else f.default
    if o.required:
        kw["required"] = True
    for key in ("type", "choices", "metavar"):
        if getattr(o, key) is not None:
            kw[key] = getattr(o, key)
    return kw


def fill_defaults(cls: type[Command], ns: argparse.Namespace) -> None:
    """The defaults of the options the parser left None (declared later=True), once validation passed."""
    for f, o in options(cls):
        if o.later and getattr(ns, f.name, None) is None:
            setattr(ns, f.name, f.default)


def complete(cls: type[C], ns: argparse.Namespace, **given: Any) -> C:
    """The command's frozen options from validated arguments (lists as tuples); `given` overrides."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**{**values, **given})


def argv(o: Command) -> list[str]:
    """The same options as a child's command line: `--matrix FILE COMMAND`, then every option that
    differs from its default, in the declaration's order (positionals and `-- ARGS` last)."""
    cls = type(o)
    out = [flag_of("matrix"), str(o.matrix)] if o.matrix is not None else []
    out.append(cls.NAME)
    tail: list[str] = []
    for f, d in options(cls):
        value = getattr(o, f.name)
        if d.kind == "flag":
            out += [flag_of(f.name)] if value else []
        elif d.kind == "append":
            out += [a for v in value for a in (flag_of(f.name), d.write(v))]
        elif d.kind == "positional":
            tail.append(d.write(value))
        elif d.kind in ("rest", "many"):
            tail += ["--", *map(d.write, value)] if value else []
        elif value is not None and value != f.default:
            out += [flag_of(f.name), d.write(value)]
    return out + tail


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value
    return parse


positive_int = at_least(1)  # a count of at least 1 (--jobs, --retries, --runs, --cold-runs)
whole = at_least(0)  # a count that may be 0 (--gpus-per-node)


# ---- options many commands share ------------------------------------------------------------

def torch(required: bool = False) -> Any:
    return opt(None, "torch minor (2.7) or full version (2.7.1)", required=required)


def cuda() -> Any:
    return opt(None, "CUDA platform, e.g. 12.1; default: the torch minor's default row")


def flavor() -> Any:
    return opt("runtime", "image flavor: runtime (default), devel (adds the CUDA toolkit) or train (adds TE, FA4, Liger, torchao)",
               choices=matrix.FLAVORS)


PLATFORM_CHOICES = (*matrix.OS_PLATFORMS, "all")


def platform(help: str = "linux/amd64, linux/arm64 (emulated on an x86-64 host) or all the row's platforms (default: this host's)") -> Any:
    return opt(None, help, choices=PLATFORM_CHOICES, metavar="PLATFORM")


def docker() -> Any:
    return opt(None, "Docker CLI to use (default: $PYTORCH_CUDA_DOCKER, else detected)")


def ca_bundle(help: str = "CA bundle for HTTPS (default: pip's configured cert)") -> Any:
    return opt(None, help)


@dataclass(frozen=True)
class Rows(Command):
    """A command that picks rows: --torch (every row without it, where the command allows), --cuda, --flavor."""

    torch: str | None = torch()
    cuda: str | None = cuda()
    flavor: str = flavor()


@dataclass(frozen=True)
class Row(Rows):
    """A command that works on one row: --torch required."""

    torch: str | None = torch(required=True)
