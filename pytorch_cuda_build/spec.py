"""How a command's options are declared once: a frozen dataclass per command, one field per
option, the field's metadata holding its flag, help, argparse type, choices and rules.

From that one declaration come
- the argparse parser (`add_command`): every field an argument, in the field's order;
- the defaults validation fills in (`fill_defaults`): an option declared `later=True` is left
  None by the parser, so that validation can tell a flag given from its default;
- the frozen, typed options object the handlers and the pipeline get (`complete`), never a
  Namespace: lists become tuples;
- a child process's argv (`argv`): every field that differs from its default, as its flag.

Each command's rules sit on its class too: a value's form on its field (`check`, rules.py), the rules
over two options as NEEDS, CLASHES and ONLY_WITH, any other as the methods `rules()` and
`check_row()`. validate.py runs them all, and knows no command by name.

This module declares the options many commands share (the row, the platform, Docker and the CA);
arguments.py and jobs/options.py declare the commands, cli.py pairs each with its handler. A new
option is one field there, with its rule where it has one, and its handler's use of it.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, NoReturn, TypeVar

from . import matrix, rules
from .errors import UsageErrors
from .matrix import Image, Matrix
from .rules import Checks

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
    check: rules.Check | None = None  # the value's form, checked where given (each item of a repeatable option)


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
    READS_MATRIX: ClassVar[bool] = True  # False: --matrix does nothing for it

    matrix: Path | None = opt(None, "matrix file (default: the project's matrix.yaml)", type=Path, kind="global",
                              check=rules.matrix_file)

    # The rules validation runs on the options as given: an option declared later=True is None where
    # it was not given, and one argparse refused is None, its name already among c.failed.

    def setting(self, name: str) -> Any:
        """The option's value as ONLY_WITH reads it: as given, or what the command takes in its place."""
        return getattr(self, name)

    def rules(self, c: Checks) -> None:
        """The command's rules beyond its fields' forms and its pairs: each problem kept in c."""

    def check_row(self, c: Checks, load: Callable[[], Matrix]) -> None:
        """The matrix rows the options pick are there (load() reads the matrix the command will)."""


C = TypeVar("C", bound=Command)


def options(cls: type[Command], every: bool = False) -> list[tuple[dataclasses.Field, Opt]]:
    """The command's own options (not --matrix, which the top parser takes; every: with it), in their order."""
    return [(f, f.metadata[KEY]) for f in dataclasses.fields(cls) if KEY in f.metadata and (every or f.metadata[KEY].kind != "global")]


CLASS = "_command_class"  # the namespace's options class, set by the command's subparser
BAD = "_bad_arguments"  # the namespace's {dest: problem} of values argparse's types or choices refused


class Parser(argparse.ArgumentParser):
    """argparse, except that a value its type or choices refuse is kept as a problem (the value
    left None, or as given) instead of ending the parse: validation reports it with every other
    problem of the command line at once, and skips the checks that read it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bad: dict[str, str] = {}

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:  # type: ignore[override]
        self._bad = {}
        ns, extras = super().parse_known_args(args, namespace)
        # A subcommand's parser ran inside this one and copied its namespace, BAD included, into ns.
        self._bad = {**getattr(ns, BAD, {}), **self._bad}
        setattr(ns, BAD, self._bad)
        return ns, extras

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as e:
            self._bad.setdefault(action.dest, f"{e} (see --help)")
            return None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if isinstance(action, argparse._SubParsersAction):
            return super()._check_value(action, value)
        if action.dest in self._bad:  # its type refused it already
            return None
        try:
            return super()._check_value(action, value)
        except argparse.ArgumentError as e:
            self._bad[action.dest] = f"{e} (see --help)"
            return None

    def error(self, message: str) -> NoReturn:  # each problem one line, exit 2, like every other bad input
        raise UsageErrors([*self._bad.values(), f"{message} (see --help)"])


def parser(commands: list[type[Command]], **kw: Any) -> argparse.ArgumentParser:
    """The command line's parser: --matrix, then one subparser per command, in the list's order."""
    p = Parser(**kw)
    p.add_argument("--matrix", type=Path, help=Command.__dataclass_fields__["matrix"].metadata[KEY].help)
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    for cls in commands:
        add_command(sub, cls)
    return p


def command_class(ns: argparse.Namespace) -> type[Command]:
    """The options class of the command a namespace was parsed for."""
    cls: type[Command] = getattr(ns, CLASS)
    return cls


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
    p.set_defaults(**{CLASS: cls})
    return p


def shown_name(f: dataclasses.Field, o: Opt) -> str:
    """The option as the user writes it: --torch, or a positional's IMAGE, DIR."""
    return o.metavar or f.name.upper() if o.kind in ("positional", "many") else flag_of(f.name)


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


D = TypeVar("D", bound=Command)


def extend(cls: type[D], o: Command, **more: Any) -> D:
    """o as an object of cls, a class derived from o's that adds what its handler found (`more`): every field
    of o carried over, none named by hand."""
    return cls(**{**{f.name: getattr(o, f.name) for f in dataclasses.fields(o)}, **more})


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
    return opt(None, "torch minor (2.7) or full version (2.7.1)", required=required, check=rules.torch_version)


def cuda() -> Any:
    return opt(None, "CUDA platform, e.g. 12.1; default: the torch minor's default row", check=rules.cuda_version)


def flavor() -> Any:
    return opt("runtime", "image flavor: runtime (default), devel (adds the CUDA toolkit) or train (adds TE, FA4, Liger, torchao)",
               choices=matrix.FLAVORS)


PLATFORM_CHOICES = (*matrix.OS_PLATFORMS, "all")


def platform(help: str = "linux/amd64, linux/arm64 (emulated on an x86-64 host) or all the row's platforms (default: this host's)") -> Any:
    return opt(None, help, choices=PLATFORM_CHOICES, metavar="PLATFORM")


def docker() -> Any:
    return opt(None, "Docker CLI to use (default: $PYTORCH_CUDA_DOCKER, else detected)", check=rules.program)


def ca_bundle(help: str = "CA bundle for HTTPS (default: pip's configured cert)") -> Any:
    return opt(None, help, check=rules.ca_bundle)


@dataclass(frozen=True)
class Rows(Command):
    """A command that picks rows: --torch (every row without it, where the command allows), --cuda, --flavor."""

    torch: str | None = torch()
    cuda: str | None = cuda()
    flavor: str = flavor()

    def row(self, m: Matrix) -> Image:
        """The one row --torch, --cuda and --flavor pick."""
        return m.select(self.torch, self.cuda, self.flavor)

    def check_row(self, c: Checks, load: Callable[[], Matrix]) -> None:
        self.picked_row(c, load)

    def picked_row(self, c: Checks, load: Callable[[], Matrix]) -> Image | None:
        """The row --torch picks (None where none is given, or it is not in the matrix: a problem kept)."""
        if not self.torch:
            return None
        picked: list[Image] = []
        c.run(("torch", "cuda", "flavor", "matrix"), lambda: picked.append(self.row(load())))
        return picked[0] if picked else None


@dataclass(frozen=True)
class Row(Rows):
    """A command that works on one row: --torch required."""

    torch: str | None = torch(required=True)
