"""The gate's containers (stages/gate.py, throwaway_container), with a fake Docker client: every
container the smoke step creates is removed, on every way out, and each gets the resolver
the engine names."""
from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import docker.errors
import pytest
import requests

from pytorch_cuda_build.engine import containers
from pytorch_cuda_build.errors import EnvironmentProblem
from pytorch_cuda_build.stages import gate

ROW = SimpleNamespace(name="row", platform="linux/amd64")


class FakeContainer:
    def __init__(self, daemon: FakeDaemon, name: str, labels: dict):
        self.daemon, self.name, self.labels, self.id = daemon, name, labels, f"id-{name}"

    def start(self):
        if self.daemon.start_error:
            raise self.daemon.start_error

    def wait(self, timeout):
        if self.daemon.wait_error:
            raise self.daemon.wait_error
        return {"StatusCode": 0}

    def kill(self):
        self.daemon.killed.append(self.name)
        if self.daemon.kill_error:
            raise self.daemon.kill_error

    def logs(self):
        return b"log\n"

    def remove(self, force=False):
        assert force, "a running container is removed only with force"
        if self.daemon.remove_error:
            raise self.daemon.remove_error
        del self.daemon.alive[self.name]


class FakeDaemon:
    """containers.create/get as docker-py has them; a container stays until removed."""

    def __init__(self, **errors):
        self.alive: dict[str, FakeContainer] = {}
        self.killed: list[str] = []
        self.create_error = self.start_error = self.wait_error = self.kill_error = self.remove_error = None
        for k, v in errors.items():
            setattr(self, k, v)
        self.containers = SimpleNamespace(create=self._create, get=self._get)

    def _create(self, image, command, name, labels, **opts):
        assert "detach" not in opts and name not in self.alive
        self.alive[name] = FakeContainer(self, name, labels)
        if self.create_error:  # the daemon made it, but its answer never arrived
            raise self.create_error
        return self.alive[name]

    def _get(self, name):
        if name not in self.alive:
            raise docker.errors.NotFound(f"No such container: {name}")
        return self.alive[name]


@pytest.fixture(autouse=True)
def cpu_daemon(monkeypatch):
    monkeypatch.setattr(gate.docker_env, "gpu_request", lambda c: None)


def smoke(daemon: FakeDaemon, tmp_path: Path, logs: list | None = None):
    return gate.smoke(daemon, ROW, "sha256:img", tmp_path, False, log=(logs if logs is not None else []).append)


def test_start_failure_removes_the_created_container(tmp_path):
    daemon = FakeDaemon(start_error=docker.errors.APIError("500 Server Error: driver failed programming external connectivity"))
    with pytest.raises(docker.errors.APIError):
        smoke(daemon, tmp_path)
    assert daemon.alive == {}


def test_missing_bridge_is_named_and_its_container_removed(tmp_path):
    daemon = FakeDaemon(start_error=docker.errors.APIError(
        "500 Server Error for http+docker://localhost/v1.41/containers/x/start: Internal Server Error "
        '("failed to create endpoint on network bridge: could not find bridge docker0: route ip+net: no such network interface")'))
    with pytest.raises(EnvironmentProblem, match="daemon answers but cannot start a container.*restart dockerd"):
        smoke(daemon, tmp_path)
    assert daemon.alive == {}


def test_create_whose_answer_was_lost_is_found_by_name_and_removed(tmp_path):
    daemon = FakeDaemon(create_error=requests.exceptions.ReadTimeout("read timed out"))
    with pytest.raises(requests.exceptions.ReadTimeout):
        smoke(daemon, tmp_path)
    assert daemon.alive == {}


def test_timeout_kills_then_removes(tmp_path, monkeypatch):
    monkeypatch.setattr(gate, "SMOKE_TIMEOUT_S", 0)  # the wait below took the whole of it
    daemon = FakeDaemon(wait_error=requests.exceptions.ReadTimeout("read timed out"),
                        kill_error=docker.errors.APIError("409 Conflict: container is not running"))
    with pytest.raises(gate.TestFailure, match="timed out"):
        smoke(daemon, tmp_path)
    assert len(daemon.killed) == 1 and daemon.alive == {}


@pytest.mark.parametrize("lost", [
    requests.exceptions.ChunkedEncodingError("('Connection broken: IncompleteRead(0 bytes read, 2 more expected)')"),
    requests.exceptions.ConnectionError("('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))"),
])
def test_a_daemon_lost_mid_wait_is_no_timeout(tmp_path, lost):
    """The reply to the wait cut short, or the connection dropped before the timeout: the daemon's
    error goes up as it is (the stage's boundary names it), nothing is killed and the container is
    removed where the daemon still lets it."""
    daemon = FakeDaemon(wait_error=lost)
    with pytest.raises(type(lost)):
        smoke(daemon, tmp_path)
    assert daemon.killed == [] and daemon.alive == {}


def test_interrupt_removes(tmp_path):
    daemon = FakeDaemon(wait_error=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        smoke(daemon, tmp_path)
    assert daemon.alive == {}


def test_a_failing_removal_never_hides_why_we_left(tmp_path):
    daemon = FakeDaemon(wait_error=requests.exceptions.ConnectionError("daemon gone"),
                        kill_error=requests.exceptions.ConnectionError("daemon gone"),
                        remove_error=requests.exceptions.ConnectionError("daemon gone"))
    logs: list[str] = []
    with pytest.raises(requests.exceptions.ConnectionError, match="daemon gone"):
        smoke(daemon, tmp_path, logs)
    (name,) = daemon.alive
    assert any(f"docker rm -f {name}" in line and "the next run removes it" in line for line in logs), logs


def test_containers_carry_the_runs_label(tmp_path, monkeypatch):
    seen = []
    daemon = FakeDaemon()
    create = daemon.containers.create
    daemon.containers.create = lambda *a, **kw: seen.append(kw["labels"]) or create(*a, **kw)
    with pytest.raises(gate.TestFailure):  # the fake writes no report: 0 checks passed
        smoke(daemon, tmp_path)
    me = containers.me()
    assert seen == [{"pytorch-cuda.test": "smoke", gate.RUN_LABEL: gate.RUN_ID, containers.HOST_LABEL: socket.gethostname(),
                     containers.PID_LABEL: str(os.getpid()), containers.PROCESS_LABEL: me.process}]
    assert me.process and me.process == containers.identity(os.getpid())  # this process, as the next run's sweep reads it
    assert gate.RUN_ID == os.environ["PYTORCH_CUDA_RUN_ID"]  # the session's own (tests/conftest.py)
    assert daemon.alive == {}


def test_containers_get_the_resolver_the_engine_names_and_host_network_ones_keep_the_hosts(monkeypatch):
    made = []

    class Containers:
        def create(self, image, command, **opts):
            made.append(opts)
            raise RuntimeError("stop here")

        def get(self, name):
            raise docker.errors.NotFound(name)

    client = type("C", (), {"containers": Containers()})()
    monkeypatch.setenv("PYTORCH_CUDA_CONTAINER_DNS", "127.0.0.1, 10.0.0.2")
    for opts in ({}, {"network_mode": "host"}):
        with pytest.raises(RuntimeError, match="stop here"):
            with gate.throwaway_container(client, "img", ["true"], "smoke", log=lambda m: None, **opts):
                pass
    monkeypatch.delenv("PYTORCH_CUDA_CONTAINER_DNS")
    with pytest.raises(RuntimeError, match="stop here"):
        with gate.throwaway_container(client, "img", ["true"], "smoke", log=lambda m: None):
            pass
    assert len(made) == 3
    assert made[0]["dns"] == ["127.0.0.1", "10.0.0.2"]
    assert "dns" not in made[1] and "dns" not in made[2]
