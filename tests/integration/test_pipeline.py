"""The whole pipeline on real parts: a real daemon, real BuildKit builds, real images.

The first test builds (torch 2.7, CUDA 12.1) exactly as the README says; the others
break a throwaway copy of the project and check that nothing public moves.
"""
from __future__ import annotations

import json

import pytest
from helpers import ROOT, project_copy, run_build_py

from pytorch_cuda_build import lock, matrix, render

pytestmark = [pytest.mark.docker, pytest.mark.slow]

MATRIX = matrix.load(ROOT / "matrix.yaml")
DEFAULT = MATRIX.select("2.7", "12.1")
RESULTS = ROOT / "build-results" / DEFAULT.name


def tag_ids(client) -> dict[str, str | None]:
    out = {}
    for ref in DEFAULT.refs():
        try:
            out[ref] = client.images.get(ref).id
        except Exception:
            out[ref] = None
    return out


def leftover_containers(client) -> list:
    return client.containers.list(all=True, filters={"label": "pytorch-cuda.test"})


@pytest.fixture(scope="module", autouse=True)
def remove_throwaway_images(docker_client):
    """Candidates of the broken copies, and images they left dangling; the cache stays."""
    yield
    for img in docker_client.images.list(name="pytorch-cuda-candidate"):
        for ref in img.tags:
            docker_client.images.remove(ref)
    docker_client.images.prune(filters={"dangling": True})


@pytest.fixture(scope="module")
def built(docker_client):
    """`python build.py --torch 2.7 --cuda 12.1`, the README's build command, for real."""
    proc = run_build_py(ROOT, "--torch", "2.7", "--cuda", "12.1", "--quiet", "--retest", timeout=3600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def test_build_tags_one_tested_image(built, docker_client):
    ids = tag_ids(docker_client)
    assert None not in ids.values() and len(set(ids.values())) == 1, ids
    summary = json.loads((RESULTS / "summary.json").read_text())
    assert summary["image_id"] == ids["pytorch-cuda:v2.7"]
    assert summary["tags"] == DEFAULT.refs()
    assert {"build", "test", "tag"} <= set(summary["seconds"])
    assert "pytorch-cuda:v2.7" in built.stdout and "size:" in built.stdout
    assert not leftover_containers(docker_client)


def test_smoke_report_proves_sharded_training_on_cpu(built):
    report = json.loads((RESULTS / "smoke-report.json").read_text())
    results = report["results"]
    failed = [r for r in results if r["status"] == "FAIL"]
    assert not failed, failed
    passed = {r["check"] for r in results if r["status"] == "PASS"}
    for family in ("versions.", "collectives.", "zero3.", "zero3_offload.", "zero3_launcher.", "fsdp2.", "nocompile."):
        assert any(c.startswith(family) for c in passed), (family, sorted(passed))
    for exact in ("zero3.consolidated.exact", "zero3_offload.consolidated.exact", "zero3_launcher.consolidated.exact",
                  "fsdp2.consolidated.exact", "zero3.loss_falls", "fsdp2.param_share", "nocompile.torch_extensions"):
        assert exact in passed, (exact, sorted(passed))
    skipped = [r for r in results if r["status"] == "SKIPPED"]
    assert skipped and all(r["detail"] for r in skipped), "GPU-only checks must be skipped with a reason"
    assert (RESULTS / "smoke-logs").is_dir()


def test_labels_show_platform_and_wheel_cuda(built, docker_client):
    labels = docker_client.images.get("pytorch-cuda:v2.7").labels
    assert labels["io.pytorch-cuda.cuda-platform"] == "12.1"
    assert labels["io.pytorch-cuda.torch-cuda"] == "12.6"
    assert labels["io.pytorch-cuda.lock-sha256"] == lock.read(ROOT, DEFAULT)["files_sha256"]


def test_torch_reports_the_pinned_stack(built, docker_client):
    out = docker_client.containers.run(
        "pytorch-cuda:v2.7", ["python", "-c", "import torch; print(torch.__version__, torch.version.cuda, "
                              "torch.backends.cudnn.version(), '.'.join(map(str, torch.cuda.nccl.version())))"],
        remove=True, environment={"PYTORCH_CUDA_NO_BANNER": "1"}).decode().split()
    assert out == ["2.7.1+cu126", "12.6", "90501", "2.26.2"]


def test_unchanged_rebuild_reuses_the_tested_image(built, docker_client):
    before = tag_ids(docker_client)
    proc = run_build_py(ROOT, "--torch", "2.7", "--cuda", "12.1", "--quiet", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "already passed its tests" in proc.stderr
    assert tag_ids(docker_client) == before


def test_test_command_on_the_built_image(built):
    proc = run_build_py(ROOT, "test", "--torch", "2.7", "--cuda", "12.1", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "passed the smoke and structure tests" in proc.stdout


def test_failing_smoke_suite_moves_no_tag(built, docker_client, tmp_path):
    root = project_copy(tmp_path / "p")
    smoke = root / "pytorch_cuda_runtime" / "bin" / "pytorch-cuda-smoke"
    smoke.write_text('#!/bin/sh\necho "versions: FAIL nccl expected 2.26.2, got 2.21.5 (rank 0)" >&2\nexit 1\n')
    before = tag_ids(docker_client)
    proc = run_build_py(root, "--torch", "2.7", "--cuda", "12.1", "--quiet", timeout=1800)
    assert proc.returncode == 1, proc.stderr[-4000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "smoke suite failed" in errors[0] and "no tag moved" in errors[0], proc.stderr
    assert "smoke.log" in errors[0]
    assert tag_ids(docker_client) == before
    assert not leftover_containers(docker_client)


def test_failing_build_step_is_named_with_the_log_tail(built, docker_client, tmp_path):
    root = project_copy(tmp_path / "p")
    tpl = root / "templates" / "runtime.j2"
    tpl.write_text(tpl.read_text().replace("USER trainer", 'RUN echo "simulated failure: index refused the download" && false\nUSER trainer'))
    render.write(root, MATRIX, list(MATRIX.images), log=lambda m: None)
    before = tag_ids(docker_client)
    proc = run_build_py(root, "--torch", "2.7", "--cuda", "12.1", "--quiet", timeout=1800)
    assert proc.returncode == 1, proc.stderr[-4000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "build failed at step [runtime" in errors[0] and "build.log" in errors[0], proc.stderr
    assert "simulated failure: index refused the download" in proc.stderr  # the tail is shown
    assert tag_ids(docker_client) == before


def test_no_test_build_sets_no_public_tag(built, docker_client, tmp_path):
    root = project_copy(tmp_path / "p")
    (root / "pytorch_cuda_runtime" / "NOTE.txt").write_text("a change only in the baked code\n")
    before = tag_ids(docker_client)
    proc = run_build_py(root, "--torch", "2.7", "--cuda", "12.1", "--no-test", "--quiet", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "no public tag set" in proc.stderr
    assert tag_ids(docker_client) == before
    candidate = docker_client.images.get("pytorch-cuda-candidate:2.7.1-cuda12.1-runtime")
    assert candidate.id != before["pytorch-cuda:v2.7"]


def test_gpu_smoke_on_a_gpu_host(built, gpu_runtime):
    """GPU only: NCCL collectives, bf16/fp16 matmul and cuDNN conv on every GPU."""
    proc = run_build_py(ROOT, "test", "--torch", "2.7", "--cuda", "12.1", "--require-gpu", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
