"""A real Slurm 22.05 cluster of a few nodes (two unless asked) on this one machine, for the tests that run jobs on it.

Everything is this test run's own, and removed again:
- munged on its own socket and key (slurm.conf's AuthInfo names the socket);
- a bridge with the controller's address and a network namespace per node on it, each with its
  own hostname (slurmd is started in a new UTS namespace), so torchrun and gloo see separate
  hosts; node names in /etc/hosts, which the OCI bundle binds into the containers;
- slurmctld on the host side of the bridge, one slurmd per namespace, all in the foreground as
  children of this process, and the oci.conf it is given;
- where asked, stand-in GPUs: character devices with NVIDIA's major number (195) in the cluster's
  own directory, named by gres.conf (AutoDetect=off), which Slurm 22.05 allocates as it would
  real ones. No driver answers behind them: they prove the wiring, not a GPU.

The recipe and its pitfalls were measured here (../shared/ENVIRONMENT.md): slurmd entered with
nsenter, not `ip netns exec` (which remounts /sys and loses the cgroup mounts); runc, not crun
(hybrid cgroups); while Docker runs, iptables' FORWARD policy drops traffic between two ports of
the bridge unless a rule accepts it.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import resource
import shutil
import socket
import stat
import subprocess
import time
import uuid
from pathlib import Path

from helpers import free_port

# Who may run it: root, with the daemons and tools below (engine.sh --with-registry installs them).
TOOLS = ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel", "munged", "runc", "umoci", "skopeo", "nsenter", "unshare", "ip",
         "iptables")
SUBNETS = [f"10.77.{i}" for i in range(256)]  # a private /24 no interface of this host has, never docker0's
HOSTS_MARK = "# pytorch-cuda test slurm cluster"


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _run(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=kw.pop("timeout", 120), check=check, **kw)


def _free_subnet() -> str:
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    return next(n for n in SUBNETS if f" {n}." not in used)


class SlurmCluster:
    """`nodes` nodes (`<prefix>1`, `<prefix>2`, ...), one partition; start() and stop() are each safe to call once.
    work must exist and be readable by every user who submits (slurm.conf, the stand-ins are there)."""

    PARTITION = "test"
    NVIDIA_MAJOR = 195  # /dev/nvidiaN is (195, N), /dev/nvidiactl (195, 255)

    def __init__(self, work: Path, oci_conf: list[str], nodes: int = 2, gpus: int = 0) -> None:
        tag = uuid.uuid4().hex[:6]
        self.work = work
        self.names = [f"pcb{tag}n{i + 1}" for i in range(nodes)]
        self.netns = [f"pcb-{tag}-{i + 1}" for i in range(nodes)]
        self.bridge = f"pcbs{tag}"[:15]
        self.subnet = _free_subnet()
        self.addresses = [f"{self.subnet}.{i + 2}" for i in range(nodes)]
        self.conf = work / "etc" / "slurm.conf"
        self.oci_conf = oci_conf
        self.gpus = gpus
        self.devices = work / "dev"  # the stand-in GPUs
        self.munge_dir = Path(f"/run/pcb-munge-{tag}")
        self.procs: list[subprocess.Popen] = []
        self._undo: list = []

    # ---- start ----------------------------------------------------------------------------

    def start(self) -> "SlurmCluster":
        try:
            self._network()
            self._munge()
            self._standin_gpus()
            self._config()
            self._daemons()
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._undo.append(lambda: _run("ip", "link", "del", self.bridge, check=False))
        _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        _run("iptables", "-I", *rule)
        self._undo.append(lambda: _run("iptables", "-D", *rule, check=False))
        for i, (ns, addr) in enumerate(zip(self.netns, self.addresses)):
            host_end = f"{self.bridge[:10]}v{i}"
            _run("ip", "netns", "add", ns)
            self._undo.append(lambda ns=ns: _run("ip", "netns", "del", ns, check=False))
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", host_end, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        lines = "".join(f"{a} {n} {HOSTS_MARK}\n" for a, n in zip(self.addresses, self.names))
        with open("/etc/hosts", "a") as f:
            f.write(lines)
        self._undo.append(self._hosts_back)

    def _hosts_back(self) -> None:
        text = Path("/etc/hosts").read_text()
        kept = [ln for ln in text.splitlines(keepends=True) if not (HOSTS_MARK in ln and any(n in ln for n in self.names))]
        Path("/etc/hosts").write_text("".join(kept))

    def _munge(self) -> None:
        user = pwd.getpwnam("munge")
        self.munge_dir.mkdir(mode=0o755)
        self._undo.append(lambda: shutil.rmtree(self.munge_dir, ignore_errors=True))
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        os.chown(self.munge_dir, user.pw_uid, user.pw_gid)
        os.chown(key, user.pw_uid, user.pw_gid)
        d = self.munge_dir
        self._spawn(["runuser", "-u", "munge", "--", "munged", "--foreground", f"--socket={d}/munge.socket",
                     f"--key-file={key}", f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                     f"--seed-file={d}/munged.seed"], "munged")
        deadline = time.monotonic() + 30
        while not (d / "munge.socket").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._tail(d / 'munged.log')}")
            time.sleep(0.2)

    def _standin_gpus(self) -> None:
        if not self.gpus:
            return
        self.devices.mkdir(mode=0o755)
        for name, minor in [*((f"nvidia{i}", i) for i in range(self.gpus)), ("nvidiactl", 255)]:
            os.mknod(self.devices / name, 0o666 | stat.S_IFCHR, os.makedev(self.NVIDIA_MAJOR, minor))

    def _config(self) -> None:
        etc = self.conf.parent
        etc.mkdir(parents=True)
        (self.work / "state").mkdir()
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={os.cpu_count()}{gres} State=UNKNOWN"
                          for n, a in zip(self.names, self.addresses))
        w = self.work
        self.conf.write_text(f"""\
ClusterName=pcbtest
GresTypes=gpu
SlurmctldHost={socket.gethostname()}({self.subnet}.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={self.munge_dir}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool-%n
SlurmctldPidFile={w}/slurmctld.pid
SlurmdPidFile={w}/slurmd-%n.pid
SlurmctldLogFile={w}/slurmctld.log
SlurmdLogFile={w}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
{nodes}
PartitionName={self.PARTITION} Nodes={",".join(self.names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        # Slurm reads oci.conf and gres.conf beside slurm.conf
        (etc / "oci.conf").write_text("\n".join(self.oci_conf) + "\n")
        if self.gpus:
            (etc / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={self.devices}/nvidia[0-{self.gpus - 1}]\n")
        for p in [self.work, etc, *etc.iterdir()]:  # submitters read slurm.conf
            p.chmod(p.stat().st_mode | 0o055 if p.is_dir() else p.stat().st_mode | 0o044)

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.work / f"{name}.out", "w") if self.work.exists() else subprocess.DEVNULL
        # No core files (slurmstepd can dump one when its step is killed at teardown), and the
        # daemons' working directory is the cluster's own, never the checkout.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True,
                                cwd=self.work, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
        self.procs.append(proc)

    def _daemons(self) -> None:
        self._spawn(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld")
        for name, ns in zip(self.names, self.netns):
            # nsenter, not `ip netns exec`; a UTS namespace of its own for the node's hostname
            self._spawn(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "sh", "-c",
                         f"hostname {name} && exec slurmd -D -N {name} -f {self.conf}"], f"slurmd-{name}")

    def _wait_idle(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited {p.returncode}: {self.logs()}")
            proc = _run("sinfo", "-h", "-N", "-o", "%N %t", check=False, env=self.env())
            states = proc.stdout.strip()
            if proc.returncode == 0 and sorted(states.split()) == sorted(sum(([n, "idle"] for n in self.names), [])):
                return
            time.sleep(1)
        raise RuntimeError(f"nodes not idle after {timeout:.0f} s: {states!r}; {self.logs()}")

    # ---- use --------------------------------------------------------------------------------

    def sbatch(self, script: Path, cwd: Path, env: dict[str, str], user: str | None = None) -> str:
        """Submit as root, or as `user` (runuser keeps the environment but HOME, SHELL, USER, LOGNAME)."""
        as_user = ["runuser", "-u", user, "--"] if user else []
        proc = _run(*as_user, "sbatch", "--parsable", str(script), cwd=cwd, env={**self.env(), **env})
        return proc.stdout.strip().split(";")[0]

    def wait(self, job: str, timeout: float) -> str:
        """The job's final state (COMPLETED, FAILED, ...), or TIMEOUT after cancelling it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = _run("scontrol", "show", "job", job, "-o", check=False, env=self.env()).stdout
            state = next((f.split("=", 1)[1] for f in out.split() if f.startswith("JobState=")), "")
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return state
            time.sleep(2)
        _run("scancel", job, check=False, env=self.env())
        return "TIMEOUT"

    def logs(self) -> str:
        return "; ".join(f"{p.name}: {self._tail(p)}" for p in sorted(self.work.glob("*.log")))

    @staticmethod
    def _tail(path: Path, n: int = 6) -> str:
        try:
            return " | ".join(path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ---- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            _run("scancel", "--full", "--quiet", "-p", self.PARTITION, check=False, env=self.env(), timeout=30)
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 15)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
                p.wait(timeout=20)
        self.procs.clear()
        while self._undo:
            with contextlib.suppress(Exception):
                self._undo.pop()()
