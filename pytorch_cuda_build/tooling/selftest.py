"""`build.py selftest`: set up what this project's own test suite needs, then run it."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Callable

from ..engine import docker_env
from ..errors import EnvironmentProblem
from ..stages import build

SLOWEST = 25  # tests listed with their times at the end of each run
# The tiers that need no daemon, root or Docker (docs/testing.md): the whole suite runs them in a
# pytest of their own beside the integration tier.
UNIT_TIERS = ("unit", "runtime")
# The whole suite runs the integration tier as two lanes at once. The second lane holds the tests
# that start Docker 26 (`build.py engine`), marked ENGINE26, and those marked SECOND_LANE: tests
# that only read the default row's tested image, or need no image of it, and move no tag. It
# starts once the main lane's default build is over, and takes that build's record from the file
# the main lane writes (BUILT_ENV) instead of building and testing the row again.
ENGINE26, SECOND_LANE = "engine26", "second_lane"
MAIN, SECOND = "main", "second"  # the integration lanes' names in LANE_ENV
# What the lanes tell each other (tests/conftest.py reads them): which lane a pytest is, the file
# the main lane writes once the session's default build is over, and the lock that keeps the
# 20.10 daemon alive while the second lane uses it (the tests that kill the daemon or delete the
# default image take it alone).
LANE_ENV, BUILT_ENV, DAEMON_LOCK_ENV = "PYTORCH_CUDA_TEST_LANE", "PYTORCH_CUDA_TEST_BUILT", "PYTORCH_CUDA_TEST_DAEMON_LOCK"
# Markers whose tests a run leaves out by name, as tests/conftest.py reads it: the GitHub workflow's
# pr-build sets it to `root`, on a runner whose user is not root (docs/testing.md).
LEAVE_OUT_ENV = "PYTORCH_CUDA_TEST_LEAVE_OUT"
POLL_S = 2.0
# What the whole suite takes of the engine's disk at its most, over what it finds there: the layer
# records and context copies of its builds, its registries, Docker 26's store, its temporary
# folders (one filesystem on this project's CI machine). 25.9 GiB in a run with the caches warm
# (docs/measurements/ci-time.md, 2026-11-29), rounded up: the lanes' peaks move with their timing.
SUITE_TAKES_BYTES = 30 * 1024**3


def run(root: Path, pytest_args: list[str], repository: str) -> int:
    """Docker Engine, mmdebstrap and a registry first (engine.sh), then pytest over tests/.

    pytest's exit code is returned as it is: 5 (no tests ran) is a failure, not a pass. Every run
    ends with its slowest tests (--durations): CI's budget is watched from the run's own output.
    With arguments for pytest (after `--`), one pytest gets them, over tests/ unless they name
    files or tests of their own; without, the whole suite runs as three pytest processes side by
    side (whole_suite), in the room make_room leaves on the engine's disk.
    """
    proc = subprocess.run(["bash", str(docker_env.ENGINE_SCRIPT), "--with-registry"])
    if proc.returncode != 0:
        raise EnvironmentProblem("could not set up Docker Engine for the test suite (see the engine: lines above)")
    extra = [a for a in pytest_args if a != "--"]
    if extra:  # a -k or -m selection applies to the whole tree; named files or tests are the run
        paths = [] if names_paths(root, extra) else [root / "tests"]
        return subprocess.run(pytest_argv(paths, extra), cwd=root).returncode
    if not only_collects():
        make_room(repository)
    return whole_suite(root)


def only_collects() -> bool:
    """Whether pytest is told to collect only (PYTEST_ADDOPTS, as the workflow replay tells a nested
    suite): such a run builds nothing and needs no room."""
    return bool({"--collect-only", "--co"} & set(shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))))


def make_room(repository: str, log: Callable[[str], None] = print) -> None:
    """Room on the engine's disk for what the whole suite takes and, after that, for a build, which
    refuses to start with less (build.MIN_FREE_BYTES). Where there is less, the build cache gives
    it, least recently used first, as `build.py prune` bounds it (its cache mounts stay: the
    compiled ops); then a shortfall that remains is said in one line and the run goes on, its
    figure being one machine's: a build that meets it is refused in a line of its own."""
    c = docker_env.client()
    try:
        with docker_env.calls("the suite's disk check", "no test has run"):
            need = build.MIN_FREE_BYTES + SUITE_TAKES_BYTES
            root = docker_env.root_dir(c)
            free, probe = build.free_bytes(root)
            if free >= need:
                return
            cache = sum(r["Size"] for r in c.df().get("BuildCache") or [] if not r.get("Shared"))
            keep = max(0, cache - (need - free))
            log(f"selftest: {_gib(free)} GiB free under {probe}, the whole suite needs {_gib(need)} GiB: "
                f"bounding the build cache to {_gib(keep)} GiB, its cache mounts kept (build.py prune)")
            build.prune(docker_env.build_client(None), c, repository, str(keep))
        free, _ = build.free_bytes(root)
        if free < need:
            log(f"selftest: {_gib(free)} GiB free under {probe} with the build cache bounded, {_gib(need)} GiB needed: "
                "a build late in the run may be refused; free some space on that disk")
    finally:
        c.close()


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f}"


# pytest's options that take the next argument as their value: that value is never a path to test.
_TAKES_VALUE = frozenset({"-k", "-m", "-p", "-c", "-o", "-W", "-r", "--deselect", "--ignore", "--ignore-glob", "--rootdir",
                          "--basetemp", "--durations", "--maxfail", "--junitxml", "--confcutdir", "--override-ini"})


def names_paths(root: Path, extra: list[str]) -> bool:
    """Whether the caller's pytest arguments name files or tests (tests/x.py, tests/x.py::test_y):
    pytest runs what it is given, so tests/ beside them would run the whole tree as well."""
    previous = None
    for arg in extra:
        if not arg.startswith("-") and previous not in _TAKES_VALUE and (root / arg.split("::")[0]).exists():
            return True
        previous = arg
    return False


def pytest_argv(paths: list[Path], extra: list[str]) -> list[str]:
    # The caller's arguments last: their own --durations wins over this one.
    return [sys.executable, "-m", "pytest", *map(str, paths), "-ra", f"--durations={SLOWEST}", *extra]


def whole_suite(root: Path) -> int:
    """Three lanes, so that 2-core hosts keep both cores busy (docs/measurements/ci-time.md):

    - main: the integration tier but the second lane's tests; it streams its output. Its first
      test that needs the default row builds and tests it, which keeps both cores busy for most of
      its minutes; most of the rest runs on one core (waits on containers, registries, daemons).
    - unit: the unit tiers, beside the default build from the start (a few minutes).
    - second: the ENGINE26 and SECOND_LANE tests, started once the default build is over (or the
      main lane has ended), into the minutes the main lane leaves a core idle.

    The unit and second lanes' output comes after the main lane's, whole. The first failing exit
    code comes back, in that order: main, second, unit."""
    tests = root / "tests"
    # Every other folder of tests is the integration tier's: none is left out of the suite.
    rest = sorted(d for d in tests.iterdir() if d.is_dir() and d.name not in UNIT_TIERS and any(d.glob("test_*.py")))
    second_lane = f"{ENGINE26} or {SECOND_LANE}"
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-selftest-") as tmp:
        built, lock = Path(tmp) / "default-build-over", Path(tmp) / "daemon.lock"
        env = {**os.environ, DAEMON_LOCK_ENV: str(lock), BUILT_ENV: str(built)}
        with tempfile.TemporaryFile(mode="w+") as unit_out, tempfile.TemporaryFile(mode="w+") as second_out:
            unit = subprocess.Popen(pytest_argv([tests / t for t in UNIT_TIERS], []), cwd=root,
                                    stdout=unit_out, stderr=subprocess.STDOUT)
            main = subprocess.Popen(pytest_argv(rest, ["-m", f"not ({second_lane})"]), cwd=root, env={**env, LANE_ENV: MAIN})
            second = None
            try:
                while main.poll() is None and not built.exists():
                    time.sleep(POLL_S)
                second = subprocess.Popen(pytest_argv(rest, ["-m", second_lane]), cwd=root, env={**env, LANE_ENV: SECOND},
                                          stdout=second_out, stderr=subprocess.STDOUT)
            finally:
                codes = [main.wait(), second.wait() if second else 1, unit.wait()]
            show(f"the second lane ({second_lane}; {', '.join(str(d.relative_to(root)) for d in rest)}), run beside the main lane",
                 second_out)
            show(f"the unit tiers (tests/{', tests/'.join(UNIT_TIERS)}), run beside the integration tier", unit_out)
    return next((c for c in codes if c), 0)


def show(title: str, out: IO[str]) -> None:
    out.seek(0)
    print(f"\n==> {title}:", flush=True)
    sys.stdout.write(out.read())
    sys.stdout.flush()
