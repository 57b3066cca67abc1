"""Stage 6: prove a candidate image works before any public tag points at it.

Two suites: the in-image smoke suite (`pytorch-cuda-smoke`: versions, collectives,
ZeRO-3, FSDP2; on the GPUs when the daemon has an NVIDIA runtime, else on 2 CPU ranks
with gloo) and the structure checks (this package's `checks/`, run by pytest with
pytest-testinfra's docker backend).
A suite passes only when at least one check passed and none failed: a run where
everything was skipped proves nothing.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import docker
import docker.errors
import requests

from ..engine import containers, docker_env
from ..errors import EnvironmentProblem, TestFailure
from ..matrix import Image

SMOKE_TIMEOUT_S = int(os.environ.get("PYTORCH_CUDA_SMOKE_TIMEOUT", "2400"))
# An image of another architecture runs under QEMU, about 12x slower (docs/arm64.md). Its gate is
# then this subset, unless PYTORCH_CUDA_EMULATED_TESTS=full asks for everything:
# versions against the manifest, the four prebuilt ops loading for `cuda` with nothing compiled,
# ZeRO-3 on 2 gloo ranks and torch.compile on the CPU; and the structure checks of the CPU
# baseline, the labels and the user.
EMULATED_SMOKE = "versions,zero3,compile,nocompile"
EMULATED_STRUCTURE = "cpu_baseline or labels or default_user"
STRUCTURE_TIMEOUT_S = 900
# The structure checks ship with this package and are found from its own location, so an
# installed tool runs the same checks as a checkout, whatever project it builds.
CHECKS = Path(__file__).resolve().parent.parent / "checks"
# Where this package lives (a checkout, or site-packages): the parent of pytorch_cuda_build/.
PACKAGE_HOME = Path(__file__).resolve().parents[2]
# The test code a pass record vouches for: the gate and its checks, read from this package
# wherever it is installed, and the smoke suite, read from the project. The smoke suite is
# baked into the image (its ID covers it) but is hashed too.
TEST_CODE = ("pytorch_cuda_build/stages/gate.py", "pytorch_cuda_build/checks", "pytorch_cuda_runtime/smoke")


def code_hash(root: Path, package_home: Path = PACKAGE_HOME) -> str:
    """sha256 over the test code's files, by path and content, in a stable order."""
    h = hashlib.sha256()
    for rel, f in sorted(_test_files(root, package_home)):
        data = f.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def _test_files(root: Path, package_home: Path = PACKAGE_HOME) -> Iterator[tuple[str, Path]]:
    """(path as named in TEST_CODE's terms, file) for every file of the test code."""
    for rel in TEST_CODE:
        base = package_home if rel.startswith("pytorch_cuda_build/") else root
        p = base / rel
        for f in p.rglob("*") if p.is_dir() else [p]:
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":  # caches are not code
                yield f.relative_to(base).as_posix(), f


def subset(image: Image) -> bool:
    """Whether the image's gate is the emulated subset (EMULATED_SMOKE, EMULATED_STRUCTURE)."""
    return docker_env.emulated(image.platform) and os.environ.get("PYTORCH_CUDA_EMULATED_TESTS") != "full"


def smoke(c: docker.DockerClient, image: Image, image_id: str, results: Path, require_gpu: bool, log: Callable[[str], None] = print) -> dict:
    """Run the smoke suite in a throwaway container; return its JSON report."""
    gpu = docker_env.gpu_request(c)
    if require_gpu and not gpu:
        raise EnvironmentProblem("--require-gpu: this Docker daemon has no NVIDIA runtime and no CDI nvidia.com/gpu device "
                                 "(install the NVIDIA Container Toolkit)")
    how = "CDI nvidia.com/gpu=all" if gpu is docker_env.GPUS_BY_CDI else "NVIDIA runtime"
    log("smoke suite: " + (f"on the GPUs ({how})" if gpu else "on the CPU, 2 gloo ranks (no NVIDIA GPU in this daemon)"))
    args = ["pytorch-cuda-smoke", "--report", "/results/report.json", "--timeout", "600"]
    if subset(image):
        log(f"smoke suite: {image.platform} is emulated here: the subset {EMULATED_SMOKE} "
            "(PYTORCH_CUDA_EMULATED_TESTS=full for the whole suite)")
        args += ["--only", EMULATED_SMOKE]
    if require_gpu:
        args.append("--require-gpu")
    gpu_opts = {"device_requests": [gpu], "ipc_mode": "host"} if gpu else {"shm_size": "2g"}
    log_path = results / "smoke.log"
    # A leftover the clean-up cannot remove must not hide why we are leaving.
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-smoke-", ignore_cleanup_errors=True) as out:
        os.chmod(out, 0o777)  # the image's default user is not root
        try:
            with throwaway_container(c, image_id, args, volumes={out: {"bind": "/results", "mode": "rw"}},
                                     environment={"PYTORCH_CUDA_NO_BANNER": "1"}, kind="smoke", log=log, **gpu_opts) as container:
                code = _wait(container, SMOKE_TIMEOUT_S)
                log_path.write_bytes(container.logs())
        except BaseException:
            with contextlib.suppress(Exception):
                hand_back(c, image_id, Path(out), log)
            raise
        hand_back(c, image_id, Path(out), log)
        report_file = Path(out) / "report.json"
        report = json.loads(report_file.read_text()) if report_file.exists() else {}
        if (Path(out) / "logs").is_dir():
            shutil.rmtree(results / "smoke-logs", ignore_errors=True)
            shutil.copytree(Path(out) / "logs", results / "smoke-logs")
    (results / "smoke-report.json").write_text(json.dumps(report, indent=2) + "\n")
    if code != 0:
        raise TestFailure("smoke suite", _failures(report, code), str(log_path))
    check_smoke_report(report, require_gpu, str(log_path))
    return report


# Every container a run makes carries its run's ID and its owner (engine/containers.py).
RUN_LABEL, RUN_ID = containers.RUN_LABEL, containers.RUN_ID


@contextlib.contextmanager
def throwaway_container(c: docker.DockerClient, image_id: str, command: list[str], kind: str, log: Callable[[str], None] = print, **opts: Any) -> Iterator[Any]:
    """A started container that is removed on every way out: create or start failed (a
    daemon without its bridge leaves a start-failed container behind, Created), timeout,
    interrupt, daemon error. It has a unique name, so even a create whose answer was
    lost is found and removed."""
    name = f"pytorch-cuda-{kind}-{uuid.uuid4().hex[:12]}"
    labels = containers.labels(kind)
    dns = docker_env.container_dns()
    if dns and "network_mode" not in opts:  # a container on the host's network has the host's resolver
        opts = {**opts, "dns": dns}
    try:
        container = c.containers.create(image_id, command, name=name, labels=labels, **opts)
        try:
            container.start()
        except docker.errors.APIError as e:
            if "could not find bridge" in str(e):
                raise EnvironmentProblem(
                    "the Docker daemon answers but cannot start a container: its bridge is gone "
                    f"({docker_env._short(e)}); restart dockerd (as root: bash {docker_env.ENGINE_SCRIPT})") from None
            raise
        yield container
    finally:
        _remove(c, name, log)


def _remove(c: docker.DockerClient, name: str, log: Callable[[str], None]) -> None:
    try:
        c.containers.get(name).remove(force=True)
    except docker.errors.NotFound:
        pass  # never created, or already gone
    except docker_env.TRANSPORT as e:
        # Never mask why we are leaving; say what is left behind and how it goes.
        log(f"warning: could not remove container {name} ({docker_env._short(e)}); the next run removes it "
            f"(or `docker rm -f {name}`)")


def check_smoke_report(report: dict, require_gpu: bool, log_path: str) -> None:
    """Exit 0 is not enough: the report must show a check that passed, and a GPU when one is required."""
    summary = report.get("summary") if isinstance(report, dict) else None
    summary = summary if isinstance(summary, dict) else {}
    passes = summary.get("PASS")
    if not isinstance(passes, int) or passes < 1:
        skipped = summary.get("SKIPPED", 0)
        raise TestFailure("smoke suite", f"0 checks passed ({skipped} skipped) although it exited 0", log_path)
    if require_gpu and not gpus_used(report):
        raise TestFailure("smoke suite", f"--require-gpu: the suite ran on no GPU (report gpus={report.get('gpus')!r})", log_path)


def gpus_used(report: dict) -> int:
    """How many GPUs the smoke report says ran it; 0 for a CPU run or a report without the field."""
    gpus = report.get("gpus") if isinstance(report, dict) else None
    return gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus > 0 else 0


def hand_back(c: docker.DockerClient, image_id: str, out: Path, log: Callable[[str], None] = print) -> None:
    """What a container wrote into out, given to the user running us. The smoke suite writes as
    the image's default user (uid 1000): a caller that is not root (a CI runner's user) could
    neither read all of it nor remove it. A root container chowns it; root needs nothing."""
    if os.geteuid() == 0 or all(p.lstat().st_uid == os.getuid() for p in out.rglob("*")):
        return
    owner = f"{os.getuid()}:{os.getgid()}"
    with throwaway_container(c, image_id, ["-R", owner, "/results"], kind="smoke", log=log, entrypoint="chown",
                             user="0", network_disabled=True, volumes={str(out): {"bind": "/results", "mode": "rw"}}) as ct:
        code = _wait(ct, 120)
    if code != 0:
        raise EnvironmentProblem(f"could not give the smoke suite's output in {out} to {owner} (chown exited {code})")


def _wait(container: Any, timeout: int) -> int:
    """The container's exit code, or 124 after killing it when it outlives the timeout. A daemon
    that stops answering is no timeout: its error (a reply cut short, a connection refused or
    reset, the kill's) goes on up, to become one line at the stage's boundary."""
    t0 = time.monotonic()
    try:
        return container.wait(timeout=timeout)["StatusCode"]
    except (requests.exceptions.ConnectionError, requests.exceptions.ReadTimeout):
        # docker-py reports a read timeout on a unix socket as a ConnectionError; one that comes
        # before the timeout is a connection lost.
        if time.monotonic() - t0 < timeout:
            raise
        try:
            container.kill()
        except docker.errors.APIError:
            pass  # it exited between the timeout and the kill; it is removed all the same
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


def structure_command(root: Path, image: Image, image_id: str, junit: Path, matrix_path: Path | None = None) -> list[str]:
    """pytest on the packaged checks (CHECKS) against one image of the project at root.

    The run is the checks' own, wherever the package sits (a checkout, site-packages):
    `-c devnull` keeps out any pytest.ini or pyproject.toml of a directory above it, and
    --confcutdir any conftest.py above it.
    """
    matrix_path = Path(matrix_path or root / "matrix.yaml").resolve()
    return [sys.executable, "-m", "pytest", str(CHECKS), "-q", "-p", "no:cacheprovider", "-c", os.devnull,
            f"--rootdir={CHECKS}", f"--confcutdir={CHECKS}", f"--junitxml={Path(junit).resolve()}",
            f"--image={image_id}", f"--image-name={image.name}", f"--platform={image.platform}", f"--matrix={matrix_path}",
            f"--root={Path(root).resolve()}", *(["-k", EMULATED_STRUCTURE] if subset(image) else [])]


def structure(root: Path, image: Image, image_id: str, results: Path, matrix_path: Path | None = None) -> None:
    """Run the packaged structure checks against the candidate with pytest-testinfra.

    matrix_path is the matrix the user gave (default: root/matrix.yaml); the image is
    checked against the committed files under root/images/.
    """
    log_path = results / "structure.log"
    junit = results / "structure.xml"
    junit.unlink(missing_ok=True)  # never count an earlier run's results
    cmd = structure_command(root, image, image_id, junit, matrix_path)
    with open(log_path, "w", buffering=1) as log:
        try:
            # cwd: beside this package, so `python -m pytest` imports this copy of it, not a project's.
            rc = subprocess.run(cmd, cwd=PACKAGE_HOME, stdout=log, stderr=subprocess.STDOUT, timeout=STRUCTURE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    gate_structure(rc, junit, log_path)


@dataclass
class Counts:
    """What one pytest run did, from its junit XML."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    first_skip: str = ""
    first_failure: str = ""


def junit_counts(path: Path) -> Counts:
    """Count the test cases of a pytest junit XML; errors count as failures."""
    counts = Counts()
    for case in ET.parse(path).getroot().iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            counts.failed += 1
            counts.first_failure = counts.first_failure or f"{case.get('name')}: {_first_line(bad.get('message'))}"
        elif skip is not None:
            counts.skipped += 1
            counts.first_skip = counts.first_skip or _first_line(skip.get("message"))
        else:
            counts.passed += 1
    return counts


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    line = lines[0] if lines else "no reason given"
    return line if len(line) <= 200 else line[:197] + "..."


def _last_line(path: Path) -> str:
    try:
        return (path.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
    except OSError:
        return "no output"


def gate_structure(rc: int, junit: Path, log_path: Path) -> None:
    """Pass only when pytest exited 0 (or 5, judged by the counts) with a test passed and none failed."""
    if rc == 124:
        raise TestFailure("structure tests", f"timed out after {STRUCTURE_TIMEOUT_S} s", str(log_path))
    try:
        counts = junit_counts(junit)
    except (OSError, ET.ParseError):
        raise TestFailure("structure tests", f"pytest exit {rc} and no junit report ({_last_line(log_path)})", str(log_path)) from None
    if counts.failed or rc not in (0, 5):
        detail = f"{counts.failed} failed, {counts.passed} passed"
        raise TestFailure("structure tests", f"{detail}: {counts.first_failure}" if counts.first_failure else f"{detail} (pytest exit {rc})", str(log_path))
    if counts.passed == 0:
        reason = f": {counts.first_skip}" if counts.skipped else ""
        raise TestFailure("structure tests", f"0 tests ran ({counts.skipped} skipped){reason}", str(log_path))


def run(c: docker.DockerClient, root: Path, image: Image, image_id: str, results: Path,
        require_gpu: bool = False, log: Callable[[str], None] = print, matrix_path: Path | None = None) -> dict:
    """Smoke suite, then structure checks; matrix_path defaults to root/matrix.yaml."""
    results.mkdir(parents=True, exist_ok=True)
    report = smoke(c, image, image_id, results, require_gpu, log)
    log(f"structure tests: {CHECKS} (pytest-testinfra)")
    structure(root, image, image_id, results, matrix_path)
    return report
