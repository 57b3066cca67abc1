"""What a command's rules are written with: the Checks that collect every problem of one command
line, and the checks of one value that options declare (spec.Opt's `check`).

A rule belongs to its command: a value's form is declared on its field (`check=rules.form(...)`),
a rule over two options is a command class's NEEDS, CLASHES or ONLY_WITH, and any other rule is its
class's `rules()` or `check_row()` method. validate.py is the engine that runs them; it knows no
command by name.

A value check takes (the option as the user wrote it, e.g. --torch or IMAGE; the value) and raises
UsageError, or the BadValue or BadFile of a parser it calls (the same rule, met before anything is
touched). Nothing here writes, starts a process or opens a connection; files are only read.
"""
from __future__ import annotations

import os
import re
import shutil
import ssl
from pathlib import Path
from typing import Any, Callable

from .errors import BadFile, BadValue, UsageError, UsageErrors

Check = Callable[[str, Any], object]  # (the option's name as written, its value): raises where the value is wrong


class Checks:
    """Runs the checks, keeping every problem. Each check names the options it reads; one that
    reads an option a problem was already found in is skipped (its line would say it again)."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.failed: set[str] = set()

    def ok(self, *dests: str) -> bool:
        return not self.failed.intersection(dests)

    def fail(self, dests: tuple[str, ...] | str, message: str) -> None:
        dests = (dests,) if isinstance(dests, str) else dests
        if self.ok(*dests):
            self.problems.append(message)
        self.failed.update(dests)

    def run(self, dests: tuple[str, ...] | str, check: Callable[[], object]) -> None:
        """check() where none of dests has failed; a UsageError it raises is kept as a problem, and
        so is a BadValue or BadFile of the parsers it calls."""
        dests = (dests,) if isinstance(dests, str) else dests
        if not self.ok(*dests):
            return
        try:
            check()
        except UsageErrors as e:
            self.problems += e.problems
            self.failed.update(dests)
        except (UsageError, BadValue, BadFile) as e:
            self.fail(dests, str(e))


def given(value: Any) -> bool:
    """Whether the user gave an option: a flag set, a list with items, a value where the parser left None."""
    return value is not None and value is not False and value != [] and value != ()


# ---- the checks of one value ------------------------------------------------------------------

def form(pattern: str, like: str) -> Check:
    """The value matches pattern: else `NAME takes LIKE, not 'VALUE'`."""
    def check(name: str, value: str) -> None:
        if not re.fullmatch(pattern, value):
            raise UsageError(f"{name} takes {like}, not {value!r}")
    return check


def parsed_by(parse: Callable[[Any], object]) -> Check:
    """The value is one that parse() takes (its BadValue is the problem)."""
    return lambda name, value: parse(value)


TORCH, CUDA = r"\d+\.\d+(\.\d+)?", r"\d+\.\d+"
torch_version = form(TORCH, "a torch version like 2.7 or 2.7.1")
cuda_version = form(CUDA, "a CUDA version like 12.1")
reference = form(r"\S+", "an image reference or ID")  # a local image's reference or ID, as docker takes it


def python_version(name: str, value: str) -> None:
    if not re.fullmatch(r"3\.\d+", value):
        raise UsageError(f"{name} {value!r}: expected MAJOR.MINOR, e.g. 3.12")


def at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise UsageError(f"{name} must be at least 1, not {value}")


def readable(name: str, path: Path, what: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror} ({name})") from None


def matrix_file(name: str, path: Path) -> None:
    readable(name, path, "matrix file")


def ca_bundle(name: str, path: str) -> None:
    """A CA bundle holds at least one PEM certificate that OpenSSL loads (a DER file, a key or
    an empty file would fail every TLS handshake an hour into a build instead)."""
    readable(name, Path(path), "CA bundle")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=path)
        found = ctx.cert_store_stats()["x509"]
    except (ssl.SSLError, ValueError):
        found = 0
    if not found:
        raise UsageError(f"{name} {path} holds no PEM certificate (no -----BEGIN CERTIFICATE----- block that loads)")


def program(name: str, value: str) -> None:
    if not shutil.which(value):
        raise UsageError(f"{name} {value!r} is neither a program on PATH nor an executable file")


def folder(name: str, path: Path) -> None:
    if not path.is_dir():
        raise UsageError(f"{name} {path} is not a folder")


def writable_folder(name: str, path: Path) -> None:
    """A folder to write into: one that is writable, or a new one a writable folder can hold."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{name} {path} is not a folder")
    there = path if path.exists() else path.parent
    if not there.is_dir():
        raise UsageError(f"{name} {path}: {there} is not a folder; create it first")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(f"{name} {path}: {there} is not writable")


def writable_file(name: str, path: Path) -> None:
    """A file to write: not a directory, and its directory is there and writable."""
    if path.is_dir():
        raise UsageError(f"{name} {path} is a directory; name a file")
    _writable_parent(name, path)


def writable_file_or_folder(name: str, path: Path) -> None:
    """A file to write, or a writable folder to write one into."""
    if not path.is_dir():
        return _writable_parent(name, path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{name} {path} is not writable")


def _writable_parent(name: str, path: Path) -> None:
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{name} {path}: {parent} is not a directory; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{name} {path}: {parent} is not writable")
