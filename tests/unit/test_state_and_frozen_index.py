"""The suite is hermetic: its own state directory, the index frozen in time, no user state touched."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytorch_cuda_build import files, paths
from pytorch_cuda_build.errors import ResolveError
from pytorch_cuda_build.resolve import pypi as resolve_pypi
from pytorch_cuda_build.stages import tag

from helpers import ROOT, project_copy, run_build_py

USER_STATE = Path.home() / ".cache" / "pytorch-cuda"


def test_the_session_has_its_own_state_directory():
    assert paths.STATE_DIR == Path(os.environ["PYTORCH_CUDA_STATE"])
    assert paths.STATE_DIR.is_dir() and paths.STATE_DIR != USER_STATE
    assert tag.TESTED.parent == paths.STATE_DIR


def test_build_py_inherits_it_and_never_writes_the_users_state(tmp_path):
    """`render` takes the images lock of its checkout in the state directory; with HOME elsewhere
    it lands in ours (a copy of the project, so that ROOT's images/ is not rewritten under the
    other tests; the lock's name is the copy's own, so no earlier test can have made it)."""
    root = project_copy(tmp_path / "p")
    mine = files.writer_lock(root, paths.STATE_DIR).lock_file
    assert not Path(mine).exists()
    proc = run_build_py(root, "render", env={"HOME": str(tmp_path), "DOCKER_HOST": "unix:///nonexistent"})
    assert proc.returncode == 0, proc.stderr
    assert Path(mine).exists(), list(paths.STATE_DIR.iterdir())
    assert not (tmp_path / ".cache").exists()


def test_unset_or_empty_state_means_the_users_cache_never_the_current_directory(tmp_path):
    """One interpreter re-imports paths under each value (STATE_DIR is read at import)."""
    code = (
        "import importlib, os, sys\n"
        "from pytorch_cuda_build import paths\n"
        "for value in sys.argv[1:]:\n"
        "    os.environ.pop('PYTORCH_CUDA_STATE', None) if value == 'UNSET' else os.environ.update(PYTORCH_CUDA_STATE=value)\n"
        "    print(importlib.reload(paths).STATE_DIR)\n"
    )
    env = {**os.environ, "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code, "UNSET", "", "~/elsewhere"], capture_output=True, text=True,
                         env=env, cwd=ROOT, check=True).stdout.split()
    assert out == [str(tmp_path / ".cache" / "pytorch-cuda")] * 2 + [str(tmp_path / "elsewhere")]


def test_the_index_is_frozen_for_the_session():
    assert resolve_pypi.frozen_at() == os.environ["PYTORCH_CUDA_EXCLUDE_NEWER"]


def test_exclude_newer_reaches_uv_and_is_checked(monkeypatch):
    monkeypatch.setattr(resolve_pypi, "uv_binary", lambda: "uv")
    image = type("I", (), {"python": "3.11", "index": "https://pypi.org/simple"})()
    assert resolve_pypi._uv_compile(image, "2026-11-22T21:30:00Z")[-2:] == ["--exclude-newer", "2026-11-22T21:30:00Z"]
    assert "--exclude-newer" not in resolve_pypi._uv_compile(image, None)
    assert resolve_pypi.frozen_at("2025-01-31") == "2025-01-31"
    monkeypatch.delenv(resolve_pypi.EXCLUDE_NEWER_ENV)
    assert resolve_pypi.frozen_at() is None
    monkeypatch.setenv(resolve_pypi.EXCLUDE_NEWER_ENV, "last tuesday")
    with pytest.raises(ResolveError, match="PYTORCH_CUDA_EXCLUDE_NEWER='last tuesday' is not an ISO 8601"):
        resolve_pypi.frozen_at()
