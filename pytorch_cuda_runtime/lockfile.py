"""The lock files' formats, read and written in one place by the host tool and the image's tools.

Three text formats live under images/<image>/ (and images/<image>/linux-arm64/):

  requirements.lock, deepspeed.lock, extras*.lock, a pypi toolkit.lock
      pip's hash-pinned requirements: `name==version \\` then `--hash=sha256:...` lines (uv writes them)
  toolkit.lock (a Debian toolkit)
      `sha256 size url package=version`, one .deb a line
  debs.lock
      `step sha256 size url package=version`: every Debian file a build reads, by step
      (index: the release's signed InRelease and Packages.xz; base: mmdebstrap's packages;
      apt: the base stage's apt step; build: the ops builder's)

and one kind of record of them all, `Input`: a file a build reads, by its name, address, sha256 and
size, which the host's store (pytorch_cuda_build/stages/fetch.py) keeps by hash.

Names are normalised once, here, as PEP 503 says (canonical). Standard library only: this module
is baked into every image, whose tools run before anything but Python is installed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

_BLOCK = re.compile(r"\n(?=\S)")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
_SHA = re.compile(r"^[0-9a-f]{64}$")
DEB_STEPS = ("index", "base", "apt", "build")


class LockFormatError(ValueError):
    """A lock file's line that is not in its format; the message names the line."""


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 normalises it: `Nvidia_CUDNN.cu12` -> `nvidia-cudnn-cu12`."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    """One requirement of a hash-pinned requirements lock."""

    name: str  # canonical
    version: str
    hashes: frozenset[str]
    block: str  # the requirement as the lock writes it, comments included

    @property
    def requirement(self) -> str:
        """`name==version --hash=sha256:...` on one line, as pip reads it from a command line."""
        return f"{self.name}=={self.version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(self.hashes))


def pins(lock_text: str) -> list[Pin]:
    """Each `name==version` block of a requirements lock, in the lock's order."""
    out = []
    for block in _BLOCK.split(lock_text.strip()):
        m = _PIN.match(block)
        if m:
            out.append(Pin(canonical(m.group(1)), m.group(2), frozenset(_HASH.findall(block)), block))
    return out


def versions(lock_text: str) -> dict[str, str]:
    """canonical name -> version of each pin of a requirements lock."""
    return {p.name: p.version for p in pins(lock_text)}


@dataclass(frozen=True)
class Input:
    """A file a build reads: what the store keeps (by sha256) and fetches (from url)."""

    file: str  # the name the build sees it by (a wheel's or a .deb's file name)
    url: str
    sha256: str
    size: int

    def as_json(self) -> dict[str, object]:
        return {"file": self.file, "url": self.url, "sha256": self.sha256, "size": self.size}

    @classmethod
    def from_json(cls, data: dict[str, object], where: str) -> "Input":
        try:
            item = cls(str(data["file"]), str(data["url"]), str(data["sha256"]), int(str(data["size"])))
        except (KeyError, TypeError, ValueError):
            raise LockFormatError(f"{where}: not a file record (file, url, sha256, size): {data!r}") from None
        if not _SHA.match(item.sha256) or item.size < 0 or "/" in item.file or not item.url:
            raise LockFormatError(f"{where}: not a file record (file, url, sha256, size): {data!r}")
        return item


@dataclass(frozen=True)
class Deb:
    """One Debian file by its pool address, with the sha256 and size its signed index gives.
    An index file (InRelease, Packages.xz) has package "-" and no version."""

    package: str
    version: str
    url: str
    sha256: str
    size: int

    @property
    def file(self) -> str:
        return self.url.rsplit("/", 1)[1]

    @property
    def input(self) -> Input:
        return Input(self.file, self.url, self.sha256, self.size)

    def line(self) -> str:
        what = f"{self.package}={self.version}" if self.package != "-" else "-"
        return f"{self.sha256} {self.size} {self.url} {what}"


def _deb(fields: list[str], where: str) -> Deb:
    if len(fields) != 4 or not _SHA.match(fields[0]) or not fields[1].isdigit():
        raise LockFormatError(f"{where}: expected `sha256 size url package=version`")
    package, _, version = fields[3].partition("=")
    if package != "-" and not version:
        raise LockFormatError(f"{where}: expected `package=version`, not {fields[3]!r}")
    return Deb(package, version, fields[2], fields[0], int(fields[1]))


def _lines(text: str) -> Iterable[tuple[int, str]]:
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            yield n, line


def debs(text: str, name: str = "toolkit.lock") -> list[Deb]:
    """The .debs of a Debian toolkit.lock."""
    return [_deb(line.split(), f"{name}:{n}") for n, line in _lines(text)]


def deb_steps(text: str, name: str = "debs.lock") -> dict[str, list[Deb]]:
    """step -> its files, from a debs.lock; every step is a key, empty where the lock has none."""
    out: dict[str, list[Deb]] = {s: [] for s in DEB_STEPS}
    for n, line in _lines(text):
        step, *fields = line.split()
        if step not in out:
            raise LockFormatError(f"{name}:{n}: unknown step {step!r} (one of {', '.join(DEB_STEPS)})")
        out[step].append(_deb(fields, f"{name}:{n}"))
    return out


def deb_steps_text(header: str, steps: dict[str, Iterable[Deb]]) -> str:
    """A debs.lock: header lines, then each step's files in the order given."""
    body = "".join(f"{step} {d.line()}\n" for step in DEB_STEPS for d in steps.get(step, ()))
    return header + body
