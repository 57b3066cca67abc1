"""A current Docker Engine beside bookworm's 20.10, for the tests and CI of both.

Debian trixie's docker.io 26, its CLI, buildx and containerd, read from Debian's signed
indexes (the InRelease checked with gpgv, each .deb against the sha256 the index gives) and
unpacked, never installed: they are another release's packages, and installing them would
replace the 20.10 engine. Trixie's runc needs glibc 2.38, so bookworm's runc runs the
containers.

Each image store gets a daemon of its own (data root, exec root, sockets, pid files, logs,
bridge), so the containerd store and the classic one can run at once, beside 20.10:

- `--iptables=false`: the host's firewall and the 20.10 engine's chains stay as they are.
  Containers on this engine's bridge therefore reach nothing outside it; builds run their
  steps on the host's network (`PYTORCH_CUDA_BUILD_NETWORK=host`, which build.py reads).
- a bridge of its own: a second dockerd with `--bridge=none` deleted the 20.10 engine's
  docker0 here, and every container start there failed until that engine was restarted.

`python3 build.py engine [--store containerd|classic]` brings one up and prints the
environment that points build.py, the Docker SDK and the CLI at it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..engine.docker_env import CONTAINER_DNS_ENV, NETWORK_ENV
from ..errors import EnvironmentProblem
from ..resolve import debian as resolve_debian

MIRROR = "http://deb.debian.org/debian"
SUITE = "trixie"
PACKAGES = ("docker.io", "docker-cli", "docker-buildx", "containerd")
RUNC = Path("/usr/sbin/runc")  # bookworm's, installed with its docker.io
HOME = Path(os.environ.get("PYTORCH_CUDA_ENGINE_HOME", "/var/lib/pytorch-cuda-engine"))
RUN = Path(os.environ.get("PYTORCH_CUDA_ENGINE_RUN", "/run/pytorch-cuda-engine"))


@dataclass(frozen=True)
class Store:
    """One daemon: an image store and the bridge and subnet its containers get."""

    name: str
    bridge: str  # at most 15 characters (IFNAMSIZ)
    address: str  # the bridge's own address, CIDR; its subnet must be free on this host
    home: Path | None = None  # its data's parent (default HOME): another filesystem, for one
    # What containerd and dockerd start under: a command prefix (taskset, a UTS namespace) and
    # environment (TZ, LANG): the reproducibility test's second machine (test_reproducible_machine.py).
    wrap: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def state(self) -> Path:
        return (self.home or HOME) / self.name

    @property
    def run(self) -> Path:
        return RUN / self.name

    @property
    def docker_host(self) -> str:
        return f"unix://{self.run / 'docker.sock'}"


STORES = {
    "containerd": Store("containerd", "pcb-ctrd0", "172.30.213.1/24"),
    "classic": Store("classic", "pcb-classic0", "172.30.214.1/24"),
}
# A throwaway containerd-store daemon with an empty data root: `bench --only pull` times pulls into it.
PROBE = Store("pullprobe", "pcb-probe0", "172.30.215.1/24")


@dataclass(frozen=True)
class Unpacked:
    """The unpacked packages: where each binary is, and what versions they are."""

    root: Path
    versions: dict[str, str]

    @property
    def dockerd(self) -> Path:
        return self.root / "usr/sbin/dockerd"

    @property
    def docker(self) -> Path:
        return self.root / "usr/bin/docker"

    @property
    def containerd(self) -> Path:
        return self.root / "usr/bin/containerd"

    @property
    def buildx(self) -> Path:
        return self.root / "usr/libexec/docker/cli-plugins/docker-buildx"

    @property
    def path(self) -> str:
        """PATH for the daemons: containerd's shim, docker-proxy, then the host's runc."""
        return os.pathsep.join([str(self.root / "usr/bin"), str(self.root / "usr/sbin"), str(RUNC.parent),
                                os.environ.get("PATH", "/usr/bin:/bin")])


def unpack(ca_bundle: str | None, log: Callable[[str], None] = print) -> Unpacked:
    """The packages at trixie's current versions, unpacked once per set of versions."""
    debs = resolve_debian.debian_toolkit(MIRROR, SUITE, ("main",), PACKAGES, ca_bundle)
    versions = {d.package: d.version for d in debs}
    key = hashlib.sha256(json.dumps(sorted((d.package, d.sha256) for d in debs)).encode()).hexdigest()[:12]
    root = HOME / "packages" / key
    done = root / ".versions.json"
    if done.exists():
        return Unpacked(root, json.loads(done.read_text()))
    if not shutil.which("dpkg-deb"):
        raise EnvironmentProblem("unpacking Debian packages needs dpkg-deb (Debian: apt-get install dpkg)")
    (HOME / "packages").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=HOME / "packages", prefix=".unpack-") as tmp:
        staging = Path(tmp) / "root"
        for d in debs:
            log(f"engine: {d.package} {d.version} ({d.size / 1e6:.0f} MB) from {MIRROR} {SUITE}")
            data = resolve_debian.fetch_verified(f"{MIRROR}/{d.filename}", d.sha256, ca_bundle)
            deb = Path(tmp) / f"{d.package}.deb"
            deb.write_bytes(data)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(staging)], check=True)
        (staging / ".versions.json").write_text(json.dumps(versions, indent=1) + "\n")
        staging.rename(root)  # whole or absent: a half-unpacked tree is never used
    return Unpacked(root, versions)


def containerd_config(store: Store) -> str:
    """Its own root, state and socket; no CRI (no Kubernetes here)."""
    return "\n".join([
        "version = 2",
        f'root = "{store.state / "containerd"}"',
        f'state = "{store.run / "containerd"}"',
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
        "[grpc]",
        f'  address = "{store.run / "containerd.sock"}"',
        "[ttrpc]",
        f'  address = "{store.run / "containerd.sock.ttrpc"}"',
        "",
    ])


def daemon_json(store: Store) -> dict:
    return {"features": {"containerd-snapshotter": store.name != "classic"}}


def dockerd_argv(u: Unpacked, store: Store) -> list[str]:
    return [str(u.dockerd), "--config-file", str(store.state / "daemon.json"),
            "--data-root", str(store.state / "docker"), "--exec-root", str(store.run / "exec"),
            "--pidfile", str(store.run / "dockerd.pid"), "-H", store.docker_host,
            "--containerd", str(store.run / "containerd.sock"),
            "--bridge", store.bridge, "--iptables=false", "--ip6tables=false"]


def environment(u: Unpacked, store: Store) -> dict[str, str]:
    """What points build.py, the SDK and the CLI at this daemon. DOCKER_CONFIG holds the
    buildx plugin (the CLI looks for plugins there); its config.json is this engine's own."""
    return {"DOCKER_HOST": store.docker_host, "PYTORCH_CUDA_DOCKER": str(u.docker),
            "DOCKER_CONFIG": str(store.state / "cli"), NETWORK_ENV: "host",
            # Its containers reach nothing outside (no NAT without iptables), the host's resolver
            # included: each lookup of a name not in /etc/hosts waited 10 s for it. A resolver on
            # the container's own loopback refuses at once. Per container, not dockerd's --dns:
            # BuildKit gives that to RUN steps on the host network too, and apt then resolved nothing.
            CONTAINER_DNS_ENV: "127.0.0.1"}


def _alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid if "Z" not in _proc_state(pid) else None


def _proc_state(pid: int) -> str:
    try:
        return next((ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:")), "")
    except OSError:
        return ""


def _spawn(argv: list[str], log_path: Path, pidfile: Path, env: dict[str, str]) -> None:
    """Fully detached (new session, stdin from /dev/null, output to a log): a daemon that
    holds a caller's stdout keeps CI's pipe open after the caller ends."""
    with open(log_path, "ab") as out, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(argv, stdin=devnull, stdout=out, stderr=out, env=env, start_new_session=True)
    pidfile.write_text(f"{proc.pid}\n")


def _wait(ready: Callable[[], bool], what: str, log_path: Path, seconds: int = 60) -> None:
    for _ in range(seconds):
        if ready():
            return
        time.sleep(1)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:] if log_path.exists() else []
    raise EnvironmentProblem(f"{what} did not come up within {seconds} s; see {log_path}: {' | '.join(tail)[-300:]}")


def _bridge(store: Store) -> None:
    """Create this daemon's bridge once; dockerd takes its subnet from the bridge's address."""
    if Path(f"/sys/class/net/{store.bridge}").exists():
        return
    if not shutil.which("ip"):
        raise EnvironmentProblem(f"creating the bridge {store.bridge} needs `ip` (Debian: apt-get install iproute2)")
    for argv in (["ip", "link", "add", store.bridge, "type", "bridge"],
                 ["ip", "addr", "add", store.address, "dev", store.bridge],
                 ["ip", "link", "set", store.bridge, "up"]):
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise EnvironmentProblem(f"{shlex.join(argv)}: {proc.stderr.strip() or proc.returncode}")


def _answers(u: Unpacked, store: Store) -> bool:
    env = {**os.environ, **environment(u, store)}
    proc = subprocess.run([str(u.docker), "info", "--format", "{{.ServerVersion}}"], env=env,
                          capture_output=True, text=True, timeout=20)
    return proc.returncode == 0 and bool(proc.stdout.strip())


def up(store_name: str | Store, ca_bundle: str | None, log: Callable[[str], None] = print) -> dict[str, str]:
    """Bring the store's daemon up (or find it up); its environment."""
    store = STORES[store_name] if isinstance(store_name, str) else store_name  # the CLI refused any other name
    if os.geteuid() != 0:
        raise EnvironmentProblem("starting a second Docker engine needs root (it creates a bridge and runs dockerd); "
                                 "on a machine with a current engine already, point DOCKER_HOST at it instead")
    if not RUNC.exists():
        raise EnvironmentProblem(f"no {RUNC}: the current engine runs containers with bookworm's runc (apt-get install runc)")
    u = unpack(ca_bundle, log)
    for d in (store.state, store.run, store.state / "cli" / "cli-plugins"):
        d.mkdir(parents=True, exist_ok=True)
    plugin = store.state / "cli" / "cli-plugins" / "docker-buildx"
    if not plugin.exists() or plugin.resolve() != u.buildx:
        plugin.unlink(missing_ok=True)
        plugin.symlink_to(u.buildx)
    env = {**os.environ, **dict(store.env), "PATH": u.path}
    if _alive(store.run / "dockerd.pid") and _answers(u, store):
        return environment(u, store)
    _bridge(store)
    if not _alive(store.run / "containerd.pid"):
        (store.state / "containerd.toml").write_text(containerd_config(store))
        _spawn([*store.wrap, str(u.containerd), "--config", str(store.state / "containerd.toml")],
               store.state / "containerd.log", store.run / "containerd.pid", env)
        _wait(lambda: (store.run / "containerd.sock").is_socket(), "containerd", store.state / "containerd.log")
    (store.state / "daemon.json").write_text(json.dumps(daemon_json(store), indent=1) + "\n")
    log(f"engine: starting dockerd {u.versions['docker.io']} ({store.name} image store, log: {store.state / 'dockerd.log'})")
    _spawn([*store.wrap, *dockerd_argv(u, store)], store.state / "dockerd.log", store.run / "dockerd.pid.spawned", env)
    _wait(lambda: _answers(u, store), "dockerd", store.state / "dockerd.log")
    return environment(u, store)


def down(store_name: str | Store) -> bool:
    """Stop the store's dockerd and containerd, if running; whether anything was stopped."""
    store = STORES[store_name] if isinstance(store_name, str) else store_name
    stopped = False
    for pidfile in (store.run / "dockerd.pid.spawned", store.run / "containerd.pid"):
        pid = _alive(pidfile)
        if pid:
            os.kill(pid, 15)
            for _ in range(30):
                if not _alive(pidfile):
                    break
                time.sleep(1)
            stopped = True
        pidfile.unlink(missing_ok=True)
    return stopped


def exports(env: dict[str, str]) -> str:
    """Shell lines: `eval "$(python3 build.py engine)"` points this shell at the engine."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
