"""The gpu-bundle rehearsed here: the default row's bundle, run by its run.sh in the default image as if
that were a lent machine without a GPU and without network (`docker run --network none -v DIR:/bundle`).

The bundle carries the image's own ops wheel (its ops-dist stage, exported from the build cache the
default image left: every step cached), so the rehearsal installs a prebuilt wheel for this Python and
torch and compiles nothing. It must print its plan, verify the files, install the wheel beside the
image's torch, load the four ops under DeepSpeed's `cuda` accelerator with an empty
TORCH_EXTENSIONS_DIR, skip every step that needs a GPU with that reason, write the report after each
step, and, killed (SIGKILL) in the middle of a step, leave a report that names that step. The image is
the session's default one (shared, never built here). Measured in the image on 2026-11-28 (2 cores, load 10
from other builds): the wheel's export and the bundle 22 s, the rehearsal 73 s, the killed run 36 s.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from pytorch_cuda_build import ca, matrix
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.stages import build

from helpers import ROOT, run_build_py, run_image, shown

pytestmark = [pytest.mark.docker, pytest.mark.network]

DEFAULT = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")


@pytest.fixture(scope="module")
def ops_wheel(default_build, tmp_path_factory) -> Path:
    """The default image's own DeepSpeed wheel, with ops-facts.json beside it: its ops-dist stage,
    every step of which the image's build left in the cache."""
    dest = tmp_path_factory.mktemp("ops-dist")
    bc = docker_env.build_client()
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-context-") as tmp:
        context = Path(tmp) / "context"
        context.mkdir()
        build.stage_context(ROOT, DEFAULT, context)
        cmd = build.export_command(bc, ROOT, DEFAULT, context, dest, ca.ca_bundle(None))
        proc = subprocess.run(cmd, env=docker_env.build_env(bc), capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, shown(proc)
    [wheel] = dest.glob("deepspeed-*.whl")
    return wheel


@pytest.fixture(scope="module")
def bundle(ops_wheel, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpu-bundle") / "bundle"
    t0 = time.monotonic()
    # The image's wheel holds every arch of torch's; stripped of its debug info it fits the 64 MiB too.
    proc = run_build_py(ROOT, "gpu-bundle", "--torch", "2.7", "--cuda", "12.1", "--python", DEFAULT.python,
                        "--ops-wheel", str(ops_wheel), str(folder), timeout=900)
    assert proc.returncode == 0, shown(proc)
    print(f"gpu-bundle: {time.monotonic() - t0:.1f} s")
    folder.chmod(0o777)  # the image's user (uid 1000) writes report/ into it
    return folder


def rehearse(bundle: Path, report: str, name: str, detach: bool = False):
    opts = ("--name", name, "--network", "none", "--shm-size", "1g", "-e", "PYTORCH_CUDA_NO_BANNER=1", "-v", f"{bundle}:/bundle",
            "--label", f"pytorch-cuda.run={os.environ['PYTORCH_CUDA_RUN_ID']}")
    cmd = ["bash", "/bundle/run.sh", "--rehearse", "--report", f"/bundle/{report}"]
    if detach:
        return subprocess.Popen(["docker", "run", "--rm", *opts, DEFAULT.refs()[0], *cmd], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return run_image(DEFAULT.refs()[0], cmd, opts, timeout=900)


@pytest.fixture(scope="module")
def rehearsed(bundle) -> tuple[dict, str, subprocess.CompletedProcess]:
    name = f"pytorch-cuda-gpu-bundle-{uuid.uuid4().hex[:12]}"
    try:
        t0 = time.monotonic()
        run = rehearse(bundle, "report", name)
        print(f"rehearsal: {time.monotonic() - t0:.1f} s")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=120)
    report = bundle / "report" / "report.json"
    assert report.exists(), shown(run)
    return json.loads(report.read_text()), (bundle / "report" / "report.md").read_text(), run


def by_check(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in report["checks"]:
        out.setdefault(r["check"], []).append(r)
    return out


def test_the_rehearsal_prints_its_plan_first_and_passes(rehearsed):
    report, md, run = rehearsed
    assert run.returncode == 0 and report["summary"]["FAIL"] == 0, shown(run)
    first = run.stderr.index("gpucheck: plan for")
    assert first < run.stderr.index("gpucheck: bundle.files:") and "smoke.zero3_launcher" in run.stderr[first:]
    assert report["running"] is None and all(s["state"] in ("done", "skipped") for s in report["steps"]), report["steps"]
    assert all(r["check"] in md for r in report["checks"]) and "Every planned step ended." in md


def test_the_prebuilt_wheel_is_installed_and_its_ops_load_with_nothing_compiled(rehearsed, ops_wheel):
    report, _, _ = rehearsed
    checks = by_check(report)
    for step in ("bundle.files", "machine.python", "machine.torch", "install.dependencies", "install.deepspeed"):
        assert [r["status"] for r in checks[step]] == ["PASS"], checks[step]
    assert ops_wheel.name in checks["install.deepspeed"][0]["actual"]
    assert [r["status"] for r in checks["smoke.versions.deepspeed"]] == ["PASS"]
    for op in DEFAULT.prebuilt_ops:
        assert [r["status"] for r in checks[f"smoke.nocompile.prebuilt_{op}"]] == ["PASS"], op
    assert [r["status"] for r in checks["smoke.nocompile.torch_extensions"]] == ["PASS"]  # loaded, nothing JIT-compiled
    assert not [s for s in report["steps"] if s["step"].startswith("ops.build")]


def test_what_needs_a_gpu_is_skipped_with_that_reason_and_nothing_claims_a_gpu(rehearsed):
    report, _, _ = rehearsed
    states = {s["step"]: s["state"] for s in report["steps"]}
    for step in ("smoke.gpu", "preflight.health", "preflight.compute", "smoke.collectives", "smoke.zero3", "smoke.zero3_launcher", "smoke.fsdp2", "smoke.compile",
                 "smoke.measure", "smoke.nocompile"):
        assert states[step] == "skipped", step
        assert by_check(report)[step][0]["detail"] == "rehearsal: this step needs a GPU"
    assert not [r for r in report["checks"] if (r["run"] or "").startswith("cuda")]
    assert report["facts"]["mode"].startswith("rehearsal") and "none visible" in report["machine"]["GPU"]


def test_a_kill_in_the_middle_of_a_step_leaves_a_report_naming_it(bundle):
    """SIGKILL, which no handler sees: what is on disk is what was written before the step began."""
    name = f"pytorch-cuda-gpu-bundle-{uuid.uuid4().hex[:12]}"
    report = bundle / "killed" / "report.json"
    proc = rehearse(bundle, "killed", name, detach=True)
    try:
        deadline, running = time.monotonic() + 600, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                running = json.loads(report.read_text()).get("running")
            except (OSError, ValueError):  # not written yet
                running = None
            if running == "smoke.ops":
                break
            time.sleep(0.2)
        assert running == "smoke.ops", (running, proc.poll())
        subprocess.run(["docker", "kill", "--signal", "KILL", name], capture_output=True, timeout=120)
        proc.wait(timeout=120)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=120)
        if proc.poll() is None:
            proc.kill()
    left = json.loads(report.read_text())
    states = {s["step"]: s["state"] for s in left["steps"]}
    assert left["running"] == "smoke.ops" and states["smoke.ops"] == "running"
    assert all(states[s] == "done" for s in ("bundle.files", "install.deepspeed", "smoke.versions"))
    assert {r["check"] for r in left["checks"]} >= {"bundle.files", "install.deepspeed", "smoke.versions.torch"}
    assert "Running when this report was written: `smoke.ops`" in (bundle / "killed" / "report.md").read_text()
    shutil.rmtree(bundle / "killed", ignore_errors=True)
