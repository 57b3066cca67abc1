"""Test tiers, each with a registered marker:

  unit         pure logic, no daemon (tests/unit)
  docker       needs a Docker daemon; skipped without one, except in CI where that fails
  gpu          needs a Docker daemon with the NVIDIA runtime; skipped with the reason otherwise
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_configure(config):
    config.addinivalue_line("markers", "docker: needs a Docker daemon (a failure in CI when absent)")
    config.addinivalue_line("markers", "gpu: needs the NVIDIA container runtime and a GPU")
    config.addinivalue_line("markers", "slow: builds an image")
    config.addinivalue_line("markers", "fault: a fault-injection scenario (counted at the end of the run)")


def pytest_terminal_summary(terminalreporter):
    """How many fault-injection scenarios ran and passed (issue: faults, interruption, concurrency)."""
    counts: dict[str, int] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for rep in terminalreporter.stats.get(outcome, []):
            if "fault" in getattr(rep, "keywords", {}) and (rep.when == "call" or outcome != "passed"):
                counts[outcome] = counts.get(outcome, 0) + 1
    if counts:
        ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0)
        terminalreporter.write_line(
            f"fault-injection scenarios: {ran} ran, {counts.get('passed', 0)} passed, "
            f"{counts.get('failed', 0) + counts.get('error', 0)} failed, {counts.get('skipped', 0)} skipped")


@pytest.fixture(scope="session")
def docker_client():
    import docker

    try:
        c = docker.from_env(timeout=900)
        c.ping()
    except docker.errors.DockerException as e:
        if IN_CI:
            pytest.fail(f"CI needs a Docker daemon and none answers: {e}")
        pytest.skip(f"no Docker daemon: {e}")
    return c


@pytest.fixture(scope="session")
def gpu_runtime(docker_client):
    if "nvidia" not in (docker_client.info().get("Runtimes") or {}):
        pytest.skip("no NVIDIA container runtime in this Docker daemon: GPU checks need a GPU host")
    return True
