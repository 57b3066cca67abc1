"""--docker (or $PYTORCH_CUDA_DOCKER) picks the Docker CLI for every command that runs one:
the base import, verify's `save`, bench's `run`s and the build.py runs bench measures."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import docker.errors
import pytest

from pytorch_cuda_build import matrix, paths
from pytorch_cuda_build.commands import verify
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import EnvironmentProblem
from pytorch_cuda_build.stages import base
from pytorch_cuda_build.tooling import bench
from pytorch_cuda_runtime.lockfile import Input

from helpers import ROOT

DEFAULT = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")


@pytest.fixture
def my_docker(tmp_path):
    path = tmp_path / "my-docker"
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return str(path)


def test_docker_cli_is_the_option_then_the_variable_then_path(my_docker, monkeypatch, tmp_path):
    monkeypatch.delenv(docker_env.DOCKER_ENV, raising=False)
    assert docker_env.docker_cli(my_docker) == my_docker
    monkeypatch.setenv(docker_env.DOCKER_ENV, my_docker)
    assert docker_env.docker_cli() == my_docker
    monkeypatch.setenv(docker_env.DOCKER_ENV, "")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EnvironmentProblem, match="no Docker CLI 'docker' on PATH; .*--docker"):
        docker_env.docker_cli()
    with pytest.raises(EnvironmentProblem, match="no Docker CLI 'podman-nope' on PATH"):
        docker_env.docker_cli("podman-nope")


def test_verify_saves_through_the_chosen_cli(monkeypatch):
    seen = []

    class Proc:
        def __init__(self, argv, **kw):
            seen.append(argv)
            self.stdout, self.stderr, self.returncode = SimpleNamespace(read=lambda n=0: b"", close=lambda: None), \
                SimpleNamespace(read=lambda: b"gone\n", close=lambda: None), None

        def wait(self):
            self.returncode = 1
    monkeypatch.setattr(subprocess, "Popen", Proc)  # verify saves through record.read_saved
    with pytest.raises(Exception, match="`/opt/my/docker save img` exited 1: gone"):
        verify.layer_index("img", docker_cli="/opt/my/docker")
    assert seen == [["/opt/my/docker", "save", "img"]]


def test_bench_runs_containers_through_the_chosen_cli(monkeypatch, tmp_path):
    seen = []

    def run(cmd, **kw):
        seen.append(cmd[0])
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(bench.subprocess, "run", run)
    bench.banner(DEFAULT, "pytorch-cuda:v2.7", 2, tmp_path, docker_cli="/opt/my/docker")
    assert seen and set(seen) == {"/opt/my/docker"}
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: seen.append(cmd[0]) or subprocess.CompletedProcess(cmd, 0, "1234\t/opt/venv\n", ""))
    assert bench.du_venv("/opt/other/docker", "x") == 1234 and seen[-1] == "/opt/other/docker"  # the size measure


def test_base_loads_the_rootfs_through_the_chosen_cli(monkeypatch, tmp_path):
    seen = []

    class Images:
        built = False

        def get(self, ref):
            if not self.built:
                raise docker.errors.ImageNotFound(ref)
            return SimpleNamespace(id="sha256:feed")

    images = Images()

    def run(cmd, stdout=None, **kw):
        seen.append(cmd)
        if "mmdebstrap" in cmd:
            stdout.write(b"not really a tarball")
        if cmd[1:2] == ["load"]:
            images.built = True
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(base.os, "geteuid", lambda: 0)
    monkeypatch.setattr(base.shutil, "which", lambda name, **kw: f"/usr/bin/{name}")
    monkeypatch.setattr(base.subprocess, "run", run)
    release = Input("InRelease", "http://deb.debian.org/debian/dists/bookworm/InRelease", "0" * 64, 1)
    got = base.ensure(SimpleNamespace(images=images), DEFAULT, tmp_path, log=lambda m: None, docker_cli="/opt/my/docker",
                      inputs=(release,))
    assert got == "sha256:feed"
    assert [c[c.index("mmdebstrap")] if "mmdebstrap" in c else c[:2] for c in seen] == ["mmdebstrap", ["/opt/my/docker", "load"]]
