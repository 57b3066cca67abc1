"""stack.py (the pinned GPU stack behind PIP_CONSTRAINT and UV_CONSTRAINT) and the banner's lines
about it, outside an image: which packages are held, the constraints file's header, what the
banner says when one moved."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pytorch_cuda_runtime import banner, stack  # noqa: E402

INSTALLED = {"torch": "2.7.1", "triton": "3.3.1", "deepspeed": "0.17.6", "nvidia-nccl-cu12": "2.26.2",
             "nvidia-ml-py": "13.615.71", "cuda-toolkit": "13.0.2", "cuda-bindings": "13.5.0",
             "transformers": "5.24.0", "numpy": "2.4.6", "nvidia": "0.1", "six": "1.17.0"}


def test_the_held_packages_are_torch_triton_deepspeed_and_the_nvidia_and_cuda_wheels():
    assert list(stack.protected(INSTALLED)) == ["cuda-bindings", "cuda-toolkit", "deepspeed", "nvidia-ml-py",
                                                 "nvidia-nccl-cu12", "torch", "triton"]


def test_the_constraints_file_says_how_to_override_and_reads_back(tmp_path):
    text = stack.constraints_text(INSTALLED)
    assert text.startswith("# The GPU stack this image was built and tested with.")
    for how in ("PIP_CONSTRAINT= pip install torch==VERSION", "UV_CONSTRAINT= uv pip install torch==VERSION",
                "ENV PIP_CONSTRAINT= UV_CONSTRAINT=", "docs/extending.md"):
        assert how in text
    assert "torch==2.7.1\n" in text and "transformers" not in text and "numpy" not in text
    path = tmp_path / "constraints.txt"
    path.write_text(text)
    assert stack.read(path) == stack.protected(INSTALLED)
    with pytest.raises(ValueError, match="torch is not installed"):
        stack.constraints_text({"numpy": "2.4.6"})


def test_changes_name_each_moved_or_removed_package_with_its_tested_version():
    pins = stack.protected(INSTALLED)
    assert stack.changes(pins, INSTALLED) == []
    now = {**INSTALLED, "torch": "2.8.0", "transformers": "6.0"}
    del now["nvidia-nccl-cu12"]
    assert stack.changes(pins, now) == ["nvidia-nccl-cu12 removed (tested: 2.26.2)", "torch 2.8.0 (tested: 2.7.1)"]
    line = stack.changed_line([f"p{i} 2 (tested: 1)" for i in range(6)])
    assert "p0 2 (tested: 1), p1 2 (tested: 1), p2 2 (tested: 1), p3 2 (tested: 1) and 2 more" in line


def test_the_banner_says_how_to_add_packages_and_warns_after_an_override():
    quiet = banner.render({}, [], 1 << 31, moved=[])
    assert "pip/uv install as any user" in quiet and stack.HOW_TO_OVERRIDE in quiet and "differs" not in quiet
    warned = banner.render({}, [], 1 << 31, moved=["torch 2.8.0 (tested: 2.7.1)"])
    assert "WARNING: the pinned stack differs from what this image was tested with: torch 2.8.0 (tested: 2.7.1)." in warned
    assert "pip/uv" not in banner.render({}, [], 1 << 31, moved=None)  # no constraints file: nothing to say


def test_the_command_line_writes_and_checks(tmp_path):
    """In this interpreter (no torch here as a rule): `constraints` refuses in one line with exit 2;
    `check` against a file pinning what is installed passes, against another version fails."""
    run = lambda *a: subprocess.run([sys.executable, "-m", "pytorch_cuda_runtime.stack", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=ROOT, timeout=60)
    if "torch" not in stack.installed():
        out = run("constraints", "--output", str(tmp_path / "c.txt"))
        assert out.returncode == 2 and out.stderr.strip() == "stack: torch is not installed: no stack to pin"
        assert not (tmp_path / "c.txt").exists()
    pip_version = stack.installed()["pip"]
    held = tmp_path / "held.txt"
    held.write_text(f"# h\npip=={pip_version}\n")
    assert run("check", "--constraints", str(held)).returncode == 0
    held.write_text("pip==0.1\n")
    moved = run("check", "--constraints", str(held))
    assert moved.returncode == 1 and moved.stdout.strip() == f"pip {pip_version} (tested: 0.1)"
    missing = run("check", "--constraints", str(tmp_path / "none.txt"))
    assert missing.returncode == 2 and missing.stderr.startswith("stack: ")
