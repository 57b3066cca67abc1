"""Stage 6: prove a candidate image works before any public tag points at it.

Two suites: the in-image smoke suite (`pytorch-cuda-smoke`: versions, collectives,
ZeRO-3, FSDP2; on the GPUs when the daemon has an NVIDIA runtime, else on 2 CPU ranks
with gloo) and the structure tests (tests/structure, pytest-testinfra's docker backend).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import docker
import docker.errors
import requests

from . import docker_env
from .errors import EnvironmentProblem, TestFailure
from .matrix import Image

SMOKE_TIMEOUT_S = int(os.environ.get("PYTORCH_CUDA_SMOKE_TIMEOUT", "1500"))
STRUCTURE_TIMEOUT_S = 900


def smoke(c: docker.DockerClient, image: Image, image_id: str, results: Path, require_gpu: bool, log=print) -> dict:
    """Run the smoke suite in a throwaway container; return its JSON report."""
    gpu = docker_env.nvidia_runtime(c)
    if require_gpu and not gpu:
        raise EnvironmentProblem("--require-gpu: this Docker daemon has no NVIDIA runtime (install the NVIDIA Container Toolkit)")
    log("smoke suite: " + ("on the GPUs (NVIDIA runtime found)" if gpu else "on the CPU, 2 gloo ranks (no NVIDIA runtime in this daemon)"))
    args = ["pytorch-cuda-smoke", "--report", "/results/report.json", "--timeout", "600"]
    if require_gpu:
        args.append("--require-gpu")
    gpu_opts = {"device_requests": [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])], "ipc_mode": "host"} if gpu else {"shm_size": "2g"}
    log_path = results / "smoke.log"
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-smoke-") as out:
        os.chmod(out, 0o777)  # the image's default user is not root
        container = c.containers.run(
            image_id, args, detach=True, volumes={out: {"bind": "/results", "mode": "rw"}},
            environment={"PYTORCH_CUDA_NO_BANNER": "1"}, labels={"pytorch-cuda.test": "smoke"}, **gpu_opts,
        )
        try:
            code = _wait(container, SMOKE_TIMEOUT_S)
            log_path.write_bytes(container.logs())
            report_file = Path(out) / "report.json"
            report = json.loads(report_file.read_text()) if report_file.exists() else {}
            if (Path(out) / "logs").is_dir():
                shutil.rmtree(results / "smoke-logs", ignore_errors=True)
                shutil.copytree(Path(out) / "logs", results / "smoke-logs")
        finally:
            container.remove(force=True)
    (results / "smoke-report.json").write_text(json.dumps(report, indent=2) + "\n")
    if code != 0:
        raise TestFailure("smoke suite", _failures(report, code), str(log_path))
    return report


def _wait(container, timeout: int) -> int:
    try:
        return container.wait(timeout=timeout)["StatusCode"]
    except (requests.exceptions.ConnectionError, requests.exceptions.ReadTimeout):
        container.kill()
        return 124


def _failures(report: dict, code: int) -> str:
    if code == 124:
        return f"timed out after {SMOKE_TIMEOUT_S} s"
    bad = [r for r in report.get("results", []) if r.get("status") == "FAIL"]
    if not bad:
        return f"exit code {code}"
    return "; ".join(_describe(r)[:200] for r in bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")


def _describe(r: dict) -> str:
    rank = f" rank {r['rank']}" if r.get("rank") is not None else ""
    return f"{r.get('check')}{rank}: expected {r.get('expected')!r}, got {r.get('actual')!r} {r.get('detail') or ''}".strip()


def structure(root: Path, image: Image, image_id: str, results: Path) -> None:
    """Run tests/structure against the candidate with pytest-testinfra."""
    log_path = results / "structure.log"
    cmd = [sys.executable, "-m", "pytest", str(root / "tests" / "structure"), "-q", "-p", "no:cacheprovider",
           f"--image={image_id}", f"--image-name={image.name}", f"--matrix={root / 'matrix.yaml'}"]
    with open(log_path, "w", buffering=1) as log:
        try:
            rc = subprocess.run(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, timeout=STRUCTURE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if rc != 0:
        summary = (log_path.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise TestFailure("structure tests", summary, str(log_path))


def run(c: docker.DockerClient, root: Path, image: Image, image_id: str, results: Path,
        require_gpu: bool = False, log=print) -> dict:
    results.mkdir(parents=True, exist_ok=True)
    report = smoke(c, image, image_id, results, require_gpu, log)
    log("structure tests: tests/structure (pytest-testinfra)")
    structure(root, image, image_id, results)
    return report
