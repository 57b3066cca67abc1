"""`build.py selftest`: set up what this project's own test suite needs, then run it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ..engine import docker_env
from ..errors import EnvironmentProblem

SLOWEST = 25  # tests listed with their times at the end of each run


def run(root: Path, pytest_args: list[str]) -> int:
    """Docker Engine, mmdebstrap and a registry first (engine.sh), then pytest over tests/.

    pytest's exit code is returned as it is: 5 (no tests ran) is a failure, not a pass. Every run
    ends with its slowest tests (--durations): CI's budget is watched from the run's own output.
    """
    proc = subprocess.run(["bash", str(docker_env.ENGINE_SCRIPT), "--with-registry"])
    if proc.returncode != 0:
        raise EnvironmentProblem("could not set up Docker Engine for the test suite (see the engine: lines above)")
    extra = [a for a in pytest_args if a != "--"]
    # The caller's arguments last: their own --durations wins over this one.
    argv = [sys.executable, "-m", "pytest", str(root / "tests"), "-ra", f"--durations={SLOWEST}", *extra]
    return subprocess.run(argv, cwd=root).returncode
