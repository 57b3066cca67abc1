"""Who builds the local base rootfs: root itself, or a user with password-less sudo (a hosted
CI runner's user), and one clear line for anyone else. A real debootstrap through sudo is
tests/integration/test_workflow_replay.py's, as the runner user."""
from __future__ import annotations

import pytest

from pytorch_cuda_build import base
from pytorch_cuda_build.errors import EnvironmentProblem


def fake_sudo(tmp_path, code: int):
    bin_dir = tmp_path / f"bin{code}"
    bin_dir.mkdir()
    (bin_dir / "sudo").write_text(f"#!/bin/sh\n[ \"$1\" = -n ] || exit 99\nexit {code}\n")
    (bin_dir / "sudo").chmod(0o755)
    return bin_dir


def test_root_runs_debootstrap_itself(monkeypatch):
    monkeypatch.setattr(base.os, "geteuid", lambda: 0)
    assert base.as_root("r") == []


def test_a_user_with_password_less_sudo_goes_through_it(monkeypatch, tmp_path):
    monkeypatch.setattr(base.os, "geteuid", lambda: 1001)
    monkeypatch.setenv("PATH", str(fake_sudo(tmp_path, 0)))
    assert base.as_root("r") == ["sudo", "-n"]


@pytest.mark.parametrize("sudo", ["asks for a password", "absent"])
def test_anyone_else_gets_one_line_that_says_what_would_do(monkeypatch, tmp_path, sudo):
    monkeypatch.setattr(base.os, "geteuid", lambda: 1001)
    monkeypatch.setenv("PATH", str(fake_sudo(tmp_path, 1)) if sudo != "absent" else str(tmp_path))
    with pytest.raises(EnvironmentProblem) as e:
        base.as_root("pytorch-cuda-rootfs:bookworm-x")
    assert str(e.value) == ("building base pytorch-cuda-rootfs:bookworm-x with debootstrap needs root or "
                            "password-less sudo; run as root, or pin a registry base")
