"""`build.py selftest`: set up what this project's own test suite needs, then run it."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from ..engine import docker_env
from ..errors import EnvironmentProblem

SLOWEST = 25  # tests listed with their times at the end of each run
# The tiers that need no daemon, root or Docker (docs/testing.md): the whole suite runs them in a
# pytest of their own beside the integration tier.
UNIT_TIERS = ("unit", "runtime")


def run(root: Path, pytest_args: list[str]) -> int:
    """Docker Engine, mmdebstrap and a registry first (engine.sh), then pytest over tests/.

    pytest's exit code is returned as it is: 5 (no tests ran) is a failure, not a pass. Every run
    ends with its slowest tests (--durations): CI's budget is watched from the run's own output.
    With arguments for pytest (after `--`), one pytest over tests/ gets them; without, the whole
    suite runs as two pytest processes side by side (both_tiers).
    """
    proc = subprocess.run(["bash", str(docker_env.ENGINE_SCRIPT), "--with-registry"])
    if proc.returncode != 0:
        raise EnvironmentProblem("could not set up Docker Engine for the test suite (see the engine: lines above)")
    extra = [a for a in pytest_args if a != "--"]
    if extra:  # the caller's selection applies to the whole tree, as they wrote it
        return subprocess.run(pytest_argv([root / "tests"], extra), cwd=root).returncode
    return both_tiers(root)


def pytest_argv(paths: list[Path], extra: list[str]) -> list[str]:
    # The caller's arguments last: their own --durations wins over this one.
    return [sys.executable, "-m", "pytest", *map(str, paths), "-ra", f"--durations={SLOWEST}", *extra]


def both_tiers(root: Path) -> int:
    """The integration tier and, beside it, the unit tiers. The integration tier spends much of
    its run on one core (single-threaded steps, waits on builds, registries and daemons: the
    other core of our 2-core hosts idle 40% of a warm run, docs/measurements/ci-time.md), so
    the unit tiers' minutes fit beside it. Its output streams; the unit tiers' comes after it,
    whole. The first failing exit code comes back (the integration tier's first)."""
    tests = root / "tests"
    # Every other folder of tests is the integration tier's: none is left out of the suite.
    rest = sorted(d for d in tests.iterdir() if d.is_dir() and d.name not in UNIT_TIERS and any(d.glob("test_*.py")))
    with tempfile.TemporaryFile(mode="w+") as out:
        unit = subprocess.Popen(pytest_argv([tests / t for t in UNIT_TIERS], []), cwd=root, stdout=out, stderr=subprocess.STDOUT)
        try:
            integration = subprocess.run(pytest_argv(rest, []), cwd=root).returncode
        finally:
            unit_code = unit.wait()
        out.seek(0)
        print(f"\n==> the unit tiers (tests/{', tests/'.join(UNIT_TIERS)}), run beside the integration tier:", flush=True)
        sys.stdout.write(out.read())
        sys.stdout.flush()
    return integration or unit_code
