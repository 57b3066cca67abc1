"""The host's copy of each image's compiled DeepSpeed ops: its ops seed.

Under `--no-cache`, BuildKit gives every cache mount a fresh, empty instance (seen on 20.10
and 26), so the ops cache mount cannot spare a `--no-cache` rebuild, or `verify`'s two
builds, the op compile. After a build, its `ops-dist` stage (the wheel, ops-facts.json and
the key of every input of the compile) is exported here and filed under that key; a
`--no-cache` build of the same image finds it in its context's ops-seed/, and opsbuild.py
takes it only when the key still matches, so changed inputs still compile.

Normal builds get an empty ops-seed/: the ops step's cache key then never depends on what
this host has exported.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from .. import paths
from ..errors import BuildError
from ..matrix import Image

CONTEXT_DIR = "ops-seed"  # in the build context; the Dockerfile binds it at /opsseed
KEY_FILE = "ops-cache-key"  # written by opsbuild.py beside the wheel
TARGET = "ops-dist"


def store() -> Path:
    return paths.STATE_DIR / "ops-seed"


def _pointer(image: Image) -> Path:
    return store() / "images" / image.local_name


def _entry(key: str) -> Path:
    return store() / "wheels" / key


def stage(image: Image, context: Path, use: bool) -> str | None:
    """When `use`, put the image's last exported wheel in the context's (empty) ops-seed/, hard
    linked where the file system allows. The key staged, or None."""
    dest = context / CONTEXT_DIR
    if not use:
        return None
    try:
        key = _pointer(image).read_text().strip()
    except OSError:
        return None
    entry = _entry(key)
    if not (entry / "ops-facts.json").is_file():
        return None
    shutil.copytree(entry, dest / key, copy_function=_link_or_copy)
    return key


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def save(exported: Path, image: Image) -> str:
    """File an exported ops-dist under its key, point the image at it and drop the entries no
    image points at any more; the key. The exported directory is consumed."""
    try:
        key = (exported / KEY_FILE).read_text().strip()
    except OSError:
        raise BuildError(f"exporting the compiled ops ({TARGET} has no {KEY_FILE})", str(exported)) from None
    if not re.fullmatch(r"[0-9a-f]{64}", key) or not (exported / "ops-facts.json").is_file() \
            or len(list(exported.glob("deepspeed-*.whl"))) != 1:
        raise BuildError(f"exporting the compiled ops ({TARGET} is not one wheel, ops-facts.json and a key)", str(exported))
    root = store()
    (root / "wheels").mkdir(parents=True, exist_ok=True)
    (root / "images").mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "store.lock")):  # rows build in parallel
        entry = _entry(key)
        if not entry.exists():
            exported.rename(entry)  # same file system: the export is made under the store
        fd, tmp = tempfile.mkstemp(dir=root / "images", prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.replace(tmp, _pointer(image))
        pointers = _pointers()
        _, entries = unnamed(pointers, _entries(), set(pointers))
        for old in entries:
            shutil.rmtree(_entry(old), ignore_errors=True)
    shutil.rmtree(exported, ignore_errors=True)
    return key


def _pointers() -> dict[str, str]:
    """Image name -> the key its pointer names."""
    folder = store() / "images"
    return {p.name: p.read_text().strip() for p in folder.iterdir() if not p.name.startswith(".")} if folder.is_dir() else {}


def _entries() -> list[str]:
    folder = store() / "wheels"
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


def unnamed(pointers: dict[str, str], entries: list[str], images: set[str]) -> tuple[list[str], list[str]]:
    """What a clean-up drops: the pointers of images not in `images`, and the entries no kept
    pointer names. (Pointers to drop, entries to drop.)"""
    gone = sorted(name for name in pointers if name not in images)
    named = {key for name, key in pointers.items() if name in images}
    return gone, [key for key in entries if key not in named]


def prune(images: set[str]) -> tuple[int, int]:
    """Drop the pointers of images not in `images` and every entry no image then names; how many
    entries went and their bytes."""
    root = store()
    if not root.is_dir():
        return 0, 0
    with FileLock(str(root / "store.lock")):  # not while a build files its export
        gone, entries = unnamed(_pointers(), _entries(), images)
        for name in gone:
            (root / "images" / name).unlink(missing_ok=True)
        freed = sum(f.stat().st_size for key in entries for f in _entry(key).rglob("*") if f.is_file())
        for key in entries:
            shutil.rmtree(_entry(key), ignore_errors=True)
    return len(entries), freed


def export_dir() -> Path:
    """A fresh directory for an export, on the store's file system (filed by a rename)."""
    (store() / "wheels").mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=store(), prefix=".export-"))
