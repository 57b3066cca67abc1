"""Who builds the local base rootfs: root itself, or a user with password-less sudo (a hosted
CI runner's user) with debootstrap; anyone else with mmdebstrap, or one clear line without it.
The real builds, through sudo and with neither root nor sudo, are
tests/integration/test_workflow_replay.py's, as the runner user."""
from __future__ import annotations

import pytest

from pytorch_cuda_build.errors import EnvironmentProblem
from pytorch_cuda_build.stages import base


def fake_sudo(tmp_path, code: int):
    bin_dir = tmp_path / f"bin{code}"
    bin_dir.mkdir()
    (bin_dir / "sudo").write_text(f"#!/bin/sh\n[ \"$1\" = -n ] || exit 99\nexit {code}\n")
    (bin_dir / "sudo").chmod(0o755)
    return bin_dir


def test_root_runs_debootstrap_itself(monkeypatch):
    monkeypatch.setattr(base.os, "geteuid", lambda: 0)
    assert base.as_root() == []


def test_a_user_with_password_less_sudo_goes_through_it(monkeypatch, tmp_path):
    monkeypatch.setattr(base.os, "geteuid", lambda: 1001)
    monkeypatch.setenv("PATH", str(fake_sudo(tmp_path, 0)))
    assert base.as_root() == ["sudo", "-n"]


@pytest.mark.parametrize("sudo", ["asks for a password", "absent"])
def test_anyone_else_has_no_root(monkeypatch, tmp_path, sudo):
    monkeypatch.setattr(base.os, "geteuid", lambda: 1001)
    monkeypatch.setenv("PATH", str(fake_sudo(tmp_path, 1)) if sudo != "absent" else str(tmp_path))
    assert base.as_root() is None


def test_without_root_and_without_mmdebstrap_one_line_says_what_would_do(monkeypatch, tmp_path):
    monkeypatch.setattr(base.os, "geteuid", lambda: 1001)
    monkeypatch.setenv("PATH", str(fake_sudo(tmp_path, 1)))
    called = []
    monkeypatch.setattr(base, "_mmdebstrap", lambda *a: called.append(a))
    with pytest.raises(EnvironmentProblem) as e:
        base._rootfs(None, None, "pytorch-cuda-rootfs:bookworm-x", tmp_path, print, "docker")
    assert str(e.value) == ("building base pytorch-cuda-rootfs:bookworm-x needs root or password-less sudo "
                            "(debootstrap), or mmdebstrap for a user with neither (Debian: apt-get install "
                            "mmdebstrap uidmap); or pin a registry base")
    assert called == []


def test_without_root_mmdebstrap_builds_it(monkeypatch, tmp_path):
    monkeypatch.setattr(base.os, "geteuid", lambda: 1001)
    bin_dir = fake_sudo(tmp_path, 1)
    (bin_dir / "mmdebstrap").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "mmdebstrap").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(base, "_debootstrap", lambda *a: pytest.fail("debootstrap without root"))
    monkeypatch.setattr(base, "_mmdebstrap", lambda c, image, ref, *a: f"built {ref}")
    assert base._rootfs(None, None, "r", tmp_path, print, "docker") == "built r"


def test_a_failing_mmdebstrap_is_one_error_naming_its_log_and_loads_nothing(monkeypatch, tmp_path):
    """mmdebstrap refused (no user namespaces, no /etc/subuid range): a BuildError with the log's
    tail, and BuildKit never asked to load a half-written tarball."""
    from pytorch_cuda_build import matrix
    from pytorch_cuda_build.engine import docker_env
    from pytorch_cuda_build.errors import BuildError

    from helpers import ROOT

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mmdebstrap").write_text("#!/bin/sh\necho 'E: unshare: no subuid range for this user'\nexit 1\n")
    (bin_dir / "mmdebstrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    loads = []
    monkeypatch.setattr(base.docker_env, "probe", lambda cli: docker_env.BuildClient(("docker", "buildx", "build", "--load"), {}, "x"))
    monkeypatch.setattr(base.subprocess, "run", _only_mmdebstrap(base.subprocess.run, loads))
    row = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    with pytest.raises(BuildError) as e:
        base._mmdebstrap(None, row, "pytorch-cuda-rootfs:x", tmp_path, lambda m: None, "docker")
    assert "mmdebstrap of the base rootfs" in str(e.value) and "no subuid range" in e.value.tail, e.value
    assert str(tmp_path / "rootfs.log") in str(e.value)
    assert loads == []  # no BuildKit load after the failure


def _only_mmdebstrap(run, loads):
    def fake(cmd, *a, **kw):
        if cmd[0] != "mmdebstrap":
            loads.append(cmd)
        return run(cmd, *a, **kw)
    return fake
