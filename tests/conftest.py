"""Test tiers, each with a registered marker:

  unit         pure logic, no daemon (tests/unit, tests/runtime)
  network      reads the real package index (uv resolution, `lock`, `matrix --propose`);
               in the default run (CI runs everything), frozen in time (below)
  docker       needs a Docker daemon; skipped without one, except in CI where that fails
  gpu          needs a Docker daemon with the NVIDIA runtime; skipped with the reason otherwise

The fast tier, seconds with no network, root or daemon: pytest tests/unit tests/runtime -m "not network and not docker"

Hermetic by construction, for the whole session and every build.py it starts:
  PYTORCH_CUDA_STATE          a fresh temporary directory: no test reads or writes the user's
                              ~/.cache/pytorch-cuda (pass records, locks held by their builds)
                              nor depends on an earlier run's records.
  PYTORCH_CUDA_EXCLUDE_NEWER  the package index frozen at a point in time (uv --exclude-newer),
                              so resolving ignores what the index has published since (but not
                              a file it gains dated before the freeze: seen once, certifi
                              2026.10.19.post1). A value already in the environment wins
                              (CI may freeze at another date); bump LOCKS_RESOLVED_AT when the
                              committed locks are re-resolved.
  PYTORCH_CUDA_RUN_ID         the label value of every container the session's runs make
                              (pytorch-cuda.run=<id>), so tests count only their own.

Root: a test that needs root on the host itself is marked `root` (engine26 tests are, by
implication: Docker 26 starts as root). As another user it is a missing precondition (a failure in
CI); where root is needed only for one command (a chown, a tmpfs mount), helpers.as_root runs it
through sudo, as a hosted runner allows. PYTORCH_CUDA_TEST_LEAVE_OUT names markers whose tests
are left out of the run (deselected, and counted at the end): the GitHub workflow's pr-build sets
it to `root`, because its runner's user is not root (docs/testing.md, "What runs where").

`build.py selftest` without arguments runs the integration tier as two pytest lanes at once
(tooling/selftest.py): the engine26 and second_lane tests in the second lane, the rest in the main
lane. What they share is made safe here: the main lane writes the record of its default build
(the second lane starts then, and takes that build as its own); the tests that kill that daemon
or delete the default image (`alone`) run last in the main lane and wait until the second lane,
which uses that daemon too, has ended (a lock it holds shared).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import types
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The index as the committed locks (images/*/lock.json) saw it: the newest upload among their
# pins (platformdirs 4.14.7). The commit's own time was later, and once the index served a
# release from between the two (filelock 4.2.12, uploaded 2026-11-18), a re-resolve at the
# commit time no longer gave the locks back. Resolving at this time does.
LOCKS_RESOLVED_AT = "2026-11-17T20:04:00Z"

# Set before any test module imports the product: paths.STATE_DIR and tag.TESTED are read at import.
STATE_DIR = Path(tempfile.mkdtemp(prefix="pytorch-cuda-test-state-"))
os.environ["PYTORCH_CUDA_STATE"] = str(STATE_DIR)
os.environ.setdefault("PYTORCH_CUDA_EXCLUDE_NEWER", LOCKS_RESOLVED_AT)
os.environ.setdefault("PYTORCH_CUDA_RUN_ID", f"test-{uuid.uuid4().hex}")


def pytest_unconfigure(config):
    shutil.rmtree(STATE_DIR, ignore_errors=True)


# The markers (network, docker, gpu, slow, fault, engine26, root, second_lane, alone, both_cores) are declared in pyproject.toml.
ROOT_MARKER = "root"
LEFT_OUT: dict[str, int] = {}  # marker: how many tests PYTORCH_CUDA_TEST_LEAVE_OUT left out for it
_RUNNING: list = [None]  # the test being set up or run: helpers.needs_root reads its markers


def left_out_by_name(config) -> list[str]:
    """The markers PYTORCH_CUDA_TEST_LEAVE_OUT names (commas or spaces); each must be registered."""
    from pytorch_cuda_build.tooling.selftest import LEAVE_OUT_ENV

    names = os.environ.get(LEAVE_OUT_ENV, "").replace(",", " ").split()
    registered = {line.split(":")[0].strip() for line in config.getini("markers")}
    if unknown := sorted(set(names) - registered):
        raise pytest.UsageError(f"{LEAVE_OUT_ENV} names {', '.join(unknown)}, which is no registered marker")
    return names


@pytest.hookimpl(tryfirst=True)  # before -m: the root marker engine26 implies is there to select
def pytest_collection_modifyitems(config, items):
    """Every engine26 test is in the root tier (LeaveOut, below, deselects the tiers left out by name).

    The tests that keep both cores busy alone (both_cores) after the rest, so that the second
    lane, from the end of the default build, runs beside tests that leave a core idle; then the
    tests that kill the daemon or delete the default image (alone), so that no other test meets
    the restarted daemon or the missing image, and the second lane has the longest time to end
    first (the pull back, after the kill, meets the restarted daemon as any later command would).
    A stable sort: the rest keep their order."""
    from pytorch_cuda_build.tooling.selftest import ENGINE26

    for item in items:
        if item.get_closest_marker(ENGINE26) and not item.get_closest_marker(ROOT_MARKER):
            item.add_marker(ROOT_MARKER)
    items.sort(key=lambda item: (item.get_closest_marker("alone") is not None,
                                 item.get_closest_marker("both_cores") is not None))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before its fixtures: a test marked root, run by another user, lacks a precondition."""
    from helpers import missing

    _RUNNING[0] = item
    if item.get_closest_marker(ROOT_MARKER) and os.geteuid() != 0:
        missing(f"{item.nodeid} needs root on this host (marker {ROOT_MARKER}); run it as root, or leave the tier "
                f"out by name: PYTORCH_CUDA_TEST_LEAVE_OUT={ROOT_MARKER}")


def running_item():
    """The test being set up or run (None outside a test)."""
    return _RUNNING[0]


class LeaveOut:
    """The tests of the markers PYTORCH_CUDA_TEST_LEAVE_OUT names, deselected after -m and -k have
    had their say: what is counted is what this run would otherwise have run."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if names := left_out_by_name(config):
            gone = [i for i in items if any(i.get_closest_marker(n) for n in names)]
            config.hook.pytest_deselected(items=gone)
            items[:] = [i for i in items if i not in gone]
            LEFT_OUT.update({n: sum(1 for i in gone if i.get_closest_marker(n)) for n in names})


def pytest_configure(config):
    config.pluginmanager.register(LeaveOut(), "pytorch-cuda-leave-out")


@contextlib.contextmanager
def lanes_lock(mode: int, lane: str | None = None):
    """The lanes' lock on the 20.10 daemon (tooling/selftest.py), held in `mode` meanwhile; nothing
    outside the whole suite's lanes, or in a lane other than `lane` where one is named."""
    from pytorch_cuda_build.tooling.selftest import DAEMON_LOCK_ENV, LANE_ENV

    path = os.environ.get(DAEMON_LOCK_ENV)
    if not path or (lane is not None and os.environ.get(LANE_ENV) != lane):
        yield
        return
    with open(path, "a") as lock:
        fcntl.flock(lock, mode)
        yield


@pytest.fixture(scope="session", autouse=True)
def daemon_shared():
    """In the second lane, the 20.10 daemon and the default image kept as they are for the whole
    lane: a shared hold on the lanes' lock, which the `alone` tests take alone (daemon_alone)."""
    from pytorch_cuda_build.tooling.selftest import SECOND

    with lanes_lock(fcntl.LOCK_SH, lane=SECOND):
        yield


@pytest.fixture
def daemon_alone():
    """The 20.10 daemon and the default image to this test alone: it waits until no other lane
    holds the lanes' lock."""
    with lanes_lock(fcntl.LOCK_EX):
        yield


def pytest_terminal_summary(terminalreporter):
    """How many fault-injection scenarios ran and passed (issue: faults, interruption, concurrency);
    how many tests each marker left out by name took out of the run."""
    from pytorch_cuda_build.tooling.selftest import LEAVE_OUT_ENV

    for name, n in LEFT_OUT.items():
        terminalreporter.write_line(f"left out by name ({LEAVE_OUT_ENV}): {n} tests marked {name}")
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
    from pytorch_cuda_build.checks import support  # imported late: STATE_DIR is set above first

    c, why = support.daemon()
    if c is None:
        if IN_CI:
            pytest.fail(f"CI needs a Docker daemon and none answers: {why}")
        pytest.skip(f"no Docker daemon: {why}")
    return c


@pytest.fixture(scope="session")
def default_rootfs(docker_client, tmp_path_factory) -> str:
    """The default row's base image (the small Debian rootfs): its ID, made with mmdebstrap as
    build.py makes it where this machine lacks it, so that a test on it never depends on a build
    that ran before it; the default build then finds it."""
    from pytorch_cuda_build import matrix
    from pytorch_cuda_build.engine import docker_env
    from pytorch_cuda_build.stages import base

    row = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    return base.ensure(docker_client, row, tmp_path_factory.mktemp("default-rootfs"), docker_cli=docker_env.build_client().argv[0])


@pytest.fixture(scope="session")
def default_build(docker_client, tmp_path_factory):
    """The README's build line for the default row, run once per session and shared by every
    module that needs its image. --retest: this session's own smoke and structure run, whatever
    an earlier session recorded; the modules after it reuse that tested image (build.py ends at
    once on a row it already tested) instead of each testing it again.

    The process (stdout, stderr), `results`: a copy of build-results/<row> taken right after
    this build, because every later build.py run of the row writes that folder again, and the
    tested image's ID. In the whole suite, the main lane writes all of it to the lanes' file
    (tooling/selftest.py), and the second lane takes it from there: one build and test a run."""
    from pytorch_cuda_build import matrix
    from pytorch_cuda_build.tooling.selftest import BUILT_ENV, LANE_ENV, MAIN

    from helpers import main_lane_build, run_build_py, shown

    record = main_lane_build()
    if record is not None:
        return types.SimpleNamespace(stdout=record["stdout"], stderr=record["stderr"], results=Path(record["results"]),
                                     image_id=record["image_id"])
    built = os.environ.get(BUILT_ENV) if os.environ.get(LANE_ENV) == MAIN else None
    row = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    try:
        proc = run_build_py(ROOT, "--torch", "2.7", "--cuda", "12.1", "--quiet", "--retest", timeout=5400)
        # Beside the lanes' file, which outlives this pytest: the second lane reads it after.
        results = (Path(built).parent / "default-build" if built else tmp_path_factory.mktemp("default-build")) / row.name
        if proc.returncode == 0:
            shutil.copytree(ROOT / "build-results" / row.name, results, symlinks=True)
        image_id = docker_client.images.get(row.refs()[0]).id if proc.returncode == 0 else None
        record = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                  "results": str(results), "image_id": image_id}
    finally:  # over, passed or not: the second lane may start (an empty file: the build never ended)
        if built:
            Path(f"{built}.tmp").write_text(json.dumps(record) if record else "")
            os.replace(f"{built}.tmp", built)
    assert proc.returncode == 0, shown(proc)
    return types.SimpleNamespace(stdout=proc.stdout, stderr=proc.stderr, results=results, image_id=image_id)


@pytest.fixture(scope="session")
def default_oci_layout(default_build):
    """The default row's image as an OCI layout (skopeo copy from the daemon, about 3 min), made
    once per session for the tests that move it to another runtime (Podman: on request).
    Under /var/tmp and readable by all: Podman's rootless user reads it, and pytest's own
    temporary root is private to root. Yields (layout, tag)."""
    from helpers import require, shown

    require(shutil.which("skopeo"), "skopeo missing: engine.sh --with-registry (build.py selftest) installs it")
    d = Path(tempfile.mkdtemp(prefix="pytorch-cuda-oci-", dir="/var/tmp"))
    try:
        proc = subprocess.run(["skopeo", "copy", "--quiet", "docker-daemon:pytorch-cuda:v2.7", f"oci:{d}/layout:v2.7"],
                              capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, shown(proc)
        for p in [d, *d.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IRGRP | stat.S_IROTH | (stat.S_IXGRP | stat.S_IXOTH if p.is_dir() else 0))
        yield d / "layout", "v2.7"
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def session_registry(tmp_path_factory):
    """A registry on 127.0.0.1 (Debian's docker-registry) for the whole session: the default row's
    one push goes here (default_published). Modules that stop or restart it start it again."""
    from registry import LocalRegistry, require_binary
    require_binary()
    reg = LocalRegistry(tmp_path_factory.mktemp("session-registry")).start()
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def default_published(default_build, docker_client, session_registry, tmp_path_factory):
    """The session's build of the default row, published and signed to session_registry's "ml"
    namespace through a registry stop (published.through_a_stop): the one push of the 6.5 GB
    image a session makes for the tests that read a published image."""
    from published import DEFAULT, through_a_stop

    image_id = docker_client.images.get(DEFAULT.refs()[0]).id
    return through_a_stop(session_registry, docker_client, image_id, tmp_path_factory.mktemp("signing"))


@pytest.fixture(scope="session")
def gpu_runtime(docker_client):
    from pytorch_cuda_build.engine import docker_env
    if docker_env.gpu_request(docker_client) is None:
        pytest.skip("no NVIDIA container runtime or CDI GPU device in this Docker daemon: GPU checks need a GPU host")
    return True


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A registry of the module's own on 127.0.0.1 (Debian's docker-registry), stopped after it."""
    from registry import LocalRegistry, require_binary
    require_binary()
    reg = LocalRegistry(tmp_path_factory.mktemp("registry")).start()
    yield reg
    reg.stop()
