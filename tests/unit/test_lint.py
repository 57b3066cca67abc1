"""ruff on the host package and mypy on both packages (the host's and the in-image one), clean: the settings are pyproject.toml's
([tool.ruff], [tool.mypy]), the tools come with build.py's .venv (pytorch_cuda_build/requirements.txt).

Offline and without a daemon: neither tool reads the network (mypy's stubs are installed
packages), and neither writes into the repository (ruff --no-cache; mypy's cache in tmp_path).
"""
from __future__ import annotations

import subprocess
import sys
import tomllib

from helpers import ROOT


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", tool, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_ruff_finds_nothing_in_the_host_package():
    proc = _run("ruff", "check", "--no-cache", "--output-format", "concise", "pytorch_cuda_build")
    assert proc.returncode == 0, f"ruff check pytorch_cuda_build exit {proc.returncode}:\n{proc.stdout}{proc.stderr}"


def test_mypy_finds_nothing_in_either_package(tmp_path):
    # [tool.mypy] files: pytorch_cuda_build and pytorch_cuda_runtime (not the tests)
    proc = _run("mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "mypy-cache"),
                "--no-error-summary")
    assert proc.returncode == 0, f"mypy exit {proc.returncode}:\n{proc.stdout}{proc.stderr}"


def test_mypy_reads_the_in_image_package():
    """The in-image package is checked, every function body at least (check_untyped_defs): no override
    silences it as a whole; only modules another branch is typing are left out, by name."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "pytorch_cuda_runtime" in config["files"] and config["check_untyped_defs"] is True
    for override in config["overrides"]:
        runtime = [m for m in override["module"] if m.startswith("pytorch_cuda_runtime")]
        assert not runtime or "follow_imports" not in override, override
        if override.get("ignore_errors"):
            assert all("*" not in m and m != "pytorch_cuda_runtime" for m in runtime), override
