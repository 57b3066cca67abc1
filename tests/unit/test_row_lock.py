"""The locks a row's run takes: per daemon for its candidate tag, per checkout for its results,
and only once its daemon has answered. No daemon is needed: the dead one is a socket path
nothing listens on."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock

from pytorch_cuda_build import matrix, paths, pipeline
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import EnvironmentProblem

from helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
ROW = matrix.load(ROOT / "matrix.yaml").images[0]


@pytest.fixture(autouse=True)
def own_state(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")


class Daemon:
    def __init__(self, ident: str | None) -> None:
        self.ident = ident

    def info(self) -> dict:
        if self.ident is None:
            raise ConnectionError("no answer")
        return {"ID": self.ident}


def test_two_daemons_get_two_locks_and_one_daemon_one_whatever_its_address(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")
    here = pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon("a1b2-20.10")))
    assert here == pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon("a1b2-20.10")))
    assert here != pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon("c3d4-26.1")))
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:2375")  # the same daemon by another address
    assert here == pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon("a1b2-20.10")))


def test_a_daemon_that_will_not_say_its_id_is_known_by_its_docker_host(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/docker.sock")
    first = pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon(None)))
    assert first == pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon(None)))
    monkeypatch.setenv("DOCKER_HOST", "unix:///run/pytorch-cuda-engine/docker.sock")
    assert first != pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon(None)))


def test_the_results_lock_is_per_checkout(tmp_path):
    assert pipeline.results_lock_path(tmp_path / "a", ROW) == pipeline.results_lock_path(tmp_path / "a", ROW)
    assert pipeline.results_lock_path(tmp_path / "a", ROW) != pipeline.results_lock_path(tmp_path / "b", ROW)


class Console:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, msg: str) -> None:
        self.lines.append(msg)

    def stage_start(self, name: str) -> None:
        pass

    def stage_end(self, name: str, seconds: float) -> None:
        pass


def test_a_dead_daemon_fails_at_once_while_another_daemon_builds_the_row(monkeypatch, tmp_path):
    """Another daemon's build of the row holds every lock it can; this one must not wait on them."""
    other = tmp_path / "other-checkout"
    held = [FileLock(str(p)) for p in (pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon("other"))),
                                       pipeline.results_lock_path(tmp_path, ROW),  # even this checkout's results
                                       pipeline.results_lock_path(other, ROW),
                                       paths.STATE_DIR / f"build-{ROW.name}.lock")]  # the lock before this change
    paths.STATE_DIR.mkdir(parents=True)
    for lock in held:
        lock.acquire()
    dead = tmp_path / "dead.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{dead}")
    console, outcome = Console(), []

    def run() -> None:
        try:
            pipeline.build_row(tmp_path, ROW, pipeline.Options(no_test=True), console)
        except EnvironmentProblem as e:
            outcome.append(str(e))

    t0 = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    try:
        assert not worker.is_alive(), f"waited on a lock: {console.lines}"
        assert time.monotonic() - t0 < 30
        assert outcome and outcome[0].startswith(f"no Docker daemon answers at unix://{dead}")
        assert not [line for line in console.lines if "waiting" in line]
    finally:
        for lock in held:
            lock.release()


def test_a_build_on_another_daemon_from_another_checkout_does_not_wait(monkeypatch, tmp_path):
    monkeypatch.setattr(pipeline._Row, "engine", lambda self: (Daemon("mine"), None))
    monkeypatch.setattr(pipeline._Row, "run", lambda self, c, bc, hold_tags=False: pipeline.RowResult(ROW.name, ok=True))
    paths.STATE_DIR.mkdir(parents=True)
    held = [FileLock(str(pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon("other"))))),
            FileLock(str(pipeline.results_lock_path(tmp_path / "other-checkout", ROW)))]
    for lock in held:
        lock.acquire()
    console = Console()
    try:
        assert pipeline.build_row(tmp_path, ROW, pipeline.Options(no_test=True), console).ok
        assert console.lines == []
        mine = FileLock(str(pipeline.row_lock_path(ROW, docker_env.daemon_key(Daemon("mine")))))
        mine.acquire()  # the same daemon: the second run waits, and says why
        done = threading.Event()
        worker = threading.Thread(target=lambda: (pipeline.build_row(tmp_path / "elsewhere", ROW, pipeline.Options(), console),
                                                  done.set()), daemon=True)
        worker.start()
        waiting = f"another build of {ROW.name} on the daemon at "
        wait_until("the second run saying it waits", lambda: any(line.startswith(waiting) for line in console.lines), timeout=30)
        assert not done.is_set() and console.lines[-1].startswith(waiting)
        mine.release()
        worker.join(timeout=10)
        assert done.is_set()
    finally:
        for lock in held:
            lock.release()
