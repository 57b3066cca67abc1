"""The layout of the locked wheels in image layers, decided by the lock alone.

A layer's blob is the digest of its files, so a layer that holds exactly one wheel's files is
the same blob in every row and every refresh that installs that file (the registry stores it
once, a node pulls it once). The rule (matrix.yaml `layers:`): each wheel whose download is at
least `own_layer_min_mb` MB gets a layer of its own, at most `max_own_layers` of them, largest
first; every other wheel shares one last layer. Largest first: a refresh, which mostly moves
small packages, rebuilds and changes only the layers after the ones it keeps. Sizes and files
come from lock.json's `wheels` (wheel_files.py), so rendering stays offline.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import LockError
from ..matrix import Image
from ..resolve.wheel_files import pinned_hashes

MB = 1_000_000


@dataclass(frozen=True)
class OwnLayer:
    """One wheel alone in its layer: the requirement line that pins it to the one file."""

    name: str
    version: str
    file: str
    sha256: str
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class Layout:
    own: tuple[OwnLayer, ...]  # in build order, largest first
    rest: tuple[str, ...]  # the names that share the last layer, sorted
    rest_bytes: int

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.own]


def wheels_of(meta: dict, platform: str) -> dict[str, dict]:
    """lock.json's wheel files of a platform (linux/amd64's at the top, the others' under platforms)."""
    part = meta if platform == "linux/amd64" else meta.get("platforms", {}).get(platform, {})
    wheels = part.get("wheels")
    if not isinstance(wheels, dict):
        raise LockError(f"{meta.get('image', '?')}: lock.json has no wheel files for {platform}; run `python build.py lock`")
    return wheels


def extras_wheels_of(meta: dict, platform: str) -> dict[str, dict]:
    """A train image's extras wheel files on a platform (lock.json `extras`)."""
    wheels = meta.get("extras", {}).get(platform, {}).get("wheels")
    if not isinstance(wheels, dict):
        raise LockError(f"{meta.get('image', '?')}: lock.json has no extras wheel files for {platform}; run `python build.py lock`")
    return wheels


def plan(image: Image, lock_text: str, wheels: dict[str, dict]) -> Layout:
    """The layout of the wheels of requirements.lock (lock_text) for image.platform."""
    pins = pinned_hashes(lock_text)
    missing = sorted(set(pins) - set(wheels))
    if missing:
        raise LockError(f"{image.name}: lock.json names no {image.platform} wheel file for {', '.join(missing)}; run `python build.py lock`")
    rule = image.layers
    big = []
    if rule.own_layer_min_mb is not None:
        big = [n for n in pins if wheels[n]["size"] >= rule.own_layer_min_mb * MB]
        big = sorted(big, key=lambda n: (-wheels[n]["size"], n))[:rule.max_own_layers]
    own = tuple(OwnLayer(n, pins[n][0], wheels[n]["file"], wheels[n]["sha256"], wheels[n]["size"]) for n in big)
    rest = tuple(sorted(set(pins) - set(big)))
    return Layout(own, rest, sum(wheels[n]["size"] for n in rest))
