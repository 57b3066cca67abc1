"""Fault injection on real builds: interrupts, a dying daemon, a failing index, concurrency.

Every scenario runs in a throwaway copy of the project whose matrix names another
repository (pytorch-cuda-fault), so whatever goes wrong cannot touch the public
pytorch-cuda tags; the tests also check that those tags did not move. The copy reuses
this machine's base image and layer cache, so each build only redoes what a scenario
changes. Run just these with `python3 build.py selftest -m fault`; the run ends with a
count of the scenarios that ran and passed (marker `fault`, see conftest.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import IN_CI

from pytorch_cuda_build import matrix, progress
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.stages import fetch, render, tag
from pytorch_cuda_build.tooling import engine_current

from helpers import ROOT, fill, insert_before_user, missing, needs_root, project_copy, run_build_py, shown, tmpfs, tree_snapshot

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.fault]

MATRIX = matrix.load(ROOT / "matrix.yaml")
DEFAULT = MATRIX.select("2.7", "12.1")
FAULT_REPO = "pytorch-cuda-fault"


def public_tags(client) -> dict[str, str | None]:
    return {**tag.current(client, DEFAULT), **tag.current(client, MATRIX.select("2.7", "12.6"))}


def fault_tags(client) -> list[str]:
    return sorted(t for img in client.images.list() for t in img.tags if t.startswith(FAULT_REPO + ":"))


@pytest.fixture(scope="module")
def built(docker_client, default_build):
    """The default row built and tested (the session's build): its layers are the cache every scenario
    reuses. The fault images go before and after: a session killed mid-scenario leaves its tags, which
    name images that passed in that session's state directory, never in this one's."""
    remove_fault_images(docker_client)
    yield
    remove_fault_images(docker_client)


def remove_fault_images(client) -> None:
    for img in client.images.list():
        for t in img.tags:
            if t.startswith(FAULT_REPO):
                # force: a scenario that failed may have left a container of it, which it reports itself
                client.images.remove(t, noprune=False, force=True)


def fault_copy(tmp: Path, client, runtime_steps: str = "", commit: bool = False) -> Path:
    """A project copy publishing as pytorch-cuda-fault, with extra RUN steps near the end.
    commit: the copy made a git checkout of one commit (at this checkout's commit time), as
    publish needs: it refuses an image without a commit time, which a copy outside git builds."""
    root = project_copy(tmp)
    mp = root / "matrix.yaml"
    mp.write_text(mp.read_text().replace("repository: pytorch-cuda\n", f"repository: {FAULT_REPO}\n", 1))
    if runtime_steps:
        insert_before_user(root, runtime_steps)
    m = matrix.load(mp)
    render.write(root, m, list(m.images), log=lambda s: None)
    # Same base image under the copy's name, so the layer cache carries over.
    ours, theirs = render.base_ref(DEFAULT), render.base_ref(m.select("2.7", "12.1"))
    client.images.get(ours).tag(*theirs.rsplit(":", 1))
    if commit:
        when = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True, check=True).stdout.strip()
        git = ["git", "-C", str(root), "-c", "user.name=fault", "-c", "user.email=fault@localhost"]
        env = {**os.environ, "GIT_AUTHOR_DATE": f"@{when}", "GIT_COMMITTER_DATE": f"@{when}"}
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "fault copy"]):
            subprocess.run([*git, *args], env=env, check=True, capture_output=True)
    return root


def start(root: Path, *args: str) -> subprocess.Popen:
    """build.py in its own process group, as a terminal runs it (Ctrl-C reaches the group)."""
    return subprocess.Popen([sys.executable, str(root / "build.py"), *args], cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for(path: Path, needle: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            pytest.fail(f"build.py ended (exit {proc.returncode}) before {needle!r} showed up: {proc.stderr.read()[-3000:]}")
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"{needle!r} did not show up in {path} within {timeout:.0f}s")


def our_daemon() -> tuple[Path, list[str]] | None:
    """The pid file of the daemon the tests talk to, and the command that starts it again;
    None for a daemon neither engine.sh nor `build.py engine` started."""
    host = os.environ.get("DOCKER_HOST")
    if not host:
        return Path("/var/run/docker.pid"), ["bash", str(docker_env.ENGINE_SCRIPT)]
    for name, store in engine_current.STORES.items():
        if store.docker_host == host:
            return store.run / "dockerd.pid", [sys.executable, str(ROOT / "build.py"), "engine", "--store", name]
    return None


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error: ")]


def test_sigint_during_a_build_step_then_the_rerun_reuses_the_cache(built, docker_client, tmp_path):
    token = uuid.uuid4().hex  # new layers every run: nothing may come from an earlier run's cache
    root = fault_copy(tmp_path / "p", docker_client,
                      f'RUN echo "fault: layer before the interrupt {token}" > /opt/pytorch-cuda/fault-before\n'
                      f'RUN sleep 120 # {token}')
    committed = tree_snapshot(root / "images")
    before = public_tags(docker_client)
    proc = start(root, "--torch", "2.7", "--cuda", "12.1", "--quiet", "--no-test")
    log = root / "build-results" / DEFAULT.name / "build.log"
    wait_for(log, f"RUN sleep 120 # {token}", proc)
    time.sleep(3)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"{out}\n{err}"
    assert time.monotonic() - t0 < 60, "did not stop promptly"
    assert error_lines(err) == ["error: interrupted; no tag was moved and the candidate's containers were removed"], err
    assert fault_tags(docker_client) == [] and public_tags(docker_client) == before
    assert tree_snapshot(root / "images") == committed
    # Again, without the sleep: the layer finished before the interrupt comes from the cache.
    tpl = root / "templates" / "finish.j2"
    tpl.write_text(tpl.read_text().replace(f"RUN sleep 120 # {token}\n", ""))
    m = matrix.load(root / "matrix.yaml")
    render.write(root, m, list(m.images), log=lambda s: None)
    again = run_build_py(root, "--torch", "2.7", "--cuda", "12.1", "--quiet", "--no-test", timeout=1800)
    assert again.returncode == 0, shown(again)
    # Read through progress.replay: 20.10 logs plain progress, buildx on a current engine rawjson.
    echo = [r for r in progress.replay(log.read_text())
            if r.step.stage == "runtime" and f"fault: layer before the interrupt {token}" in r.step.name]
    assert len(echo) == 1 and echo[0].cached, progress.readable(log.read_text())[-3000:]


@pytest.mark.alone
@pytest.mark.root  # kills root's dockerd, and restarts it
def test_daemon_killed_mid_build_is_named_and_moves_no_tag(built, docker_client, daemon_alone, tmp_path):
    token = uuid.uuid4().hex
    root = fault_copy(tmp_path / "p", docker_client, f"RUN sleep 120 # {token}")
    before = public_tags(docker_client)
    proc = start(root, "--torch", "2.7", "--cuda", "12.1", "--quiet", "--no-test")
    wait_for(root / "build-results" / DEFAULT.name / "build.log", f"RUN sleep 120 # {token}", proc)
    ours = our_daemon()
    if ours is None or not ours[0].exists():
        missing("the daemon is not one that engine.sh or `build.py engine` starts: not ours to kill")
    pidfile, restart = ours
    needs_root("killing dockerd")
    if not (IN_CI or os.environ.get("PYTORCH_CUDA_FAULT_KILL_DAEMON") == "1"):
        pytest.skip("kills this machine's dockerd: runs in CI, or set PYTORCH_CUDA_FAULT_KILL_DAEMON=1")
    pid = int(pidfile.read_text())
    os.kill(pid, signal.SIGKILL)  # the daemon dies, it is not asked to stop
    try:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, f"{out}\n{err}"
        lines = error_lines(err)
        assert len(lines) == 1 and f"the Docker daemon at {docker_env.daemon_address()} stopped answering during the build" in lines[0], err
        assert "Traceback" not in err
    finally:
        up = subprocess.run(restart, capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
    assert public_tags(docker_client) == before and fault_tags(docker_client) == []


def test_an_index_the_fetch_cannot_verify_is_one_line_naming_the_host_and_nothing_is_built(built, docker_client, tmp_path):
    """A real index failure. No build step reaches an index any more (the build reads the store,
    with no network), so it lands in the fetch: into an empty store of the test's own, with a CA
    bundle that holds only a certificate made here, so no source's certificate verifies, behind a
    TLS proxy or not. The first download refused ends the run: one line naming the host and
    --ca-bundle, nothing built, no tag moved, and only whole files in the store."""
    bundle = tmp_path / "another-ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=another-ca",
                    "-keyout", str(tmp_path / "another-ca.key"), "-out", str(bundle)], check=True, capture_output=True)
    store = tmp_path / "store"
    before = public_tags(docker_client)
    images = {i.id for i in docker_client.images.list(all=True)}
    proc = run_build_py(ROOT, "--torch", "2.7", "--cuda", "12.1", "--quiet", "--ca-bundle", str(bundle),
                        env={"PYTORCH_CUDA_STORE": str(store)}, timeout=600)
    assert proc.returncode == 1, shown(proc)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert " is not in the store, and " in lines[0] and "certificate could not be verified" in lines[0], lines
    assert "--ca-bundle" in lines[0], lines
    assert public_tags(docker_client) == before and fault_tags(docker_client) == []
    assert {i.id for i in docker_client.images.list(all=True)} == images  # nothing built
    for blob in store.glob("sha256/*"):  # a file enters the store only whole, with the lock's hash
        assert fetch.file_sha256(blob) == blob.name, blob


def test_same_row_twice_at_once_is_serialized_and_the_second_reuses_the_first(built, docker_client, tmp_path):
    """Two builds of one row from one checkout: the second waits on the first's results lock, then
    reuses every layer the first built. --no-test: the gate is not what this is about, and a new
    image's smoke suite costs minutes (that a tested image is not tested again: test_pipeline)."""
    # A new step on every run, so the first really builds it (an earlier run's cache would hold
    # the layer a fixed step gives, and both builds would be all cache hits); it lasts long enough
    # that the second starts while the first holds the locks.
    step = f"RUN sleep 15 # {uuid.uuid4().hex}"
    root = fault_copy(tmp_path / "p", docker_client, step)
    args = ("--torch", "2.7", "--cuda", "12.1", "--quiet", "--no-test")
    first = start(root, *args)
    time.sleep(2)
    second = start(root, *args)
    outs = [p.communicate(timeout=1800) for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs
    # one checkout, one daemon: the second waits on the first (the results lock is taken first)
    waited = [i for i, (_, err) in enumerate(outs)
              if "another build of 2.7.1-cuda12.1-runtime from this checkout is running" in err and "waiting for it" in err]
    assert len(waited) == 1, outs
    built_ids = {ln.split("(")[-1].split(")")[0] for _, err in outs for ln in err.splitlines() if "built candidate" in ln}
    assert len(built_ids) == 1, outs  # one image
    # The first ran the new step (its log is build.previous.log); the waiter, which built last,
    # ran no layer step at all: every one a cache hit, the new one included.
    results = root / "build-results" / DEFAULT.name

    def ran(log: str) -> list[str]:
        return [s["cmd"] for s in progress.steps((results / log).read_text()) if not s["cached"] and s["cmd"].startswith(("RUN", "COPY"))]
    assert step in ran("build.previous.log")
    assert ran("build.log") == []


def test_different_rows_at_once_build_in_parallel(built, docker_client, tmp_path):
    root = fault_copy(tmp_path / "p", docker_client)
    procs = [start(root, "--torch", "2.7", "--cuda", cuda, "--quiet", "--no-test") for cuda in ("12.1", "12.6")]
    outs = [p.communicate(timeout=1800) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert not any("waiting" in err for _, err in outs), outs
    ids = {cuda: docker_client.images.get(f"{FAULT_REPO}-candidate:2.7.1-cuda{cuda}-runtime") for cuda in ("12.1", "12.6")}
    assert ids["12.1"].id != ids["12.6"].id
    assert ids["12.6"].labels["io.pytorch-cuda.cuda-platform"] == "12.6"
    assert ids["12.1"].labels["io.pytorch-cuda.cuda-platform"] == "12.1"


def test_concurrent_renders_never_interleave(tmp_path):
    root = project_copy(tmp_path / "p")
    tpl = root / "templates" / "header.j2"
    tpl.write_text(tpl.read_text() + "\n# a template change every image's Dockerfile picks up\n")
    procs = [subprocess.Popen([sys.executable, str(root / "build.py"), "render"], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    assert [p.wait(timeout=300) for p in procs] == [0] * 4, [p.stderr.read() for p in procs]
    check = run_build_py(root, "render", "--check")
    assert check.returncode == 0, shown(check)
    for d in (root / "images").iterdir():
        assert "a template change every image's Dockerfile picks up" in (d / "Dockerfile").read_text()
    assert not list((root / "images").rglob("*.tmp")), "a temporary file was left behind"


def test_matrix_build_runs_rows_side_by_side(built, docker_client, tmp_path):
    """`--all --jobs 2`: the two torch 2.7 rows at once, one report line each."""
    root = fault_copy(tmp_path / "p", docker_client)
    (root / "pytorch_cuda_runtime" / "NOTE.txt").write_text("new last layers for both rows\n")
    proc = run_build_py(root, "--all", "--torch", "2.7", "--jobs", "2", "--no-test", timeout=1800)
    assert proc.returncode == 0, shown(proc)
    started = [ln for ln in proc.stderr.splitlines() if ": started (log:" in ln]
    finished = [ln for ln in proc.stderr.splitlines() if ln.endswith(" s") and ": ok after " in ln]
    assert len(started) == 2 and len(finished) == 2, proc.stderr
    # both were started before either finished: side by side, not one after the other
    lines = proc.stderr.splitlines()
    assert max(lines.index(s) for s in started) < min(lines.index(f) for f in finished), proc.stderr
    for cuda in ("12.1", "12.6"):
        assert f"2.7.1-cuda{cuda}-runtime" in proc.stdout
        docker_client.images.get(f"{FAULT_REPO}-candidate:2.7.1-cuda{cuda}-runtime")


def test_full_disk_during_render_changes_no_file(tmp_path):
    """The real command on a filesystem that fills up: one line, exit 2, images/ untouched."""
    with tmpfs(tmp_path / "small", "24m") as mnt:
        root = project_copy(mnt / "p")
        tpl = root / "templates" / "header.j2"
        tpl.write_text(tpl.read_text() + "\n# a change that makes every Dockerfile longer\n" + "# padding\n" * 50)
        before = tree_snapshot(root / "images")
        fill(mnt / "filler")
        proc = run_build_py(root, "render")
        assert proc.returncode == 2, shown(proc)
        lines = error_lines(proc.stderr)
        assert len(lines) == 1 and "no space left on device" in lines[0] and "nothing was changed" in lines[0], proc.stderr
        assert tree_snapshot(root / "images") == before
        assert not list((root / "images").rglob("*.tmp"))
