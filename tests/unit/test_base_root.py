"""The local base rootfs: who runs mmdebstrap (root itself, password-less sudo as on a hosted
runner, or a user namespace), one clear line without it, and the image written around its
tarball, whose bytes decide the diff_id and the image ID. The real builds, through sudo and with
neither root nor sudo, are tests/integration/test_workflow_replay.py's, as the runner user;
tests/integration/test_base_image.py loads a written image into the real engine."""
from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.errors import BuildError, EnvironmentProblem, NotReady
from pytorch_cuda_build.matrix import REPRODUCIBLE_EPOCH
from pytorch_cuda_build.stages import base

from helpers import ROOT

DEFAULT = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")


def fake_sudo(tmp_path, code: int):
    bin_dir = tmp_path / f"bin{code}"
    bin_dir.mkdir()
    (bin_dir / "sudo").write_text(f"#!/bin/sh\n[ \"$1\" = -n ] || exit 99\nexit {code}\n")
    (bin_dir / "sudo").chmod(0o755)
    return bin_dir


def test_root_runs_mmdebstrap_itself(monkeypatch):
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


@pytest.mark.parametrize("root, prefix, mode", [([], [], "root"), (["sudo", "-n"], ["sudo", "-n"], "root"),
                                                (None, [], "unshare")])
def test_one_command_for_every_user_with_the_fixed_epoch_through_sudo(root, prefix, mode):
    cmd = base.mmdebstrap_command(DEFAULT, root)
    i = cmd.index("mmdebstrap")
    # sudo drops the environment: the epoch goes on the command line, through env
    assert cmd[:i] == [*prefix, "env", f"SOURCE_DATE_EPOCH={REPRODUCIBLE_EPOCH}"]
    assert cmd[i + 1] == f"--mode={mode}" and f"--hook-dir={base.MERGED_USR}" in cmd
    assert cmd[-3:] == [DEFAULT.os.suite, "-", DEFAULT.os.mirror]  # the tarball on stdout, into the caller's file


def test_without_mmdebstrap_one_line_says_what_would_do(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EnvironmentProblem) as e:
        base._rootfs(None, DEFAULT, "pytorch-cuda-rootfs:bookworm-x", tmp_path, print, "docker", ())
    assert str(e.value) == ("building base pytorch-cuda-rootfs:bookworm-x needs mmdebstrap (Debian: apt-get install "
                            "mmdebstrap; a user with neither root nor password-less sudo also needs uidmap); "
                            "or pin a registry base")


def test_a_failing_mmdebstrap_is_one_error_naming_its_log_and_loads_nothing(monkeypatch, tmp_path):
    """mmdebstrap refused (no user namespaces, no /etc/subuid range): a BuildError with the log's
    tail, and docker never asked to load a half-written tarball."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mmdebstrap").write_text("#!/bin/sh\necho 'E: unshare: no subuid range for this user' >&2\nexit 1\n")
    (bin_dir / "mmdebstrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    loads = []
    real_run = base.subprocess.run
    monkeypatch.setattr(base.subprocess, "run", lambda cmd, *a, **kw: loads.append(cmd) if "load" in cmd else real_run(cmd, *a, **kw))
    with pytest.raises(BuildError) as e:
        base._mmdebstrap(None, DEFAULT, "pytorch-cuda-rootfs:x", tmp_path, lambda m: None, "docker", None, ())
    assert "mmdebstrap of the base rootfs" in str(e.value) and "no subuid range" in e.value.tail, e.value
    assert str(tmp_path / "rootfs.log") in str(e.value)
    assert loads == []


def rootfs(tmp_path, name="rootfs.tar", content=b"hello\n"):
    path = tmp_path / name
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("./etc/motd")
        info.size, info.mtime = len(content), REPRODUCIBLE_EPOCH
        tar.addfile(info, io.BytesIO(content))
    return path


def members(archive) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def test_the_image_is_the_tarball_as_its_one_layer_under_a_fixed_config(tmp_path):
    tarball = rootfs(tmp_path)
    diff = hashlib.sha256(tarball.read_bytes()).hexdigest()
    base.write_archive(tmp_path / "image.tar", tarball, "pytorch-cuda-rootfs:x", DEFAULT)
    got = members(tmp_path / "image.tar")
    manifest = json.loads(got["manifest.json"])
    assert manifest == [{"Config": manifest[0]["Config"], "RepoTags": ["pytorch-cuda-rootfs:x"], "Layers": [f"{diff}/layer.tar"]}]
    config_bytes = got[manifest[0]["Config"]]
    assert manifest[0]["Config"] == hashlib.sha256(config_bytes).hexdigest() + ".json"  # the classic store's image ID
    assert got[f"{diff}/layer.tar"] == tarball.read_bytes()  # unchanged: its sha256 is the diff_id
    config = json.loads(config_bytes)
    assert config["rootfs"] == {"type": "layers", "diff_ids": [f"sha256:{diff}"]}
    assert config["created"] == "2026-01-01T00:00:00Z" and config["architecture"] == "amd64" and "variant" not in config


def test_the_config_does_not_depend_on_when_where_or_how_it_is_written(tmp_path, monkeypatch):
    first = base.image_config(DEFAULT, "sha256:" + "0" * 64)
    old = os.umask(0o077)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(base, "datetime", type("Later", (base.datetime,), {"now": classmethod(lambda cls, tz=None: base.datetime(2030, 1, 1, tzinfo=tz))}))
    try:
        assert base.image_config(DEFAULT, "sha256:" + "0" * 64) == first
    finally:
        os.umask(old)
    arm = base.image_config(m_arm64(), "sha256:" + "0" * 64)
    assert json.loads(arm)["architecture"] == "arm64" and json.loads(arm)["variant"] == "v8"


def m_arm64():
    return next(i for i in matrix.load(ROOT / "matrix.yaml").images if "linux/arm64" in i.platforms).on("linux/arm64")


def test_the_mirror_state_is_each_suites_signed_date(tmp_path):
    (tmp_path / "inrelease").write_text("deb.debian.org_debian_dists_bookworm_InRelease\tSat, 11 Jul 2026 10:16:37 UTC\n"
                                        "broken line\n")
    assert base.mirror_state(tmp_path / "inrelease") == {"deb.debian.org_debian_dists_bookworm": "2026-07-11T10:16:37Z"}
    assert base.mirror_state(tmp_path / "absent") == {}


RECORD = {"diff_id": "sha256:" + "a" * 64, "mirror": {"deb.debian.org_debian_dists_bookworm": "2026-07-11T10:16:37Z"}}


def test_a_rebuilt_base_says_whether_it_is_the_recorded_one():
    assert base.compare(dict(RECORD), None).startswith("no identity recorded")
    assert base.compare(dict(RECORD), RECORD) == "the recorded base: diff_id sha256:aaaaaaaaaaaa... (mirror of bookworm 2026-07-11T10:16:37Z)"
    moved = {"diff_id": "sha256:" + "b" * 64, "mirror": {"deb.debian.org_debian_dists_bookworm": "2026-12-01T09:00:00Z"}}
    assert base.compare(moved, RECORD) == ("NOT the recorded base: diff_id sha256:bbbbbbbbbbbb... against sha256:aaaaaaaaaaaa... "
                                           "recorded; the mirror moved since (bookworm 2026-07-11T10:16:37Z then, "
                                           "bookworm 2026-12-01T09:00:00Z now)")
    same_mirror = dict(moved, mirror=RECORD["mirror"])
    assert base.compare(same_mirror, RECORD).endswith("from the same mirror state (bookworm 2026-07-11T10:16:37Z)")


def test_recording_writes_every_row_that_shares_the_base_and_needs_a_build_of_this_checkout(tmp_path):
    m = matrix.load(ROOT / "matrix.yaml")
    found = dict(RECORD, image_id="sha256:" + "c" * 64, store="containerd")
    for image in m.images:
        (tmp_path / "images" / image.name).mkdir(parents=True)
    written = base.record(tmp_path, m, DEFAULT, found, "abc123")
    sharing = [i.name for i in m.images if "linux/amd64" in i.platforms and i.os_name == DEFAULT.os_name]
    assert sorted(p.parent.name for p in written) == sorted(sharing)
    entry = json.loads(written[0].read_text())["linux/amd64"]
    assert entry["diff_id"] == RECORD["diff_id"] and entry["revision"] == "abc123" and entry["store"] == "containerd"
    assert entry["config_digest"] == "sha256:" + hashlib.sha256(base.image_config(DEFAULT, RECORD["diff_id"])).hexdigest()
    assert base.recorded(tmp_path, DEFAULT)["diff_id"] == RECORD["diff_id"]
    assert base.recorded(tmp_path, m_arm64()) is None
    with pytest.raises(NotReady):
        base.record(tmp_path, m, DEFAULT, {"diff_id": RECORD["diff_id"], "image_id": "x", "store": "classic"}, "abc123")
