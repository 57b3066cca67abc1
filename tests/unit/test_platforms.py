"""A row on its OS platforms: names, CPU baseline, files and the emulation check (pure: no daemon,
no network; the arm64 base and image are tests/integration/test_arm64.py's)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

import pytest

from pytorch_cuda_build import matrix, pipeline
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import EnvironmentProblem, NoSuchRow
from pytorch_cuda_build.errors import TestFailure as GateFailure
from pytorch_cuda_build.stages import build, lock, render, tag

from helpers import one_error_line, run_cli

ROOT = Path(__file__).resolve().parents[2]
M = matrix.load(ROOT / "matrix.yaml")
ROW = M.select("2.11", "13.0")
ARM = ROW.on("linux/arm64")
OLD = M.select("2.7", "12.1")
NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}


def test_a_row_on_arm64_has_its_own_baseline_and_local_names_and_amd64_keeps_its_own():
    assert (ARM.platform, ARM.arch, ARM.cpu_arch) == ("linux/arm64", "arm64", "armv8.2-a")
    assert ARM.local_name == f"{ROW.name}-arm64" and ARM.name == ROW.name
    amd = ARM.on("linux/amd64")
    assert amd == ROW and amd.local_name == ROW.name and amd.cpu_arch == "x86-64-v3"
    with pytest.raises(ValueError, match="not locked for linux/arm64"):
        OLD.on("linux/arm64")


def test_platform_choice_defaults_to_the_host_and_all_puts_the_host_first():
    with mock.patch.object(docker_env, "host_platform", return_value="linux/amd64"):
        assert [i.platform for i in pipeline.platforms(ROW, None)] == ["linux/amd64"]
        assert [i.platform for i in pipeline.platforms(ROW, "all")] == ["linux/amd64", "linux/arm64"]
    with mock.patch.object(docker_env, "host_platform", return_value="linux/arm64"):
        assert [i.platform for i in pipeline.platforms(ROW, "all")] == ["linux/arm64", "linux/amd64"]
        with pytest.raises(NoSuchRow, match=r"locked for linux/amd64 only, not linux/arm64 \(linux/arm64 needs torch's aarch64"):
            pipeline.platforms(OLD, None)  # an arm64 host asks for its own platform by default


def test_a_platform_the_row_lacks_is_one_line_before_anything_runs():
    proc = run_cli(ROOT, "--torch", "2.7", "--cuda", "12.1", "--platform", "linux/arm64", "--dry-run", env=NO_DOCKER)
    one_error_line(proc, 2, "2.7.1-cuda12.1-runtime is locked for linux/amd64 only, not linux/arm64")
    assert proc.stdout == ""


def _outside_python_env(text: str) -> list[str]:
    return (text[:text.index("FROM base AS python-env")] + text[text.index("# ---- ops-builder"):]).splitlines()


def test_the_arm64_dockerfile_differs_from_amd64_only_in_base_cpu_baseline_and_wheel_layers():
    """Outside python-env: the base and the CPU baseline. Inside it: each platform's own wheel
    files (the aarch64 ones), laid out by the same rule (test_layers.py checks it per platform)."""
    amd_text = (lock.image_dir(ROOT, ROW) / "Dockerfile").read_text()
    arm_text = (lock.build_dir(ROOT, ARM) / "Dockerfile").read_text()
    assert lock.build_dir(ROOT, ARM) == lock.image_dir(ROOT, ROW) / "linux-arm64"
    amd, arm = _outside_python_env(amd_text), _outside_python_env(arm_text)
    changed = [(a, b) for a, b in zip(amd, arm) if a != b]
    assert len(amd) == len(arm) and len(changed) == 4, changed
    assert render.base_ref(ARM) == render.base_ref(ROW) + "-arm64"
    for a, b in changed:
        assert a.replace(render.base_ref(ROW), render.base_ref(ARM)).replace("x86-64-v3", "armv8.2-a") == b
    meta = lock.read(ROOT, ROW)
    arm_files = {w["file"] for w in meta["platforms"]["linux/arm64"]["wheels"].values()}
    pinned = re.findall(r"^# \d+/\d+: (\S+\.whl), ", arm_text, re.M)
    assert pinned and set(pinned) <= arm_files and all("x86_64" not in f for f in pinned)
    assert render.render_image(ROOT, OLD).keys() == {"Dockerfile", "manifest.json"}  # an amd64-only row has no platform folder


def test_the_arm64_context_takes_the_platforms_own_locks_and_the_rows_deepspeed_lock(tmp_path, monkeypatch):
    from helpers import NamesOnlyStore
    monkeypatch.setattr(build.fetch, "store", lambda: NamesOnlyStore(tmp_path / "store"))
    build.stage_context(ROOT, ARM, tmp_path)
    arm_dir, row_dir = lock.build_dir(ROOT, ARM), lock.image_dir(ROOT, ROW)
    # its locked files are the arm64 ones: the apt step's .debs, and the wheels of its own layers
    debs = sorted(p.name for p in (tmp_path / "inputs" / "apt").iterdir())
    assert debs and all(d.endswith(("_arm64.deb", "_all.deb")) for d in debs), debs
    assert all("x86_64" not in p.name for p in (tmp_path / "inputs" / "wheels").iterdir())
    for name in ("requirements.lock", "toolkit.lock"):
        assert (tmp_path / name).read_bytes() == (arm_dir / name).read_bytes()
    for name in ("deepspeed.lock", "manifest.json"):
        assert (tmp_path / name).read_bytes() == (row_dir / name).read_bytes()
    assert "aarch64" in (arm_dir / "requirements.lock").read_text()


def test_only_another_architecture_gets_platform_in_the_build_command(tmp_path):
    bc = docker_env.BuildClient(argv=("docker", "build"), env={}, description="test")
    src = build.Source("abc", 0)
    with mock.patch.object(docker_env, "host_platform", return_value="linux/amd64"):
        arm = build.command(bc, ROOT, ARM, tmp_path, tmp_path / "iid", src, None, False)
        amd = build.command(bc, ROOT, ROW, tmp_path, tmp_path / "iid", src, None, False)
    assert arm[arm.index("--platform") + 1] == "linux/arm64" and "--platform" not in amd
    assert arm[arm.index("--file") + 1].endswith("linux-arm64/Dockerfile")
    assert arm[arm.index("--tag") + 1] == f"pytorch-cuda-candidate:{ROW.name}-arm64"


def test_an_arm64_build_also_names_its_platform_image():
    assert tag.refs(ARM) == ROW.refs() + [f"pytorch-cuda:{ROW.name}-arm64"]
    assert tag.refs(ROW) == ROW.refs()


def _binfmt(tmp_path: Path, text: str | None) -> Path:
    if text is not None:
        (tmp_path / "qemu-aarch64").write_text(text)
    return tmp_path


@pytest.mark.parametrize("text, ready", [
    ("enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: PF\noffset 0\n", True),
    ("enabled\ninterpreter /usr/bin/qemu-aarch64-static\nflags: OC\noffset 0\n", False),  # no F: containers would not find it
    ("disabled\ninterpreter /usr/bin/qemu-aarch64-static\nflags: F\noffset 0\n", False),
    (None, False),
])
def test_emulation_counts_only_an_enabled_handler_with_flag_f(tmp_path, text, ready):
    assert docker_env.emulation_ready("linux/arm64", _binfmt(tmp_path, text)) is ready


def test_without_root_and_qemu_the_build_stops_with_what_to_install(tmp_path):
    with mock.patch.object(docker_env, "host_platform", return_value="linux/amd64"), \
            mock.patch.object(docker_env, "BINFMT", _binfmt(tmp_path, None)), \
            mock.patch.object(os, "geteuid", return_value=1000), \
            mock.patch.object(docker_env, "_engine_setup", side_effect=AssertionError("no setup without root")):
        with pytest.raises(EnvironmentProblem, match="apt-get install qemu-user-static binfmt-support"):
            docker_env.ensure_emulation("linux/arm64")
        docker_env.ensure_emulation("linux/amd64")  # the host's own platform needs nothing


def test_all_platforms_move_no_tag_until_every_one_passed_and_the_host_moves_last(monkeypatch):
    built, promoted = [], []

    def build_row(root, image, opts, console, hold_tags=False):
        assert hold_tags  # each platform is proven first; none moves its tags itself
        built.append(image.platform)
        if image.platform == "linux/arm64" and fail_arm:
            raise GateFailure("smoke suite", "zero3 failed", "log")
        return pipeline.RowResult(image.local_name, ok=True, image_id=f"sha256:{image.arch}")

    monkeypatch.setattr(pipeline, "build_row", build_row)
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log: object())
    monkeypatch.setattr(pipeline._Row, "promote", lambda self, c, publish=True: promoted.append((self.image.platform, publish)))
    console = mock.Mock()
    with mock.patch.object(docker_env, "host_platform", return_value="linux/amd64"):
        images = pipeline.platforms(ROW, "all")
        fail_arm = True
        with pytest.raises(GateFailure):
            pipeline.build_platforms(ROOT, images, pipeline.Options(), console)
        assert built == ["linux/amd64", "linux/arm64"] and promoted == []  # amd64 passed, and still no tag moved
        fail_arm = False
        built.clear()
        results = pipeline.build_platforms(ROOT, images, pipeline.Options(), console)
    assert [r.image for r in results] == [ROW.name, f"{ROW.name}-arm64"]
    assert promoted == [("linux/arm64", False), ("linux/amd64", False)]  # the host's last: its tags win on a classic store


def test_each_platform_keeps_its_own_results_so_one_report_never_overwrites_the_other(tmp_path):
    from pytorch_cuda_build import paths
    from pytorch_cuda_build.stages import security
    assert pipeline.results_dir(tmp_path, ROW) == tmp_path / "build-results" / ROW.name
    assert pipeline.results_dir(tmp_path, ARM) == tmp_path / "build-results" / ROW.name / "linux-arm64"
    for image in (ROW, ARM):  # what the build's vulnerabilities step writes, offline (the lookup fails: no network)
        with mock.patch.object(security, "report_for_image", side_effect=security.AdvisoryLookupError("offline")), \
                mock.patch.object(security, "python_packages", return_value={"torch": "2.11.0"}):
            security.record(tmp_path, image, {}, None, lambda _: None)
        assert (paths.results_dir(tmp_path, image) / security.REPORT).exists()
