"""linux/arm64 in CI, with no emulated image build (docs/arm64.md says what runs on request):
QEMU registered, the arm64 base built from Debian's arm64 archive and started under emulation,
and the platform checks of `build --platform linux/arm64 --dry-run`. The lock and render of the
arm64 files are tests/unit's (test_lock_render, test_platforms)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.stages import base, render

from helpers import run_build_py, shown

pytestmark = [pytest.mark.docker, pytest.mark.second_lane]

ROOT = Path(__file__).resolve().parents[2]
ROW = matrix.load(ROOT / "matrix.yaml").select("2.11", "13.0")
ARM = ROW.on("linux/arm64")


@pytest.fixture(scope="module")
def arm64_base(docker_client, tmp_path_factory):
    if docker_env.host_platform() != "linux/amd64":
        pytest.skip("this checks emulation on an x86-64 host; an arm64 host builds its base natively")
    docker_env.ensure_emulation("linux/arm64")  # the session's engine.sh registered it already (root)
    # the build client's CLI, as the pipeline passes it: `docker` on PATH may be a newer client
    # without buildx (this machine's /usr/local/bin/docker 28.2), which cannot load the tree
    return base.ensure(docker_client, ARM, tmp_path_factory.mktemp("arm64-base"), docker_cli=docker_env.build_client().argv[0])


def test_qemu_is_registered_with_flag_f():
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").read_text().splitlines()
    assert "enabled" in entry and "F" in next(line for line in entry if line.startswith("flags:")), entry


def test_the_arm64_base_is_an_arm64_image_of_its_own_that_starts_under_qemu(docker_client, arm64_base):
    img = docker_client.images.get(arm64_base)
    assert (img.attrs["Os"], img.attrs["Architecture"]) == ("linux", "arm64"), img.attrs["Architecture"]
    assert render.base_ref(ARM) in img.tags
    amd64 = docker_client.images.list(name=render.base_ref(ROW))
    assert all(i.id != arm64_base for i in amd64)  # never the amd64 base under another name
    cli = docker_env.docker_cli()
    proc = subprocess.run([cli, "run", "--rm", "--platform", "linux/arm64", render.base_ref(ARM), "sh", "-c",
                           "uname -m; dpkg --print-architecture"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, shown(proc)
    assert proc.stdout.split() == ["aarch64", "arm64"], shown(proc)


def test_the_dry_run_checks_the_platform_and_says_it_is_emulated(arm64_base):
    proc = run_build_py(ROOT, "--torch", "2.11", "--platform", "linux/arm64", "--dry-run", timeout=120)
    assert proc.returncode == 0, shown(proc)
    plan = dict(line.split(":", 1) for line in proc.stdout.split("\n\n", 1)[0].splitlines())
    assert plan["platform"].strip() == "linux/arm64, emulated on this linux/amd64 host: QEMU is registered (binfmt_misc, flag F)"
    assert plan["cpu ops"].strip().startswith("-march=armv8.2-a")
    assert plan["base"].strip().startswith(render.base_ref(ARM) + " ")
    assert plan["dockerfile"].strip() == str(ROOT / "images" / ROW.name / "linux-arm64" / "Dockerfile")
    assert "emulated subset" in plan["tests"]
    assert f"pytorch-cuda:{ROW.name}-arm64" in plan["tags"].split()
    assert "--cpu-arch armv8.2-a" in proc.stdout and f"ARG BASE_IMAGE={render.base_ref(ARM)}" in proc.stdout



@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_ARM64") != "1",
                    reason="the emulated build and test subset of a CUDA 13 row (over an hour cold on 2 cores, docs/arm64.md): "
                           "on request, PYTORCH_CUDA_TEST_ARM64=1")
def test_the_arm64_image_builds_tests_and_tags_under_emulation_and_runs_aarch64_torch(docker_client, arm64_base):
    proc = run_build_py(ROOT, "--torch", "2.11", "--cuda", "13.0", "--platform", "linux/arm64", "--quiet", timeout=4 * 3600)
    assert proc.returncode == 0, shown(proc)
    own = docker_client.images.get(f"{ROW.repository}:{ROW.name}-arm64")
    assert own.attrs["Architecture"] == "arm64" and docker_client.images.get(ROW.refs()[-1]).id == own.id
    smoke = (ROOT / "build-results" / ROW.name / "linux-arm64" / "smoke-report.json").read_text()
    assert '"FAIL": 0' in smoke
    run = subprocess.run([docker_env.docker_cli(), "run", "--rm", "--platform", "linux/arm64", "-e", "PYTORCH_CUDA_NO_BANNER=1",
                          f"{ROW.repository}:v2.11", "python", "-c",
                          "import platform, torch; print(platform.machine(), torch.version.cuda)"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, shown(run)
    assert run.stdout.strip().splitlines()[-1] == "aarch64 13.0", shown(run)
