"""Assertion helpers for the checks: run a command in a throwaway container, with a
timeout, and show the command's output when an assertion fails."""
from __future__ import annotations

import subprocess
from typing import Any

import docker
from docker.models.containers import Container

from pytorch_cuda_build.engine import containers


def run_image(image_ref: str, cmd: list[str], opts: tuple[str, ...] = (), timeout: int = 120) -> subprocess.CompletedProcess:
    """`docker run --rm` with a timeout; output captured for the assertion message."""
    return subprocess.run(["docker", "run", "--rm", *containers.label_args("structure"), *opts, image_ref, *cmd],
                          capture_output=True, text=True, timeout=timeout)


# testinfra ships no types (pyproject.toml: ignore_missing_imports): its Host is Any to mypy.
Host = Any
__all__ = ["Container", "Host"]  # what the checks' signatures name


def shown(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def daemon() -> tuple[docker.DockerClient | None, str]:
    """A Docker client whose daemon answers, or (None, why not): the checks skip without one
    (the gate then counts 0 run as a failure), the repository's tests fail in CI."""
    try:
        c = docker.from_env(timeout=900)
        c.ping()
    except docker.errors.DockerException as e:
        return None, str(e)
    return c, ""
