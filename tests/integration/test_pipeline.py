"""The whole pipeline on real parts: a real daemon, real BuildKit builds, real images.

The first test builds (torch 2.7, CUDA 12.1) exactly as the README says; the others
break a throwaway copy of the project and check that nothing public moves.
"""
from __future__ import annotations

import json
import uuid

import docker.errors
import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.stages import gate, lock, render
from pytorch_cuda_build.tooling import bench

from helpers import ROOT, insert_before_user, project_copy, run_build_py

pytestmark = [pytest.mark.docker, pytest.mark.slow]

MATRIX = matrix.load(ROOT / "matrix.yaml")
DEFAULT = MATRIX.select("2.7", "12.1")


def tag_ids(client) -> dict[str, str | None]:
    out = {}
    for ref in DEFAULT.refs():
        try:
            out[ref] = client.images.get(ref).id
        except docker.errors.ImageNotFound:
            out[ref] = None
    return out


def leftover_containers(client) -> list:
    """This test session's containers still on the daemon (never another run's)."""
    return client.containers.list(all=True, filters={"label": f"{gate.RUN_LABEL}={gate.RUN_ID}"})


@pytest.fixture(scope="module", autouse=True)
def remove_throwaway_images(docker_client):
    """Candidates of the broken copies and images they left dangling go; the build cache
    stays, bounded, so repeated CI runs on one machine do not fill its disk."""
    yield
    mounts = cache_mounts(docker_client)
    proc = run_build_py(ROOT, "prune", "--keep-storage", "20GB", timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert not docker_client.images.list(name="pytorch-cuda-candidate")
    # the wheelhouse, the toolkit .debs and the compiled ops outlive a prune: without them the
    # next build downloads gigabytes and runs nvcc again
    assert mounts and mounts <= cache_mounts(docker_client), (mounts, cache_mounts(docker_client))


def cache_mounts(client) -> set[str]:
    """The build cache's cache mounts, by where they mount ("cached mount /opscache")."""
    return {r["Description"].split(" from exec", 1)[0] for r in client.df().get("BuildCache") or []
            if r["Type"] == "exec.cachemount"}


@pytest.fixture(scope="module")
def built(default_build):
    """`python build.py --torch 2.7 --cuda 12.1`, the README's build command, for real: the
    session's one build of the default row (tests/conftest.py), with its own smoke and structure run."""
    return default_build


def test_build_tags_one_tested_image(built, docker_client):
    ids = tag_ids(docker_client)
    assert None not in ids.values() and len(set(ids.values())) == 1, ids
    summary = json.loads((built.results / "summary.json").read_text())
    assert summary["image_id"] == ids["pytorch-cuda:v2.7"]
    assert summary["tags"] == DEFAULT.refs()
    assert {"build", "test", "tag"} <= set(summary["seconds"])
    # the summary table: the row, its size, its tags
    row = next(ln for ln in built.stdout.splitlines() if ln.startswith(DEFAULT.name + " "))
    assert f"{summary['size_bytes'] / 1e9:.2f} GB" in row and "pytorch-cuda:v2.7" in row, built.stdout
    assert not leftover_containers(docker_client)


def test_smoke_report_proves_sharded_training_on_cpu(built):
    report = json.loads((built.results / "smoke-report.json").read_text())
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
    assert (built.results / "smoke-logs").is_dir()


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


# `build.py test` end to end, smoke and structure tests on an image: test_publish.py runs it on the
# image pulled back by digest, the very image ID built here. A second run here would repeat its 5 min.


@pytest.mark.fault
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


@pytest.mark.fault
def test_failing_build_step_is_named_with_the_log_tail(built, docker_client, tmp_path):
    root = project_copy(tmp_path / "p")
    insert_before_user(root, 'RUN echo "simulated failure: index refused the download" && false')
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


def test_a_row_on_the_same_lock_shares_the_torch_layer(built, docker_client, tmp_path):
    """(2.7, 12.6) installs the very wheels of (2.7, 12.1): only the small layers after them are its own.

    Both rows are built from one copy of the project with a step of this run's own just before
    the row-specific layers. Without it, a row whose every step is cached takes its whole chain
    from whichever earlier build made it, and a `--no-cache` build in between (bench, verify)
    leaves a second chain of the same steps: the two rows would then share nothing for a reason
    that is the cache's history, not the Dockerfiles. With it, BuildKit resolves the shared steps
    from the cache afresh, for both rows the same way.
    """
    twin = MATRIX.select("2.7", "12.6")
    assert twin.lock_key == DEFAULT.lock_key
    root = project_copy(tmp_path / "p")
    tpl = root / "templates" / "finish.j2"
    # finish.j2 opens with the row-specific settings: its first instruction, an ENV, is the first of them
    first_row_specific = next(line for line in tpl.read_text().splitlines() if line.startswith("ENV "))
    assert "NVIDIA_REQUIRE_CUDA" in tpl.read_text().split(first_row_specific, 1)[1].split("\nCOPY", 1)[0]
    tpl.write_text(tpl.read_text().replace(
        first_row_specific, f"RUN echo {uuid.uuid4().hex} > /dev/null\n{first_row_specific}", 1))
    render.write(root, MATRIX, [DEFAULT, twin], log=lambda m: None)
    candidates = []
    for row in (DEFAULT, twin):
        proc = run_build_py(root, "--torch", row.torch_minor, "--cuda", row.cuda, "--no-test", "--quiet", timeout=1800)
        assert proc.returncode == 0, proc.stderr[-4000:]
        candidates.append(f"pytorch-cuda-candidate:{row.name}")
    own = bench.unique_bytes(docker_client, candidates[1], candidates[0])
    size = bench.image_size(docker_client, candidates[1])
    assert own < 0.01 * size, f"{own / 1e6:.0f} MB of {size / 1e6:.0f} MB are the twin row's own"


@pytest.mark.gpu  # `-m gpu` selects it; the gpu_runtime fixture skips it without a GPU runtime
def test_gpu_smoke_on_a_gpu_host(built, gpu_runtime):
    """GPU only: NCCL collectives, bf16/fp16 matmul and cuDNN conv on every GPU."""
    proc = run_build_py(ROOT, "test", "--torch", "2.7", "--cuda", "12.1", "--require-gpu", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_sbom_lists_torch_and_every_nvidia_library(built):
    doc = json.loads((built.results / "sbom.cdx.json").read_text())
    assert doc["bomFormat"] == "CycloneDX"
    have = {c["purl"] for c in doc["components"]}
    pins = lock.read(ROOT, DEFAULT)["pins"]
    wanted = {n: v for n, v in pins.items() if n == "torch" or n.startswith("nvidia-")}
    assert len(wanted) > 10
    missing = [f"pkg:pypi/{n}@{v}" for n, v in wanted.items() if f"pkg:pypi/{n}@{v}" not in have]
    assert not missing, missing
    assert any(p.startswith("pkg:deb/debian/libc6@") for p in have)


def test_sbom_command_is_deterministic_and_matches_the_baked_one(built, tmp_path, docker_client):
    out = tmp_path / "sbom.json"
    proc = run_build_py(ROOT, "sbom", "pytorch-cuda:v2.7", "--output", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    ours = json.loads(out.read_text())
    baked = json.loads(docker_client.containers.run(
        "pytorch-cuda:v2.7", ["cat", render.SBOM_PATH], remove=True, environment={"PYTORCH_CUDA_NO_BANNER": "1"}))
    assert ours["components"] == baked["components"]
    assert docker_client.images.get("pytorch-cuda:v2.7").labels["io.pytorch-cuda.sbom"] == render.SBOM_PATH


def test_sbom_of_a_missing_image_is_one_clear_line(tmp_path):
    out = tmp_path / "sbom.json"
    proc = run_build_py(ROOT, "sbom", "pytorch-cuda:no-such-tag", "--output", str(out), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == "error: no image pytorch-cuda:no-such-tag on this daemon"
    assert not out.exists()


def test_prebuilt_ops_stay_within_the_cpu_baseline(built, docker_client, tmp_path):
    """DeepSpeed would compile for the build host (AVX-512 here); the ops must run on any x86-64-v3 CPU."""
    import io
    import shutil
    import subprocess
    import tarfile

    assert shutil.which("objdump"), "binutils missing: engine.sh installs it"
    container = docker_client.containers.create("pytorch-cuda:v2.7")
    try:
        stream, _ = container.get_archive("/opt/venv/lib/python3.11/site-packages/deepspeed/ops")
        tarfile.open(fileobj=io.BytesIO(b"".join(stream))).extractall(tmp_path)
    finally:
        container.remove()
    ops = sorted(tmp_path.rglob("*_op.cpython-*.so"))
    assert {p.name.split(".")[0] for p in ops} == {f"{op}_op" for op in DEFAULT.prebuilt_ops}
    # CPUAdam runs on GPU hosts' CPUs (ZeRO-Offload), which may lack AVX-512.
    (cpu_adam,) = [p for p in ops if p.name.startswith("cpu_adam_op")]
    asm = subprocess.run(["objdump", "-d", str(cpu_adam)], capture_output=True, text=True, check=True).stdout
    assert "ymm" in asm and "zmm" not in asm, "CPUAdam must be AVX2-vectorised and free of AVX-512"


@pytest.mark.fault
def test_interrupt_during_the_smoke_suite_cleans_up(built, docker_client, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    root = project_copy(tmp_path / "p")
    (root / "pytorch_cuda_runtime" / "NOTE.txt").write_text("a change, so the image must be tested anew\n")
    before = tag_ids(docker_client)
    proc = subprocess.Popen([sys.executable, str(root / "build.py"), "--torch", "2.7", "--cuda", "12.1", "--quiet"],
                            stderr=subprocess.PIPE, text=True, cwd=root)
    seen = []
    deadline = time.monotonic() + 900
    for line in proc.stderr:  # wait until the smoke container is running
        seen.append(line)
        if "smoke suite:" in line or time.monotonic() > deadline:
            break
    time.sleep(10)
    os.kill(proc.pid, signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, "".join(seen) + rest
    assert "error: interrupted; no tag was moved" in rest
    assert tag_ids(docker_client) == before
    assert not leftover_containers(docker_client)
