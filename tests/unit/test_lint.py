"""ruff and mypy on the host package, both clean: the settings are pyproject.toml's
([tool.ruff], [tool.mypy]), the tools come with build.py's .venv (pytorch_cuda_build/requirements.txt).

Offline and without a daemon: neither tool reads the network (mypy's stubs are installed
packages), and neither writes into the repository (ruff --no-cache; mypy's cache in tmp_path).
"""
from __future__ import annotations

import subprocess
import sys

from helpers import ROOT


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", tool, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_ruff_finds_nothing_in_the_host_package():
    proc = _run("ruff", "check", "--no-cache", "--output-format", "concise", "pytorch_cuda_build")
    assert proc.returncode == 0, f"ruff check pytorch_cuda_build exit {proc.returncode}:\n{proc.stdout}{proc.stderr}"


def test_mypy_finds_nothing_in_the_host_package(tmp_path):
    # [tool.mypy] files: pytorch_cuda_build (not the in-image package, not the tests)
    proc = _run("mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "mypy-cache"),
                "--no-error-summary")
    assert proc.returncode == 0, f"mypy exit {proc.returncode}:\n{proc.stdout}{proc.stderr}"
