"""The containers of killed runs (engine/containers.py), with real processes and a fake daemon: every
container names its owner, and a run's start removes those whose owner is gone, in one line, and
never one whose owner still runs or that it cannot judge."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import docker.errors
import pytest
import requests

from pytorch_cuda_build.engine import containers, docker_env


def owner_of(proc: subprocess.Popen) -> dict[str, str]:
    """The labels a container of that process carries (as containers.labels() writes them there)."""
    process = containers.identity(proc.pid)
    assert process is not None
    return containers.Owner(socket.gethostname(), proc.pid, process).labels()


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def killed(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()  # reaped, as the shell or CI runner that started it reaps it


def test_a_live_process_is_not_gone_and_a_killed_one_is(sleeper):
    labels, here = owner_of(sleeper), containers.me()
    assert not containers.gone(labels, here)
    killed(sleeper)
    assert containers.gone(labels, here)


def test_a_reused_pid_is_another_process(sleeper):
    """The same PID with another start time: the owner is gone, whatever now runs under its PID."""
    labels = owner_of(sleeper)
    boot, ns, ticks = labels[containers.PROCESS_LABEL].split("/")
    labels[containers.PROCESS_LABEL] = f"{boot}/{ns}/{int(ticks) - 1}"
    assert containers.gone(labels, containers.me())


def test_a_zombie_runs_nothing():
    """Killed but not yet reaped: its containers are orphans all the same."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        labels = owner_of(proc)
        assert proc.stdin is not None
        proc.stdin.close()  # it ends; nobody reaps it yet
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and containers.identity(proc.pid) is not None:
            time.sleep(0.05)
        assert os.path.exists(f"/proc/{proc.pid}/stat")  # still listed, in state Z
        assert containers.identity(proc.pid) is None and containers.gone(labels, containers.me())
    finally:
        proc.wait()


def test_what_cannot_be_judged_is_never_gone(sleeper):
    here = containers.me()
    killed(sleeper)
    labels = owner_of_gone(sleeper)
    assert containers.gone(labels, here)  # the control: judged, and gone
    boot, ns, ticks = labels[containers.PROCESS_LABEL].split("/")
    for other in ({containers.HOST_LABEL: "another-host"},  # another machine's PIDs
                  {containers.PROCESS_LABEL: f"{'0' * 8}-0000-0000-0000-{'0' * 12}/{ns}/{ticks}"},  # another boot
                  {containers.PROCESS_LABEL: f"{boot}/pid:[1]/{ticks}"},  # another PID namespace (a container's)
                  {containers.PID_LABEL: "not a pid"}, {containers.PID_LABEL: "0"}):
        assert not containers.gone({**labels, **other}, here), other
    assert not containers.gone({"pytorch-cuda.run": "test-x", "pytorch-cuda.test": "service"}, here)  # no owner: the tests' own
    assert not containers.gone(here.labels(), here)  # this very process


class FakeContainer:
    def __init__(self, daemon: FakeDaemon, name: str, labels: dict[str, str], error: Exception | None = None):
        self.daemon, self.name, self.labels, self.error = daemon, name, labels, error

    def remove(self, force=False):
        assert force, "a running container is removed only with force"
        if self.error:
            raise self.error
        self.daemon.alive.remove(self)


class FakeDaemon:
    def __init__(self):
        self.alive: list[FakeContainer] = []
        self.asked: list[dict] = []
        self.containers = SimpleNamespace(list=self._list)

    def add(self, name: str, labels: dict[str, str], error: Exception | None = None) -> FakeContainer:
        self.alive.append(FakeContainer(self, name, labels, error))
        return self.alive[-1]

    def _list(self, all=False, filters=None):
        assert all, "exited containers are left behind too"
        self.asked.append(filters)
        host = filters["label"].split("=", 1)[1]
        return [ct for ct in self.alive if ct.labels.get(containers.HOST_LABEL) == host]


def test_sweep_removes_only_the_dead_runs_containers_and_says_so_in_one_line(sleeper):
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead_labels = {"pytorch-cuda.test": "smoke", containers.RUN_LABEL: "r1", **owner_of(dead)}
    killed(dead)
    daemon = FakeDaemon()
    daemon.add("pytorch-cuda-smoke-dead", dead_labels)
    daemon.add("pytorch-cuda-structure-dead", {**dead_labels, "pytorch-cuda.test": "structure"})
    daemon.add("pytorch-cuda-smoke-live", {"pytorch-cuda.test": "smoke", **owner_of(sleeper)})
    daemon.add("pytorch-cuda-mine", containers.labels("smoke"))
    daemon.add("test-service", {"pytorch-cuda.run": "test-x", "pytorch-cuda.test": "service"})
    daemon.add("elsewhere", {**dead_labels, containers.HOST_LABEL: "another-host"})
    said: list[str] = []
    removed = containers.sweep(daemon, said.append)
    assert removed == ["pytorch-cuda-smoke-dead", "pytorch-cuda-structure-dead"]
    assert sorted(ct.name for ct in daemon.alive) == ["elsewhere", "pytorch-cuda-mine", "pytorch-cuda-smoke-live", "test-service"]
    assert said == [f"removed 2 containers of runs whose process is gone (pid {dead.pid} on {socket.gethostname()}): "
                    "pytorch-cuda-smoke-dead, pytorch-cuda-structure-dead"]
    assert daemon.asked == [{"label": f"{containers.HOST_LABEL}={socket.gethostname()}"}]
    said.clear()
    assert containers.sweep(daemon, said.append) == [] and said == []  # nothing left: silent


def test_sweep_meets_another_runs_sweep_and_a_refusal(sleeper):
    """Two runs starting at once both find the dead run's container: the one that loses the race
    finds it gone (404), which is no problem; a refusal (409) is a warning line, not a failure."""
    killed(sleeper)
    labels = owner_of_gone(sleeper)
    daemon = FakeDaemon()
    daemon.add("raced", labels, docker.errors.NotFound("No such container: raced"))
    daemon.add("refused", labels, docker.errors.APIError("409 Conflict", explanation="removal of container refused is already in progress"))
    said: list[str] = []
    assert containers.sweep(daemon, said.append) == []
    assert said == ["warning: could not remove refused (removal of container refused is already in progress), left by runs whose "
                    "process is gone; remove with `docker rm -f NAME`"]


def owner_of_gone(proc: subprocess.Popen) -> dict[str, str]:
    here = containers.me()
    return {containers.HOST_LABEL: here.host, containers.PID_LABEL: str(proc.pid),
            containers.PROCESS_LABEL: here.process.rsplit("/", 1)[0] + "/1"}


def test_the_engine_check_sweeps_once_per_daemon(monkeypatch):
    """ensure_engine sweeps the first time a process reaches a daemon, not at every later call."""
    daemon, seen = FakeDaemon(), []
    monkeypatch.setattr(docker_env, "client", lambda: daemon)
    monkeypatch.setattr(docker_env.os, "geteuid", lambda: 1000)  # no engine.sh run
    monkeypatch.setattr(docker_env, "_SWEPT", set())
    monkeypatch.setattr(containers, "sweep", lambda c, log: seen.append(c))
    assert docker_env.ensure_engine(lambda m: None) is daemon
    docker_env.ensure_engine(lambda m: None)
    assert seen == [daemon]


def test_a_daemon_lost_during_the_sweep_is_one_line(monkeypatch):
    class Gone:
        containers = SimpleNamespace(list=lambda **kw: (_ for _ in ()).throw(
            requests.exceptions.ConnectionError("('Connection aborted.', ConnectionResetError(104))")))

    monkeypatch.setattr(docker_env, "_SWEPT", set())
    with pytest.raises(docker_env.EngineLost, match="stopped answering during the removal of containers that killed runs left"):
        docker_env.swept(Gone(), lambda m: None)


def test_label_args_are_the_labels_for_the_cli():
    args = containers.label_args("bench")
    pairs = dict(a.split("=", 1) for a in args[1::2])
    assert args[::2] == ["--label"] * len(pairs) and pairs == containers.labels("bench")
