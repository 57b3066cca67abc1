"""A current Docker Engine beside 20.10 (`build.py engine`): trixie's Docker 26 with buildx and
the containerd image store comes up from Debian's signed packages, starts containers on a
bridge of its own, and leaves the 20.10 engine and its docker0 working."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, current_engine, run_build_py

from pytorch_cuda_build import base, engine_current, matrix, render

pytestmark = [pytest.mark.docker]

ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")


@pytest.fixture(scope="module")
def current():
    with current_engine() as env:
        yield env


def cli(env: dict[str, str], *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([env["PYTORCH_CUDA_DOCKER"], *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600, **kw)


def test_docker_26_with_buildx_and_the_containerd_store_answers_beside_20_10(current, docker_client):
    info = json.loads(cli(current, "info", "--format", "{{json .}}").stdout)
    assert info["ServerVersion"].startswith("26."), info["ServerVersion"]
    assert ["driver-type", "io.containerd.snapshotter.v1"] in info["DriverStatus"]
    assert info["DockerRootDir"] == str(engine_current.STORES["containerd"].state / "docker")
    assert "0.13" in cli(current, "buildx", "version").stdout
    assert docker_client.version()["Version"].startswith("20.10")  # the SDK's default daemon is still 20.10
    assert Path("/sys/class/net/docker0").exists()


def test_asking_again_finds_it_up_and_prints_the_same(current):
    proc = run_build_py(ROOT, "engine", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "starting dockerd" not in proc.stderr
    assert engine_current.exports(current) == proc.stdout


def test_containers_start_on_both_engines_each_on_its_own_bridge(current, docker_client, tmp_path):
    ref = render.base_ref(ROW)
    base.ensure(docker_client, ROW, tmp_path, log=lambda m: None, docker_cli="/usr/bin/docker")
    if cli(current, "image", "inspect", ref).returncode != 0:
        save = subprocess.Popen(["/usr/bin/docker", "save", ref], stdout=subprocess.PIPE)
        load = cli(current, "load", stdin=save.stdout)
        save.stdout.close()
        assert save.wait() == 0 and load.returncode == 0, load.stderr
    new = cli(current, "run", "--rm", ref, "hostname", "-I")
    assert new.returncode == 0, new.stderr
    assert new.stdout.split()[0].startswith("172.30.213."), new.stdout  # pcb-ctrd0's subnet
    old = docker_client.containers.run(ref, ["hostname", "-I"], remove=True).decode()
    assert old.split()[0].startswith("172.17."), old  # docker0, untouched


# The whole pipeline on Docker 26 with the containerd store (build, smoke, structure, tag,
# publish, pull back by digest) is the workflow replay's: tests/integration/test_workflow_replay.py.
