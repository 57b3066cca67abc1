"""The command line's second stage: the parser (spec.py) parses, validate() checks, then completes.

Every argument is checked here, once, before Docker, the network, a lock or the disk is
touched: a value of the wrong form (what argparse's types and choices refused comes here too),
a file that is missing or of the wrong kind, a flag that does nothing beside another (or
contradicts it), and the row --torch, --cuda and --flavor pick. Every problem is reported at
once, as the matrix loader does: one line each naming the argument (both, for a combination), exit 2.
A check that reads an argument already found wrong is skipped, so one mistake gives one line.

This is the engine only. The rules are each command's, declared on its options class (spec.py,
rules.py): each field's `check`, the class's NEEDS, CLASHES and ONLY_WITH, its `rules()` and its
`check_row()`. Nothing here names a command. Nothing writes, starts a process or opens a
connection; files are only opened for reading.
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

from . import matrix, spec
from .errors import UsageErrors
from .rules import Checks, given
from .spec import Command, flag_of


def validate(args: argparse.Namespace, default_matrix: Path | None = None) -> argparse.Namespace:
    """args checked (every problem raised at once, as UsageErrors) and completed: defaults filled in.
    With default_matrix (the project's matrix.yaml, where --matrix is not given), the rows the
    command picks are looked up too."""
    cls = spec.command_class(args)
    c = Checks()
    for dest, problem in vars(args).pop(spec.BAD, {}).items():  # what argparse's types and choices refused
        c.fail(dest, problem)
    as_given = spec.complete(cls, args)  # options declared later=True are still None where not given
    values(as_given, c)
    pairs(as_given, c)
    as_given.rules(c)
    if default_matrix is not None:
        as_given.check_row(c, functools.cache(lambda: matrix.load(args.matrix or default_matrix)))
    if c.problems:
        raise UsageErrors(c.problems)
    # Options declared later=True are None when not given, so that a flag given where it does
    # nothing can be told from its default: filled in now that the checks passed.
    spec.fill_defaults(cls, args)
    return args


def values(o: Command, c: Checks) -> None:
    """Each value given of the form its field declares (argparse's types and choices checked numbers and names)."""
    for f, d in spec.options(type(o), every=True):
        value = getattr(o, f.name)
        if d.check is None or not given(value):
            continue
        check, name = d.check, spec.shown_name(f, d)
        for item in value if d.kind in ("append", "many", "rest") else [value]:
            c.run(f.name, functools.partial(check, name, item))


def pairs(o: Command, c: Checks) -> None:
    """The rules over two options: one that does nothing without another, contradicts another, or
    needs another to have one of some values (what the command takes in its place counts)."""
    cls = type(o)
    if not cls.READS_MATRIX and o.matrix is not None:
        c.fail("matrix", f"--matrix does nothing for `{cls.NAME}`, which reads no matrix")
    for dest, needed, why in cls.NEEDS:
        if given(getattr(o, dest)) and not given(getattr(o, needed)):
            c.fail((dest, needed), f"{flag_of(dest)} needs {flag_of(needed)}: {why}")
    for one, other, why in cls.CLASHES:
        if given(getattr(o, one)) and given(getattr(o, other)):
            c.fail((one, other), f"{flag_of(one)} and {flag_of(other)} do not go together: {why}")
    for dest, other, settings, why in cls.ONLY_WITH:
        if given(getattr(o, dest)) and o.setting(other) not in settings:
            c.fail((dest, other), f"{flag_of(dest)} needs {flag_of(other)} {' or '.join(settings)}: {why}")
