"""The host's copy of each image's compiled DeepSpeed ops: its ops seed.

Under `--no-cache`, BuildKit gives every cache mount a fresh, empty instance (seen on 20.10
and 26), so the ops cache mount cannot spare a `--no-cache` rebuild, or `verify`'s two
builds, the op compile. After a build, its `ops-dist` stage (the wheel, ops-facts.json and
the key of every input of the compile) is exported here and filed under that key; a
`--no-cache` build of the same image finds it in its context's ops-seed/, and opsbuild.py
takes it only when the key still matches, so changed inputs still compile.

Normal builds get an empty ops-seed/: the ops step's cache key then never depends on what
this host has exported.

A train image's ops-dist also holds, under te/, Transformer Engine's compiled extension
(tebuild.py), with its own key: it is filed apart (te-wheels/, te-images/) and staged into
ops-seed/te/, so the DeepSpeed entry stays the one the row's other flavors share.
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
from ..files import write_atomic
from ..matrix import Image

CONTEXT_DIR = "ops-seed"  # in the build context; the Dockerfile binds it at /opsseed
KEY_FILE = "ops-cache-key"  # written by opsbuild.py beside the wheel
TARGET = "ops-dist"


def store() -> Path:
    return paths.STATE_DIR / "ops-seed"


# kind -> (the folder of its entries, the folder of the images' pointers, its facts file, its key file, its wheel)
KINDS = {"ops": ("wheels", "images", "ops-facts.json", KEY_FILE, "deepspeed-*.whl"),
         "te": ("te-wheels", "te-images", "te-facts.json", "te-cache-key", "transformer_engine_torch-*.whl")}


def _pointer(image: Image, kind: str = "ops") -> Path:
    return store() / KINDS[kind][1] / image.local_name


def _entry(key: str, kind: str = "ops") -> Path:
    return store() / KINDS[kind][0] / key


def _kinds(image: Image) -> tuple[str, ...]:
    return ("ops", "te") if image.extras_built else ("ops",)


def stage(image: Image, context: Path, use: bool) -> str | None:
    """When `use`, put the image's last exported wheel in the context's (empty) ops-seed/, hard
    linked where the file system allows. The key staged, or None."""
    dest = context / CONTEXT_DIR
    if not use:
        return None
    keys = {}
    for kind in _kinds(image):  # all of them or none: a build that lacks one compiles and exports again
        try:
            keys[kind] = _pointer(image, kind).read_text().strip()
        except OSError:
            return None
        if not (_entry(keys[kind], kind) / KINDS[kind][2]).is_file():
            return None
    for kind, key in keys.items():
        shutil.copytree(_entry(key, kind), (dest if kind == "ops" else dest / kind) / key, copy_function=_link_or_copy)
    return keys["ops"]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def save(exported: Path, image: Image) -> str:
    """File an exported ops-dist under its key, point the image at it and drop the entries no
    image points at any more; the key. The exported directory is consumed."""
    parts = {kind: exported if kind == "ops" else exported / kind for kind in _kinds(image)}
    keys = {kind: _key(part, kind) for kind, part in parts.items()}
    root = store()
    with FileLock(str(root / "store.lock")):  # rows build in parallel
        for kind in sorted(parts, reverse=True):  # te/ first: it leaves the ops export as it
            folder, pointers_folder = (root / d for d in KINDS[kind][:2])
            folder.mkdir(parents=True, exist_ok=True)
            pointers_folder.mkdir(parents=True, exist_ok=True)
            entry = _entry(keys[kind], kind)
            if not entry.exists():
                parts[kind].rename(entry)  # same file system: the export is made under the store
            write_atomic(_pointer(image, kind), keys[kind] + "\n")  # a full disk: one line, the old pointer whole
            pointers = _pointers(kind)
            _, entries = unnamed(pointers, _entries(kind), set(pointers))
            for old in entries:
                shutil.rmtree(_entry(old, kind), ignore_errors=True)
            shutil.rmtree(parts[kind], ignore_errors=True)
    return keys["ops"]


def _key(part: Path, kind: str) -> str:
    """The key an exported part was filed under by its builder, checked to be one wheel, its facts and a key."""
    _, _, facts, key_file, wheel = KINDS[kind]
    where = TARGET if kind == "ops" else f"{TARGET}'s {kind}/"
    try:
        key = (part / key_file).read_text().strip()
    except OSError:
        raise BuildError(f"exporting the compiled ops ({where} has no {key_file})", str(part)) from None
    if not re.fullmatch(r"[0-9a-f]{64}", key) or not (part / facts).is_file() or len(list(part.glob(wheel))) != 1:
        raise BuildError(f"exporting the compiled ops ({where} is not one wheel, {facts} and a key)", str(part))
    return key


def _pointers(kind: str = "ops") -> dict[str, str]:
    """Image name -> the key its pointer names."""
    folder = store() / KINDS[kind][1]
    return {p.name: p.read_text().strip() for p in folder.iterdir() if not p.name.startswith(".")} if folder.is_dir() else {}


def _entries(kind: str = "ops") -> list[str]:
    folder = store() / KINDS[kind][0]
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
    count = freed = 0
    with FileLock(str(root / "store.lock")):  # not while a build files its export
        for kind in KINDS:
            gone, entries = unnamed(_pointers(kind), _entries(kind), images)
            for name in gone:
                _pointer_path(kind, name).unlink(missing_ok=True)
            freed += sum(f.stat().st_size for key in entries for f in _entry(key, kind).rglob("*") if f.is_file())
            for key in entries:
                shutil.rmtree(_entry(key, kind), ignore_errors=True)
            count += len(entries)
    return count, freed


def _pointer_path(kind: str, name: str) -> Path:
    return store() / KINDS[kind][1] / name


def export_dir() -> Path:
    """A fresh directory for an export, on the store's file system (filed by a rename), named by
    this process: the exports of processes that are gone (a SIGKILL mid-export) are removed first."""
    (store() / "wheels").mkdir(parents=True, exist_ok=True)
    for left in store().glob(".export-*"):
        pid = left.name.split("-")[1]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(left, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=store(), prefix=f".export-{os.getpid()}-"))
