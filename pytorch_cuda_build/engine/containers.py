"""The containers this tool starts: each labelled with its run and the process that owns it, and
those of runs whose process is gone removed when a run starts.

A run removes its containers on every way out it sees (gate.throwaway_container), but a SIGKILL
(the OOM killer, a CI runner's last resort) or a daemon that dies before the removal leaves one
behind. So every container carries, beside `pytorch-cuda.test` (its kind) and `pytorch-cuda.run`
(the run's ID), its owner: the host's name, the process ID, and that process's identity (the
kernel's boot ID, the PID namespace and the process's start time, which a reused PID does not
share). At start (docker_env.ensure_engine), a run removes the containers of this host whose
owner is gone, and says so in one line. A container whose owner it cannot judge (another host,
another PID namespace, another boot, no owner labels: another tool's, or the test suite's own
services) is never touched, nor is one whose owner still runs.
"""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import docker
import docker.errors

# Every container a run makes carries RUN_LABEL=RUN_ID beside `pytorch-cuda.test`, so a caller
# counts and cleans only its own. PYTORCH_CUDA_RUN_ID lets one (the test suite) share an ID with
# the build.py processes it starts; otherwise each process has its own.
RUN_LABEL = "pytorch-cuda.run"
RUN_ID = os.environ.get("PYTORCH_CUDA_RUN_ID") or uuid.uuid4().hex
KIND_LABEL = "pytorch-cuda.test"
HOST_LABEL = "pytorch-cuda.host"
PID_LABEL = "pytorch-cuda.pid"
PROCESS_LABEL = "pytorch-cuda.process"  # boot ID, PID namespace, start time: "<boot>/<pid:[ns]>/<ticks>"

PROC = Path("/proc")


@dataclass(frozen=True)
class Owner:
    """A process, as the labels name it: where it runs and which process it is."""

    host: str
    pid: int
    process: str  # "" where /proc cannot say (then the PID alone is judged)

    def labels(self) -> dict[str, str]:
        return {HOST_LABEL: self.host, PID_LABEL: str(self.pid), PROCESS_LABEL: self.process}


def identity(pid: int, proc: Path = PROC) -> str | None:
    """The process's identity, "<boot id>/<pid namespace>/<start time in clock ticks>", or None when
    no such process runs (gone, or a zombie: it runs nothing and its containers are orphans)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command's name, field 2, is in parentheses and may hold spaces: the fields after its
    # last ")" start with the state (field 3); the start time is field 22.
    fields = stat.rpartition(")")[2].split()
    if fields[0] in ("Z", "X"):
        return None
    return f"{_boot(proc)}/{_pid_namespace(pid, proc)}/{fields[19]}"


def _boot(proc: Path) -> str:
    try:
        return (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_namespace(pid: int, proc: Path) -> str:
    try:
        return os.readlink(proc / str(pid) / "ns" / "pid")
    except OSError:
        return ""


def me() -> Owner:
    """This process, as its containers' labels name it (read at each call: a forked child is another owner)."""
    pid = os.getpid()
    try:
        process = identity(pid) or ""
    except OSError:  # no /proc here: the PID alone is recorded
        process = ""
    return Owner(socket.gethostname(), pid, process)


def labels(kind: str) -> dict[str, str]:
    """The labels of a container this process starts: its kind, the run, and its owner (this process)."""
    return {KIND_LABEL: kind, RUN_LABEL: RUN_ID, **me().labels()}


def label_args(kind: str) -> list[str]:
    """labels() as `docker run` arguments, for the containers started through the CLI."""
    return [a for k, v in labels(kind).items() for a in ("--label", f"{k}={v}")]


def gone(found: dict[str, str], here: Owner, proc: Path = PROC) -> bool:
    """Whether the owner a container's labels name is a process of this host that no longer runs.
    False wherever that cannot be said for sure: no owner labels, another host, another boot or
    PID namespace (the same PID there is another process), this very process."""
    try:
        pid = int(found.get(PID_LABEL, ""))
    except ValueError:
        return False
    process = found.get(PROCESS_LABEL, "")
    if found.get(HOST_LABEL) != here.host or pid <= 0:
        return False
    if process and here.process and process.split("/")[:2] != here.process.split("/")[:2]:
        return False  # another boot or another PID namespace: not ours to judge
    if pid == here.pid and process == here.process:
        return False
    try:
        now = identity(pid, proc)
    except OSError:  # e.g. /proc mounted with hidepid: unknown, so alive
        return False
    if now is None:
        return True
    return bool(process) and now != process  # the PID was given to another process since


def sweep(c: docker.DockerClient, log: Callable[[str], None], proc: Path = PROC) -> list[str]:
    """Remove the containers on this daemon whose owning run's process is gone (gone()); one line
    naming them, none when there were none. The names of those removed."""
    here = me()
    found = c.containers.list(all=True, filters={"label": f"{HOST_LABEL}={here.host}"})
    stale = [ct for ct in found if gone(ct.labels or {}, here, proc)]
    removed, kept = [], []
    for ct in stale:
        try:
            ct.remove(force=True)
            removed.append(ct)
        except docker.errors.NotFound:
            pass  # another run's sweep, or its --rm, got there first
        except docker.errors.APIError as e:  # the daemon answered no (a removal already under way: 409)
            kept.append(f"{ct.name} ({e.explanation or e})")
    if removed:
        owners = sorted({str((ct.labels or {}).get(PID_LABEL)) for ct in removed}, key=int)
        log(f"removed {len(removed)} container{'s' if len(removed) != 1 else ''} of runs whose process is gone "
            f"(pid {', '.join(owners)} on {here.host}): {', '.join(str(ct.name) for ct in removed)}")
    if kept:
        log(f"warning: could not remove {', '.join(kept)}, left by runs whose process is gone; remove with `docker rm -f NAME`")
    return [str(ct.name) for ct in removed]

