"""Atomic writes: a reader (or a killed run) never sees a half-written file under images/."""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from .errors import EnvironmentProblem


def write_atomic(path: Path, text: str) -> bool:
    """Write text to path via a temp file and rename; return whether the content changed."""
    return path in write_all_atomic([(path, text)])


def write_all_atomic(items: list[tuple[Path, str]]) -> set[Path]:
    """Write a set of files all or nothing: every changed file goes to a temp file first,
    and only when all are on disk are they renamed (a rename needs no space). Returns
    the paths that changed."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, text in items:
            if path.exists() and path.read_text(encoding="utf-8") == text:
                continue
            staged.append((_stage(path, text), path))
    except BaseException as e:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            what = str(items[0][0]) if len(items) == 1 else f"{len(items)} files under {items[0][0].parent.parent}"
            raise EnvironmentProblem(f"no space left on device writing {what}; nothing was changed") from None
        raise
    for tmp, path in staged:
        os.replace(tmp, path)
    return {path for _, path in staged}


def _stage(path: Path, text: str) -> str:
    """text in a temp file beside path, flushed to disk, mode 0644; its name (removed on failure)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # whatever the locale: bytes read back are the bytes meant
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def sha256_text(*texts: str) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()


def copy_project(root: Path, dest: Path) -> Path:
    """The project's committed inputs and code copied to dest, its .venv linked (not copied),
    so the copy's build.py runs at once: for experiments that must not touch the real tree."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("matrix.yaml", "Dockerfile.base", "build.py"):
        shutil.copy2(root / name, dest / name)
    for name in ("images", "templates", "pytorch_cuda_build", "pytorch_cuda_runtime", "tests"):
        shutil.copytree(root / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / ".venv").symlink_to(root / ".venv")
    return dest


def writer_lock(root: Path, state_dir: Path) -> FileLock:
    """One writer of a checkout's images/ at a time: two `lock`/`render` runs never interleave files."""
    state_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(str(state_dir / f"images-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}.lock"))
