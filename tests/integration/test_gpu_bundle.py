"""gpu-bundle end to end: the default row's bundle, run in its devel image as if that were a
bare machine with a compiler and no network (`docker run --network none -v DIR:/bundle`).

The report must list every check, the CPU checks must pass, the GPU half must be reported as
not run with its reason, and the ops must have been built (for one arch) and loaded. The devel
image comes from build.py, like test_gpu_ready's: within one pytest run the second request finds
the first one's pass record and builds nothing.
"""
from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

from pytorch_cuda_build.stages import matrix

from helpers import ROOT, run_build_py, run_image, shown

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.network,
              # The bundle's run compiles the ops again (for one arch) and runs the CPU checks: about 6 min
              # on 2 cores beyond the devel build (test_gpu_ready's, also on request). The bundle's making
              # and its files are in the unit tier (tests/unit/test_gpubundle.py).
              pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_GPU_BUNDLE") != "1",
                                 reason="about 6 min on 2 cores: on request, PYTORCH_CUDA_TEST_GPU_BUNDLE=1")]

MATRIX = matrix.load(ROOT / "matrix.yaml")
DEVEL = MATRIX.select("2.7", "12.1", "devel")
DEVEL_REF = "pytorch-cuda:v2.7-devel"
# What the devel image lacks on purpose, as a bare machine may: libaio's headers (libaio-dev
# stays in the builder stage), so DeepSpeed itself declines to build async_io there.
NOT_BUILDABLE_IN_DEVEL = {"async_io"}


@pytest.fixture(scope="module")
def devel_image(docker_client) -> str:
    proc = run_build_py(ROOT, "--torch", DEVEL.torch, "--cuda", DEVEL.cuda, "--flavor", "devel", "--quiet", timeout=5400)
    assert proc.returncode == 0, shown(proc)  # in CI a missing image is a failure, never a skip
    return DEVEL_REF


@pytest.fixture(scope="module")
def checked(devel_image, tmp_path_factory) -> tuple[dict, str, object]:
    """The bundle made here, run there once; (report.json, report.md, the run's process)."""
    bundle = tmp_path_factory.mktemp("gpu-bundle") / "bundle"
    proc = run_build_py(ROOT, "gpu-bundle", "--torch", "2.7", "--cuda", "12.1", str(bundle), timeout=900)
    assert proc.returncode == 0, shown(proc)
    bundle.chmod(0o777)  # the image's user (uid 1000) writes report/ into it
    name = f"pytorch-cuda-gpu-bundle-{uuid.uuid4().hex[:12]}"
    try:
        run = run_image(devel_image, ["bash", "/bundle/run.sh"],
                        ("--name", name, "--network", "none", "--shm-size", "2g", "-e", "PYTORCH_CUDA_NO_BANNER=1",
                         "-v", f"{bundle}:/bundle", "--label", f"pytorch-cuda.run={os.environ['PYTORCH_CUDA_RUN_ID']}"),
                        timeout=3600)
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


def test_the_run_passes_and_reports_every_step(checked):
    report, md, run = checked
    checks = by_check(report)
    assert run.returncode == 0 and report["summary"]["FAIL"] == 0, shown(run)
    for step in ("bundle.files", "machine.python", "machine.torch", "machine.nvcc", "ops.arch", "install.dependencies",
                 "ops.build", "install.deepspeed", "gpu"):
        assert step in checks, (step, sorted(checks))
    assert {f"ops.prerequisites.{op}" for op in DEVEL.prebuilt_ops} <= set(checks)
    for fam in ("smoke.versions.torch", "smoke.versions.deepspeed", "smoke.collectives.all_reduce"):
        assert any(c.startswith(fam) for c in checks), (fam, sorted(checks))
    assert all(r["check"] in md for r in report["checks"])  # the Markdown lists the same checks


def test_the_cpu_checks_passed_and_the_gpu_half_is_reported_not_run(checked):
    report, md, _ = checked
    checks = by_check(report)
    ran = [r for r in report["checks"] if r["status"] in ("PASS", "FAIL")]
    assert ran and all(r["status"] == "PASS" for r in ran), [r for r in ran if r["status"] != "PASS"]
    assert any(r["run"].startswith("cpu") for r in ran if r["check"].startswith("smoke."))
    assert not [r for r in report["checks"] if (r["run"] or "").startswith("cuda")]  # nothing claims a GPU run
    assert [r["status"] for r in checks["gpu"]] == ["SKIPPED"] and "no CUDA device visible" in checks["gpu"][0]["detail"]
    assert [r["status"] for r in checks["smoke.gpu.basics"]] == ["SKIPPED"]
    assert report["facts"]["gpus"] == 0 and "none visible" in report["machine"]["GPU"] and "none visible" in md


def test_the_ops_were_built_for_one_arch_and_load(checked):
    report, _, _ = checked
    checks = by_check(report)
    buildable = [op for op in DEVEL.prebuilt_ops if op not in NOT_BUILDABLE_IN_DEVEL]
    arch = checks["ops.arch"][0]["actual"]
    assert arch == report["facts"]["ops_arch"] and ";" not in arch and "no GPU visible" in checks["ops.arch"][0]["detail"]
    assert checks["ops.build"][0]["status"] == "PASS" and all(op in checks["ops.build"][0]["expected"] for op in buildable)
    for op in NOT_BUILDABLE_IN_DEVEL:
        skipped = checks[f"ops.prerequisites.{op}"][0]
        assert skipped["status"] == "SKIPPED" and skipped["detail"].startswith("not built"), skipped
    for op in buildable:
        loaded = checks[f"smoke.nocompile.prebuilt_{op}"]
        assert [r["status"] for r in loaded] == ["PASS"], loaded
    assert [r["status"] for r in checks["smoke.nocompile.torch_extensions"]] == ["PASS"]  # loaded, nothing JIT-compiled
