"""The structure checks the gate runs ship in the package (pytorch_cuda_build/checks), not in
the repository's tests/: the gate finds them from the package's own location, whatever the
project root or the current directory, passes the user's matrix, and runs them. No daemon:
collection needs none, and a run without one must fail the gate with the reason."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import pytorch_cuda_build
from pytorch_cuda_build import matrix
from pytorch_cuda_build.errors import TestFailure as GateFailure  # not Test*: pytest would try to collect it
from pytorch_cuda_build.stages import gate

from helpers import ROOT

ROW = matrix.load(ROOT / "matrix.yaml").by_name("2.7.1-cuda12.1-runtime")


def defined_checks() -> set[str]:
    return {f"{f.name}::{name}" for f in gate.CHECKS.glob("test_*.py")
            for name in re.findall(r"^def (test_\w+)", f.read_text(), re.MULTILINE)}


def test_the_checks_live_in_the_package():
    assert gate.CHECKS == Path(pytorch_cuda_build.__file__).resolve().parent / "checks"
    assert {"__init__.py", "conftest.py", "test_image.py", "test_devel.py"} <= {f.name for f in gate.CHECKS.iterdir()}
    assert not list((ROOT / "tests").glob("structure/*.py")), "the checks moved to pytorch_cuda_build/checks"


def test_the_gate_command_collects_every_check_from_anywhere(tmp_path):
    """Another current directory and a project root without the package: the same checks."""
    cmd = gate.structure_command(tmp_path / "project", ROW, "sha256:" + "0" * 64, tmp_path / "s.xml", ROOT / "matrix.yaml")
    proc = subprocess.run([*cmd, "--collect-only"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = {re.sub(r"\[.*\]$", "", ln) for ln in proc.stdout.splitlines() if "::" in ln}
    assert collected == defined_checks() and len(collected) > 20, collected ^ defined_checks()
    assert "test_image.py::test_command_on_path[deepspeed]" in proc.stdout


def test_the_gate_command_passes_the_users_matrix_and_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cmd = gate.structure_command(Path("proj"), ROW, "sha256:abc", tmp_path / "s.xml", Path("other/m.yaml"))
    assert str(gate.CHECKS) in cmd
    assert f"--matrix={tmp_path / 'other/m.yaml'}" in cmd and f"--root={tmp_path / 'proj'}" in cmd
    assert "--image=sha256:abc" in cmd and f"--image-name={ROW.name}" in cmd
    default = gate.structure_command(tmp_path / "proj", ROW, "sha256:abc", tmp_path / "s.xml")
    assert f"--matrix={tmp_path / 'proj' / 'matrix.yaml'}" in default


def test_run_threads_the_matrix_path_to_the_structure_checks(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(gate, "smoke", lambda *a: {"summary": {"PASS": 1}})
    monkeypatch.setattr(gate, "structure", lambda *a: seen.append(a))
    gate.run(None, ROOT, ROW, "sha256:abc", tmp_path, log=lambda m: None, matrix_path=tmp_path / "m.yaml")
    gate.run(None, ROOT, ROW, "sha256:abc", tmp_path, log=lambda m: None)
    assert [a[4] for a in seen] == [tmp_path / "m.yaml", None]  # None: structure() takes root/matrix.yaml


def test_the_gate_runs_the_packaged_checks_and_fails_when_none_could_run(tmp_path, monkeypatch):
    """A real pytest run of the packaged checks, with no daemon to reach: every check is
    skipped, and the gate says so and why (0 run is a failure, never a pass)."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    with pytest.raises(GateFailure) as e:
        gate.structure(ROOT, ROW, "sha256:" + "0" * 64, tmp_path, ROOT / "matrix.yaml")
    assert "0 tests ran" in str(e.value) and "no Docker daemon" in str(e.value), str(e.value)
    counts = gate.junit_counts(tmp_path / "structure.xml")
    assert counts.passed == counts.failed == 0 and counts.skipped > 20
