"""Find a Docker daemon and a BuildKit-capable client, starting the engine where we may.

The Python SDK's builder has no BuildKit (no secrets, no cache mounts), so builds go
through a Docker CLI; everything else (inspect, run, tag) goes through the SDK.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import docker
import docker.errors
import requests
import urllib3.exceptions

from ..errors import BuildError, CommandFailed, DockerRefused, EngineLost, EnvironmentProblem, PipelineError, TestFailure
from ..matrix import REPRODUCIBLE_EPOCH
from . import containers

ENGINE_SCRIPT = Path(__file__).with_name("engine.sh")
DOCKER_ENV = "PYTORCH_CUDA_DOCKER"
NETWORK_ENV = "PYTORCH_CUDA_BUILD_NETWORK"  # set by `build.py engine` (engine_current)
CONTAINER_DNS_ENV = "PYTORCH_CUDA_CONTAINER_DNS"  # likewise: test containers' resolvers, comma-separated


def container_dns() -> list[str]:
    """Resolvers for the containers this tool starts ($PYTORCH_CUDA_CONTAINER_DNS), or none: the daemon's own."""
    return [a.strip() for a in os.environ.get(CONTAINER_DNS_ENV, "").split(",") if a.strip()]


def daemon_address() -> str:
    return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def client() -> docker.DockerClient:
    """An SDK client whose daemon answers; raises EnvironmentProblem naming the address."""
    try:
        c = docker.from_env(timeout=600)
        c.ping()
        return c
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        if api_error(e) is not None:
            raise failure("a ping", e) from None
        raise EnvironmentProblem(f"no Docker daemon answers at {daemon_address()}: {_short(e)}") from None


def api_error(e: BaseException | None) -> docker.errors.APIError | None:
    """The daemon's HTTP error behind e, if the daemon answered at all (else None)."""
    seen = 0
    while e is not None and seen < 10:  # the SDK wraps; follow the chain a little way
        if isinstance(e, docker.errors.APIError) and e.status_code is not None:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


# What a call to the daemon raises when the daemon, not the request, failed: requests' errors
# (connection refused or reset, a reply cut short: ChunkedEncodingError, a timeout), urllib3's
# beneath them, the socket's own, and the SDK's DockerException around any of them.
TRANSPORT: tuple[type[BaseException], ...] = (docker.errors.DockerException, requests.exceptions.RequestException,
                                              urllib3.exceptions.HTTPError, ConnectionError)
NO_TAG_MOVED = "no tag was moved"


def failure(during: str, e: BaseException, left: str = NO_TAG_MOVED) -> EnvironmentProblem:
    """One line for any Docker SDK error: the daemon refused (HTTP status and its message), or it is gone.

    Gone means nothing answered: connection refused or reset, the socket missing, a reply cut
    short, a timeout, or a server error (5xx) after which no daemon answers a ping (a daemon
    dying mid-request). A refusal is the daemon answering no, e.g. 500 "could not select device
    driver" for a GPU request on a host without the NVIDIA runtime: restarting Docker does not
    help there, so the two must never read alike. `left`: what the run leaves as it was.
    """
    api = api_error(e)
    if api is None:
        return EngineLost(daemon_address(), during, _short(e), left)
    if api.status_code is not None and api.status_code >= 500 and not _daemon_answers():
        return EngineLost(daemon_address(), during, f"{api.status_code}: {refusal(api)}", left)
    return DockerRefused(daemon_address(), during, api.status_code, refusal(api))


def _daemon_answers() -> bool:
    """Whether a daemon answers at the address now (a short ping on a client of its own)."""
    try:
        return bool(docker.from_env(timeout=10).ping())
    except TRANSPORT:  # any failure to reach it is the answer: none
        return False


def refusal(e: docker.errors.APIError) -> str:
    """The daemon's own message (its JSON `message`), else the HTTP reason."""
    text = e.explanation.decode(errors="replace") if isinstance(e.explanation, bytes) else (e.explanation or "")
    if not text and e.response is not None:
        text = getattr(e.response, "reason", "") or ""
    return (text.strip().splitlines() or ["no message"])[0][:300]


def lost(during: str, e: BaseException | None = None, left: str = NO_TAG_MOVED) -> EnvironmentProblem:
    """The daemon went away mid-run (stopped, crashed, restarted); with the error at hand,
    classified by failure(), since an answer of the daemon is no loss of it."""
    if e is not None:
        return failure(during, e, left)
    return EngineLost(daemon_address(), during, left=left)


# Failures of ours that a daemon dying mid-step also gives: a build step, a test, a command
# through the CLI. With the daemon gone after one, the daemon is what to name.
MAYBE_LOST = (BuildError, TestFailure, CommandFailed)


@contextlib.contextmanager
def calls(stage: str, left: str = NO_TAG_MOVED, c: docker.DockerClient | None = None) -> Iterator[None]:
    """Where Docker is called during `stage`: a daemon or transport failure (TRANSPORT) leaves as
    one error of the tree, EngineLost or DockerRefused, naming the stage and what it left as it
    was; so does a failed build, test or command (MAYBE_LOST) after which c's daemon no longer
    answers. Our other typed errors and anything else (a bug) pass unchanged, to the CLI's one handler."""
    try:
        yield
    except MAYBE_LOST:
        if c is not None and not answers(c):
            raise lost(stage, left=left) from None
        raise
    except (PipelineError, BrokenPipeError):  # ours; the reader of our output gone (the CLI's exit 141)
        raise
    except TRANSPORT as e:
        raise failure(stage, e, left) from None


def daemon_key(c: docker.DockerClient) -> str:
    """A short name for the daemon c reaches, for per-daemon locks: a hash of the daemon's own ID
    (two addresses of one daemon share it, two daemons never do), or of its address where the
    daemon will not say."""
    try:
        ident = str(c.info().get("ID") or "")
    except TRANSPORT:  # the address stands in; a daemon gone fails the next call, in its stage
        ident = ""
    return hashlib.sha256((f"id:{ident}" if ident else f"address:{daemon_address()}").encode()).hexdigest()[:12]


def answers(c: docker.DockerClient) -> bool:
    try:
        return bool(c.ping())
    except TRANSPORT:  # any failure to reach it is the answer: no
        return False


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]


def ensure_engine(log: Callable[[str], None] = print) -> docker.DockerClient:
    """Run the project's engine setup (installs and starts dockerd as root on Debian), then connect;
    the first time in this process for this daemon, remove what runs killed before left on it."""
    try:
        c = client()
    except EnvironmentProblem:
        if os.environ.get("DOCKER_HOST"):
            raise  # a remote daemon is the user's to start
        log(f"no Docker daemon at {daemon_address()}: running {ENGINE_SCRIPT.name}")
        _engine_setup()
        c = client()
    else:
        if os.geteuid() == 0 and not os.environ.get("DOCKER_HOST"):
            # A local daemon can answer and still fail every container start (its bridge deleted
            # by another daemon, seen here): engine.sh checks that and restarts a dockerd it started.
            _engine_setup()
    swept(c, log)
    return c


_SWEPT: set[str] = set()  # the daemons this process has swept (containers.sweep), by address


def swept(c: docker.DockerClient, log: Callable[[str], None]) -> None:
    """containers.sweep, once per process and daemon: the containers of runs whose process is gone."""
    if daemon_address() in _SWEPT:
        return
    with calls("the removal of containers that killed runs left"):
        containers.sweep(c, log)
    _SWEPT.add(daemon_address())


# The host's architecture as uname names it, as Docker names it, and as QEMU's binfmt entry does.
HOST_PLATFORMS = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}
QEMU_NAMES = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}
BINFMT = Path("/proc/sys/fs/binfmt_misc")


def host_platform() -> str:
    return HOST_PLATFORMS.get(os.uname().machine, f"linux/{os.uname().machine}")


def emulated(platform: str) -> bool:
    """Whether images of this platform run here through QEMU rather than natively."""
    return platform != host_platform()


def emulation_ready(platform: str, binfmt: Path | None = None) -> bool:
    """QEMU registered for the platform with flag F: the kernel opened the emulator at
    registration, so it runs in every container and BuildKit step without a copy inside."""
    try:
        lines = ((binfmt or BINFMT) / f"qemu-{QEMU_NAMES[platform]}").read_text().splitlines()
    except (KeyError, OSError):
        return False
    flags = next((line.split(":", 1)[1] for line in lines if line.startswith("flags:")), "")
    return "enabled" in lines and "F" in flags


def ensure_emulation(platform: str, log: Callable[[str], None] = print) -> None:
    """A build or run of another architecture's image needs QEMU registered: as root, engine.sh
    installs and registers it (Debian); anyone else gets one line saying what to install."""
    if not emulated(platform) or emulation_ready(platform):
        return
    if platform not in QEMU_NAMES:
        raise EnvironmentProblem(f"{platform} images cannot be built on this {os.uname().machine} host")
    if os.geteuid() != 0:
        raise EnvironmentProblem(f"{platform} on this {host_platform()} host needs QEMU registered with binfmt_misc (flag F); "
                                 "as root: apt-get install qemu-user-static binfmt-support && update-binfmts --enable "
                                 "(or build on a native host)")
    log(f"{platform} on a {host_platform()} host: registering QEMU's emulator ({ENGINE_SCRIPT.name} --emulation)")
    _engine_setup("--emulation", QEMU_NAMES[platform])


def _engine_setup(*args: str) -> None:
    proc = subprocess.run(["bash", str(ENGINE_SCRIPT), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["engine setup failed"])[-1]
        raise EnvironmentProblem(last.removeprefix("engine: "))


@dataclass(frozen=True)
class BuildClient:
    """How to run a BuildKit build: the argv prefix and the environment it needs."""

    argv: tuple[str, ...]
    env: dict[str, str]
    description: str
    progress: str = "plain"  # BuildKit's --progress: "rawjson" where the client offers it (buildx >= 0.12)
    # "host" where the daemon's bridge reaches nothing outside (engine_current's, --iptables=false):
    # RUN steps then download on the host's network.
    network: str | None = None
    # "load": the image goes straight into the daemon. "oci": the containerd store with buildx
    # >= 0.13, where an OCI tarball with rewrite-timestamp (file times = SOURCE_DATE_EPOCH) is
    # loaded instead, so two builds of one commit give one digest; `--load` with
    # rewrite-timestamp fails there ("conflicts with unpack", moby/moby#51493).
    export: str = "load"
    driver: str | None = None  # buildx's builder driver: "docker" (the daemon's own BuildKit), "docker-container", ...


def _client_major(docker_bin: str) -> int | None:
    try:
        out = subprocess.run(
            [docker_bin, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        return int(out.split(".")[0]) if out else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def _buildx_version(docker_bin: str) -> tuple[int, int] | None:
    """(major, minor) of the client's buildx plugin ((0, 0) if it will not say); None without one."""
    try:
        proc = subprocess.run([docker_bin, "buildx", "version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    m = re.search(r"\bv?(\d+)\.(\d+)", proc.stdout)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def probe(docker_bin: str) -> BuildClient | None:
    """A BuildKit route through this client: buildx if present, else its built-in BuildKit.

    Docker CLIs from 23.0 on hand `DOCKER_BUILDKIT=1 docker build` to buildx and fail
    without it; older CLIs carry BuildKit themselves.
    """
    buildx = _buildx_version(docker_bin)
    if buildx is not None:
        progress = "rawjson" if buildx >= (0, 12) else "plain"
        return BuildClient((docker_bin, "buildx", "build", "--load"), {}, f"{docker_bin} buildx", progress)
    major = _client_major(docker_bin)
    if major is not None and major < 23:
        return BuildClient((docker_bin, "build"), {"DOCKER_BUILDKIT": "1"}, f"{docker_bin} (built-in BuildKit)")
    return None


def docker_cli(override: str | None = None) -> str:
    """The Docker CLI for commands that build nothing (run, save, import): --docker, then
    $PYTORCH_CUDA_DOCKER, then `docker` on PATH. A build needs build_client()'s BuildKit check too."""
    chosen = override or os.environ.get(DOCKER_ENV) or "docker"
    if not shutil.which(chosen):
        raise EnvironmentProblem(f"no Docker CLI {chosen!r} on PATH; install one, or point --docker / ${DOCKER_ENV} at one")
    return chosen  # as the user wrote it: messages then show the command they would type


def build_client(override: str | None = None) -> BuildClient:
    """The client to build with: --docker, then $PYTORCH_CUDA_DOCKER, then the first that works;
    its RUN steps' network from $PYTORCH_CUDA_BUILD_NETWORK."""
    network = os.environ.get(NETWORK_ENV) or None
    if network not in (None, "host"):
        raise EnvironmentProblem(f"${NETWORK_ENV} may be `host` or unset, not {network!r}")
    bc = replace(_build_client(override), network=network)
    if bc.argv[1:3] != ("buildx", "build"):
        return bc
    bc = replace(bc, driver=_buildx_driver(bc.argv[0]))
    if (_buildx_version(bc.argv[0]) or (0, 0)) >= (0, 13) and _cli_store(bc.argv[0]) == "containerd":
        bc = replace(bc, argv=tuple(a for a in bc.argv if a != "--load"), export="oci")
    return bc


def _buildx_driver(docker_bin: str) -> str | None:
    """The driver of buildx's current builder (`docker buildx inspect`), or None if it will not say."""
    try:
        out = subprocess.run([docker_bin, "buildx", "inspect"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^Driver:\s*(\S+)", out, re.M)
    return m.group(1) if m else None


def _cli_store(docker_bin: str) -> str:
    """image_store(), asked through the CLI (build_client has no SDK client)."""
    try:
        out = subprocess.run([docker_bin, "info", "--format", "{{json .DriverStatus}}"], capture_output=True, text=True, timeout=30).stdout
        status = json.loads(out or "[]") or []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return "classic"
    return _store(status)


def _build_client(override: str | None) -> BuildClient:
    chosen = override or os.environ.get(DOCKER_ENV)
    if chosen:
        path = shutil.which(chosen)
        found = probe(path) if path else None
        if not found:
            raise EnvironmentProblem(f"{chosen} cannot build with BuildKit (no buildx plugin, and its built-in builder is not BuildKit)")
        return found
    candidates = [p for p in (shutil.which("docker"), "/usr/bin/docker", "/usr/local/bin/docker") if p and Path(p).exists()]
    for path in dict.fromkeys(os.path.realpath(p) for p in candidates):
        found = probe(path)
        if found:
            return found
    raise EnvironmentProblem(
        f"no BuildKit-capable Docker client among {', '.join(candidates) or 'PATH'}: install the buildx plugin, "
        f"or point --docker / ${DOCKER_ENV} at a client that has BuildKit"
    )


def image_store(c: docker.DockerClient) -> str:
    """"containerd" where the daemon keeps images in containerd (Docker 29's default, an option
    from 24): an image ID is then its manifest or index digest, not its config digest. Else "classic"."""
    return _store(c.info().get("DriverStatus") or [])


def _store(driver_status: list) -> str:
    """The store named by `docker info`'s DriverStatus pairs."""
    return "containerd" if ["driver-type", "io.containerd.snapshotter.v1"] in [list(kv) for kv in driver_status] else "classic"


# The two ways a daemon hands out NVIDIA GPUs: `--gpus all` through the NVIDIA runtime, or a
# CDI device (Docker >= 25; what the NVIDIA Container Toolkit sets up with `nvidia-ctk cdi generate`).
GPUS_BY_RUNTIME = docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])
GPUS_BY_CDI = docker.types.DeviceRequest(driver="cdi", device_ids=["nvidia.com/gpu=all"])


def gpu_request(c: docker.DockerClient) -> docker.types.DeviceRequest | None:
    """How to give a container every GPU of this daemon, or None when it has none to give."""
    info = c.info()
    if "nvidia" in (info.get("Runtimes") or {}):
        return GPUS_BY_RUNTIME
    for folder in info.get("CDISpecDirs") or []:  # the daemon's own list (API >= 1.47); local daemons only
        for spec in sorted(Path(folder).glob("*")) if Path(folder).is_dir() else []:
            try:
                text = spec.read_text(errors="replace") if spec.suffix in (".yaml", ".yml", ".json") else ""
            except OSError:
                continue
            if re.search(r'"?kind"?\s*:\s*"?nvidia\.com/gpu"?', text):
                return GPUS_BY_CDI
    return None


def root_dir(c: docker.DockerClient) -> str:
    return c.info().get("DockerRootDir", "/var/lib/docker")


def build_env(bc: BuildClient) -> dict[str, str]:
    """The environment of a build: buildx passes SOURCE_DATE_EPOCH on to BuildKit (20.10's docker
    build ignores it)."""
    return {**os.environ, **bc.env, "SOURCE_DATE_EPOCH": str(REPRODUCIBLE_EPOCH)}
