"""Assertion helpers for the checks: run a command in a throwaway container, with a
timeout, and show the command's output when an assertion fails."""
from __future__ import annotations

import subprocess


def run_image(image_ref: str, cmd: list[str], opts: tuple[str, ...] = (), timeout: int = 120) -> subprocess.CompletedProcess:
    """`docker run --rm` with a timeout; output captured for the assertion message."""
    return subprocess.run(["docker", "run", "--rm", *opts, image_ref, *cmd], capture_output=True, text=True, timeout=timeout)


def shown(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
