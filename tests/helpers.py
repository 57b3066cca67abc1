"""Assertion helpers shared by the test tiers: show the command and its output on failure."""
from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.server
import io
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import types
import zipfile
from pathlib import Path
from typing import NoReturn

import docker.errors
import pytest
import requests

# One copy, shipped with the structure checks that need them too.
from pytorch_cuda_build.checks.support import run_image, shown  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


def missing(reason: str) -> NoReturn:
    """Something this test needs is not here (an image, a binary, a daemon of ours): a failure
    in CI, whose setup (`build.py selftest`) provides everything the suite needs, so a test
    there never passes by not running; a skip with the reason elsewhere.

    Not for skips by design (a test on request, a GPU test on a host without a GPU runtime,
    a platform the test cannot run on): those stay pytest.skip, with their stated reason."""
    from conftest import IN_CI

    if IN_CI:
        pytest.fail(f"CI must provide what this test needs, and it is missing: {reason}")
    pytest.skip(reason)


def require(condition: object, reason: str) -> None:
    """missing(reason) unless condition holds."""
    if not condition:
        missing(reason)


def needs_root(what: str) -> None:
    """what needs root on this host for the whole test: the running test must be marked `root`
    (tests/conftest.py then refuses it to any other user, and the GitHub workflow leaves the tier
    out by name). A test that is not marked fails here, as root too: the mark is its declaration."""
    from conftest import ROOT_MARKER, running_item

    item = running_item()
    if item is None or item.get_closest_marker(ROOT_MARKER) is None:
        pytest.fail(f"{what} needs root, and {getattr(item, 'nodeid', 'this test')} is not marked {ROOT_MARKER}: "
                    "mark it, so that a run without root leaves it out by name (docs/testing.md)")


def as_root(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """One command that needs root (a chown to another user, a mount), run directly as root, and
    through password-less sudo otherwise, as on a hosted runner; checked."""
    prefix: list[str] = []
    if os.geteuid() != 0:
        require(shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0,
                f"`{argv[0]}` needs root, and this user has no password-less sudo")
        prefix = ["sudo", "-n"]
    proc = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, shown(proc)
    return proc


def venv_tool(name: str) -> str:
    """A linter that comes with build.py's .venv (pytorch_cuda_build/requirements.txt), else from PATH."""
    found = Path(sys.executable).with_name(name)
    path = str(found) if found.exists() else shutil.which(name)
    if not path:
        pytest.fail(f"{name} missing: it comes with build.py's .venv (pytorch_cuda_build/requirements.txt)")
    return path


def project_copy(dest: Path) -> Path:
    """A throwaway copy of the project (committed inputs and code) that a test may break.

    Its .venv links to ours, so its build.py runs at once without a new virtualenv.
    """
    from pytorch_cuda_build.files import copy_project
    return copy_project(ROOT, dest)


# The default user's line in templates/finish.j2: the fault tests insert failing steps before it.
USER_LINE = "USER 1000:1000"


def insert_before_user(root: Path, steps: str) -> None:
    """Insert Dockerfile steps before the USER line of a project copy's finish.j2; a template
    without that line fails here, rather than leaving the copy unbroken and the test vacuous."""
    tpl = root / "templates" / "finish.j2"
    text = tpl.read_text()
    assert text.count(USER_LINE) == 1, f"{tpl} must have exactly one {USER_LINE!r} line"
    tpl.write_text(text.replace(USER_LINE, steps + "\n" + USER_LINE, 1))


@contextlib.contextmanager
def tmpfs(mnt: Path, size: str):
    """A real, small filesystem at mnt, to fill up, owned by this user: mounted as root (through
    sudo where this user is not root, as on a hosted runner)."""
    mnt.mkdir(parents=True, exist_ok=True)
    as_root("mount", "-t", "tmpfs", "-o", f"size={size},uid={os.geteuid()},gid={os.getegid()},mode=0755", "tmpfs", str(mnt))
    try:
        yield mnt
    finally:
        as_root("umount", str(mnt))


def fill(path: Path) -> None:
    """Write path until its filesystem has no free block left.

    Unbuffered on purpose: a buffered file keeps the tail that ENOSPC refused and raises again
    when it is closed, depending only on how the free space divides by the chunk size.
    """
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while f.write(b"\0" * chunk):
                    pass
            except OSError:
                pass
    assert os.statvfs(path).f_bavail == 0, f"{path}: the filesystem still has free blocks"


def code_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, line number of the opening fence) of each fenced block of a Markdown text,
    indented ones (in a list item) included, their indent taken off; ``` or ~~~, no nesting."""
    blocks, opened, lang, lines, first = [], None, "", [], 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if opened is None and stripped.startswith(("```", "~~~")):
            opened, indent, lang, lines, first = stripped[:3], len(line) - len(stripped), stripped[3:].strip(), [], number
        elif opened is not None and stripped.startswith(opened) and not stripped[3:].strip():
            body = (ln[indent:] if ln.startswith(" " * indent) else ln.lstrip() for ln in lines)
            blocks.append((lang, "".join(f"{ln}\n" for ln in body), first))
            opened = None
        elif opened is not None:
            lines.append(line)
    return blocks


def run_build_py(root: Path, *args: str, env: dict | None = None, timeout: int = 3600) -> subprocess.CompletedProcess:
    """Run a project's build.py with our virtualenv, as a user would."""
    import os
    import sys

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, str(root / "build.py"), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=root)


def run_cli(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """build.py's CLI run in this process against the project at root: what run_build_py
    checks, without a new interpreter importing the tool (about 1 s each).

    For usage errors and offline commands; run_build_py covers the entry point itself
    (build.py, its virtualenv). Exit code and both streams come back as from a process.
    """
    from unittest import mock

    from pytorch_cuda_build import cli

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # main() installs its own
    try:
        with mock.patch.dict(os.environ, env or {}), mock.patch.object(cli, "ROOT", Path(root)), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(list(args))
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return subprocess.CompletedProcess(["build.py", *args], rc, out.getvalue(), err.getvalue())


def one_error_line(proc: subprocess.CompletedProcess, code: int, says: str, prefix: str = "error: ",
                   only_line: bool = False) -> None:
    """proc failed as every user-facing path must: exit code `code`, exactly one line starting
    with `prefix` (build.py's "error: ", the image's "pytorch-cuda: error: ") that holds `says`,
    and no traceback. only_line: that line is all of stderr (the image's entrypoint refusing)."""
    assert proc.returncode == code, shown(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(prefix)]
    assert len(errors) == 1 and says in errors[0], shown(proc)
    assert "Traceback" not in proc.stderr, shown(proc)
    if only_line:
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(prefix), shown(proc)


def tree_snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---- containers that serve (sshd, JupyterLab, TensorBoard, training "nodes") ----------------
# Host networking and 127.0.0.1 only: each service gets a port of its own, and no test traffic
# leaves the loopback interface (ENVIRONMENT.md's network rule).

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(image: str, cmd: list[str], opts: tuple[str, ...] = ()):
    """`docker run -d --network host` of the image's entrypoint; yields the container ID and
    removes the container afterwards, whatever happened."""
    from pytorch_cuda_build.stages import gate

    proc = subprocess.run(["docker", "run", "-d", "--network", "host", "--label", f"{gate.RUN_LABEL}={gate.RUN_ID}",
                           "--label", "pytorch-cuda.test=service", *opts, image, *cmd],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, shown(proc)
    cid = proc.stdout.strip()
    try:
        yield cid
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=120)


def logs(cid: str) -> str:
    p = subprocess.run(["docker", "logs", cid], capture_output=True, text=True, timeout=60)
    return p.stdout + p.stderr


def wait_until(what: str, ready, cid: str | None = None, timeout: float = 120.0, alive=None):
    """Poll ready() until it returns something truthy; fail with the container's log if it exits or times out.

    alive: for a container Docker does not run (Podman's), a callable giving (running, log)."""
    import time

    def state() -> tuple[bool, str]:
        if alive:
            return alive()
        running = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", cid],
                                 capture_output=True, text=True).stdout.strip() == "true"
        return running, logs(cid)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ready()
        if got:
            return got
        if cid or alive:
            running, log = state()
            if not running:
                pytest.fail(f"{what}: the container stopped:\n{log[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"{what}: not ready after {timeout:.0f} s" + (f":\n{state()[1][-3000:]}" if cid or alive else ""))


def ssh(key: Path, port: int, *cmd: str, user: str = "trainer", known: Path, extra: tuple[str, ...] = ()):
    return subprocess.run(["ssh", "-i", str(key), "-p", str(port), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                           "-o", "StrictHostKeyChecking=accept-new", "-o", f"UserKnownHostsFile={known}",
                           "-o", "ConnectTimeout=10", *extra, f"{user}@127.0.0.1", *cmd],
                          capture_output=True, text=True, timeout=120)


def jupyter(port: int, token: str | None, path: str = "/api/status", **kw) -> requests.Response:
    headers = {"Authorization": f"token {token}"} if token else {}
    return requests.request(kw.pop("method", "GET"), f"http://127.0.0.1:{port}{path}", headers=headers, timeout=30, **kw)


def ssh_keypair(directory: Path, name: str = "id_ed25519") -> tuple[Path, str]:
    """A new ed25519 key pair (no passphrase); returns (private key path, public key line)."""
    directory.mkdir(parents=True, exist_ok=True)
    key = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"test-{name}", "-f", str(key)], check=True)
    return key, (directory / f"{name}.pub").read_text().strip()


def owned_by_image_user(path: Path) -> Path:
    """A host directory the image's user (uid 1000) can write, for a /workspace mount (chowned as
    root: through sudo where this user is not, as on a hosted runner)."""
    path.mkdir(parents=True, exist_ok=True)
    as_root("chown", "-R", "1000:1000", str(path))
    return path


def write_as_image_user(path: Path, text: str) -> None:
    """text into path as a file of the image's user (uid 1000, mode 644), in a folder that user
    owns (owned_by_image_user): written to a file of ours, then installed as root (through sudo
    where this user is not root, and may not write into that folder)."""
    with tempfile.NamedTemporaryFile("w", prefix="pytorch-cuda-for-1000-", delete=False) as f:
        f.write(text)
    try:
        as_root("install", "-o", "1000", "-g", "1000", "-m", "0644", f.name, str(path))
    finally:
        os.unlink(f.name)


def default_image() -> str:
    """The default row, built and tested by build.py (at once when it already is): pytorch-cuda:v2.7.
    Call it after the session's default_build fixture: that one forces --retest, so a module that
    came first without it would have the row's smoke and structure tests run twice (5 min).
    In the whole suite's second lane, the main lane's build is the session's: the image must be
    the one that build tested (main_lane_build), and nothing runs again."""
    record = main_lane_build()
    if record is not None:
        client = docker.from_env()
        try:
            found = client.images.get("pytorch-cuda:v2.7").id
        finally:
            client.close()
        assert found == record["image_id"], f"pytorch-cuda:v2.7 is {found}, not the main lane's tested {record['image_id']}"
        return "pytorch-cuda:v2.7"
    proc = run_build_py(ROOT, "--torch", "2.7", "--cuda", "12.1", "--quiet", timeout=5400)
    assert proc.returncode == 0, shown(proc)
    return "pytorch-cuda:v2.7"


def main_lane_build() -> dict | None:
    """In the whole suite's second lane (tooling/selftest.py), the record the main lane wrote of its
    default build (conftest.default_build): returncode, stdout, stderr, results, image_id. None in
    any other pytest, or where the main lane ended before it built the row (the lane then builds
    it itself)."""
    from pytorch_cuda_build.tooling.selftest import BUILT_ENV, LANE_ENV, SECOND

    built = os.environ.get(BUILT_ENV)
    if os.environ.get(LANE_ENV) != SECOND or not built or not Path(built).exists():
        return None
    text = Path(built).read_text()
    if not text:
        pytest.fail("the main lane's build of the default row did not finish: its output is in the main lane's")
    record = json.loads(text)
    if record["returncode"] != 0:
        pytest.fail("the main lane's build of the default row failed: its output is in the main lane's")
    return record


# Files that are private keys of the kinds an image could leak: OpenSSH's own format (ssh-keygen's
# default, sshd host keys) and PEM RSA/EC/DSA, found by how the file starts (ssh and gnutls carry
# the same text inside their binaries). Packages' test fixtures use PKCS#8 ("BEGIN PRIVATE KEY"),
# which is not searched for.
PRIVATE_KEYS = (b"-----BEGIN OPENSSH PRIVATE KEY-----", b"-----BEGIN RSA PRIVATE KEY-----",
                b"-----BEGIN EC PRIVATE KEY-----", b"-----BEGIN DSA PRIVATE KEY-----")
# Files that hold a secret by their name alone: ssh host keys, and Jupyter's runtime files and
# JSON configs, where a server's token or password hash lives.
SECRET_FILES = r"(^|/)ssh_host_[a-z0-9]+_key(\.pub)?$|(^|/)jupyter/runtime/|(^|/)jupyter_(server|notebook)_config\.json$"


def scan_layers(ref: str, needles: list[bytes], secret_names: str | None = None,
                heads: tuple[bytes, ...] = ()) -> tuple[int, list[str]]:
    """Stream `docker save` and search every file of every layer for the needles, every file
    name for the secret_names pattern, and every file's start for the heads (a key file
    begins with its PEM line; a binary that merely contains the text, like ssh-keygen, does not);
    return (layers read, hits).

    Both layouts: Docker < 25 writes <id>/layer.tar, Docker >= 25 an OCI layout whose layers
    are blobs/sha256/<digest> (the manifests and configs there are JSON, not tar, and skipped)."""
    import itertools
    import re
    import tarfile

    names = re.compile(secret_names) if secret_names else None
    chunk, keep = 16 * 1024 * 1024, max(len(n) for n in [*needles, b"-"])
    hits, layers = [], 0
    save = subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE)
    try:
        outer = tarfile.open(fileobj=save.stdout, mode="r|")
        for member in outer:
            if not member.isfile() or not (member.name.endswith("layer.tar") or member.name.startswith("blobs/sha256/")):
                continue
            try:
                inner = tarfile.open(fileobj=outer.extractfile(member), mode="r|*")
                entries = iter(inner)
                first = next(entries, None)
            except tarfile.ReadError:
                continue  # an OCI manifest, index or config blob
            layers += 1
            # Lazily: a streamed tar can only read a member's content before moving past it.
            for f in itertools.chain([first] if first else [], entries):
                if names and names.search(f.name):
                    hits.append(f"{member.name}:{f.name}")
                if not f.isfile():
                    continue
                fh, tail = inner.extractfile(f), b""
                first = True
                while block := fh.read(chunk):
                    if first and heads and block.lstrip().startswith(heads):
                        hits.append(f"{member.name}:{f.name}")
                        break
                    first = False
                    window = tail + block
                    if any(n in window for n in needles):
                        hits.append(f"{member.name}:{f.name}")
                        break
                    tail = window[-keep:]
    finally:
        save.stdout.close()
        save.wait()
    return layers, hits


# The environment `python3 build.py engine` prints for the current engine beside 20.10.
CURRENT_ENGINE_ENV = {"DOCKER_HOST", "PYTORCH_CUDA_DOCKER", "DOCKER_CONFIG", "PYTORCH_CUDA_BUILD_NETWORK",
                      "PYTORCH_CUDA_CONTAINER_DNS"}


def image_exists(client, ref: str) -> bool:
    """Whether the daemon behind the SDK client has ref (a name or an image ID)."""
    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def run_once(image: str, cmd: list[str], opts: tuple[str, ...] = (), timeout: int = 180) -> subprocess.CompletedProcess:
    """`docker run --rm` of image with opts before it and cmd after; its output captured."""
    return subprocess.run(["docker", "run", "--rm", *opts, image, *cmd], capture_output=True, text=True, timeout=timeout)


def build_small_oci(tmp: Path, ref: str, dockerfile: str, lock_sha256: str, platform: str = "linux/amd64",
                    labels: dict[str, str] | None = None, results: Path | None = None) -> str:
    """A small image built as build.py builds on the containerd store (Docker 26: the current
    engine's environment set): its files `file` beside the Dockerfile, an OCI export with
    build.py's export arguments (provenance, the lock label), then load_oci, which keeps the
    provenance in results if given. No RUN step: no emulation for another platform. Its image ID."""
    from pytorch_cuda_build.engine import docker_env  # the host package, imported where a docker test needs it
    from pytorch_cuda_build.stages import build

    ctx = tmp / ref.replace(":", "-").replace("/", "-")
    ctx.mkdir()
    (ctx / "file").write_text(f"{ref}\n")
    (ctx / "Dockerfile").write_text(dockerfile)
    bc = docker_env.build_client(None)
    assert bc.export == "oci", bc
    tarball = ctx / "image.oci.tar"
    label_args = [a for k, v in (labels or {}).items() for a in ("--label", f"{k}={v}")]
    proc = subprocess.run([*bc.argv, "--platform", platform, *label_args, "--tag", ref,
                           *build.oci_export_args(lock_sha256, tarball), str(ctx)],
                          capture_output=True, text=True, env=docker_env.build_env(bc), timeout=600)
    assert proc.returncode == 0, shown(proc)
    return build.load_oci(bc, tarball, ref, ctx / "load.log", results)


@contextlib.contextmanager
def current_engine(store: str = "containerd"):
    """`eval "$(python3 build.py engine)"`, as the README says: the environment it prints.
    An engine this started is stopped after, so the tests after it run beside one engine,
    as they do everywhere else."""
    import shlex

    from pytorch_cuda_build.tooling.selftest import ENGINE26, LANE_ENV, SECOND

    needs_root("starting a second engine (`build.py engine`)")
    if os.environ.get(LANE_ENV, SECOND) != SECOND:  # the other lane would stop it under this test, or this one under it
        pytest.fail(f"this test starts Docker 26 and is not marked {ENGINE26}: the whole suite runs such tests in the second lane")
    proc = run_build_py(ROOT, "engine", "--store", store, timeout=900)
    assert proc.returncode == 0, proc.stderr
    started = "starting dockerd" in proc.stderr
    env = {}
    for line in proc.stdout.splitlines():
        word, assignment = shlex.split(line)
        assert word == "export", line
        key, value = assignment.split("=", 1)
        env[key] = value
    assert set(env) == CURRENT_ENGINE_ENV, env
    try:
        yield env
    finally:
        if started:
            down = run_build_py(ROOT, "engine", "--store", store, "--down", timeout=300)
            assert down.returncode == 0, down.stderr


@contextlib.contextmanager
def containerd_client():
    """(an SDK client of Docker 26 with the containerd store, the environment that points at it),
    that environment set in os.environ meanwhile, as after `eval "$(python3 build.py engine)"`."""
    from pytorch_cuda_build.engine import docker_env  # the host package, imported where a docker test needs it

    with current_engine() as env, pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        c = docker_env.client()
        assert docker_env.image_store(c) == "containerd"
        try:
            yield c, env
        finally:
            c.close()


@contextlib.contextmanager
def store_restored(env: dict[str, str]):
    """The engine `env` points at (one `build.py engine` printed) left with what it held before:
    the images added meanwhile removed, the build cache pruned back to its size before (least
    recently used first). An on-request job leaves tens of GB in that store (a 10 GB row, its
    verify rebuild, 26 GB of cache), on the filesystem every later build's disk check reads."""
    client = docker.DockerClient(base_url=env["DOCKER_HOST"], timeout=600)
    try:
        held = {image.id for image in client.images.list(all=True)}
        cache = sum(r["Size"] for r in client.api.df().get("BuildCache") or [])
        yield
    finally:
        try:
            for image in client.images.list(all=True):
                if image.id not in held:
                    with contextlib.suppress(docker.errors.NotFound):  # gone with its parent meanwhile
                        client.images.remove(image.id, force=True)
            client.api.prune_builds(keep_storage=cache, all=True)  # 0 keeps nothing: it held none
        finally:
            client.close()


def config_of(c, image_id: str) -> str:
    """The config digest a registry's manifest names for a local image: its ID on the classic
    store, read from its manifest on the containerd store (whose IDs are manifest digests)."""
    from pytorch_cuda_build.engine import docker_env
    from pytorch_cuda_build.registry import zstd

    return zstd.config_digest(c, image_id) if docker_env.image_store(c) == "containerd" else image_id


def base_in_current_engine(current: dict[str, str], docker_client, row, tmp: Path) -> str:
    """The row's base rootfs in the current engine's store: built by mmdebstrap and loaded into 20.10
    if need be, then carried over with docker save | docker load. Its reference."""
    from pytorch_cuda_build.stages import base, render

    ref = render.base_ref(row)
    tmp.mkdir(exist_ok=True)
    base.ensure(docker_client, row, tmp, log=lambda m: None, docker_cli="/usr/bin/docker")
    env = {**os.environ, **current}
    if subprocess.run([current["PYTORCH_CUDA_DOCKER"], "image", "inspect", ref], env=env, capture_output=True).returncode == 0:
        return ref
    save = subprocess.Popen(["/usr/bin/docker", "save", ref], stdout=subprocess.PIPE)
    load = subprocess.run([current["PYTORCH_CUDA_DOCKER"], "load"], stdin=save.stdout, env=env, capture_output=True, text=True)
    save.stdout.close()
    assert save.wait() == 0 and load.returncode == 0, load.stderr
    return ref


# ---- an image as Docker 26's `docker save` writes it on the containerd store ---------------------

def oci_export(layers: list[bytes], *, media: str = "oci", first: str = "", labels: dict | None = None):
    """A small image's export, made here: the layers (tar bytes) gzip-compressed, a config naming
    their diff IDs, a manifest (OCI's, or Docker's with media="docker"), and the tar Docker 26
    writes (blobs/sha256/*, in digest order, or the blob `first` names first; index.json,
    manifest.json, oci-layout). The image ID is the manifest's digest, as on that store.
    A namespace of image_id, config (digest), tar, blobs (digest: bytes) and layers (the gzip digests)."""

    def digest(raw: bytes) -> str:
        return "sha256:" + hashlib.sha256(raw).hexdigest()

    docker_media = media == "docker"
    gz = [gzip.compress(layer, mtime=0) for layer in layers]
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Labels": labels or {}},
                         "rootfs": {"type": "layers", "diff_ids": [digest(layer) for layer in layers]},
                         "history": [{"created_by": f"layer {i}"} for i in range(len(layers))]}).encode()
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json" if docker_media else "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json" if docker_media else "application/vnd.oci.image.config.v1+json",
                   "digest": digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip" if docker_media else "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": digest(g), "size": len(g)} for g in gz]}).encode()
    blobs = {digest(b): b for b in [config, manifest, *gz]}
    order = sorted(blobs, key=lambda d: (d != first, d))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for d in order:
            add("blobs/sha256/" + d.removeprefix("sha256:"), blobs[d])
        add("index.json", json.dumps({"schemaVersion": 2, "manifests": [{"digest": digest(manifest), "size": len(manifest)}]}).encode())
        add("manifest.json", b"[]")
        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
    return types.SimpleNamespace(image_id=digest(manifest), config=digest(config), tar=out.getvalue(), blobs=blobs,
                                 layers=[digest(g) for g in gz])


def layer_tar(files: dict[str, bytes]) -> bytes:
    """A layer's uncompressed tar holding these files."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


class ExportingEngine:
    """The Docker SDK's get_image (an image's export in chunks) for the images given, counting
    the chunks sent: a reader that stops early is seen to."""

    def __init__(self, exports: dict[str, bytes]):
        self.exports, self.sent, self.closed = exports, 0, 0
        self.api = self

    def get_image(self, image_id: str, chunk_size: int = 2 << 20):
        if image_id not in self.exports:
            response = requests.Response()
            response.status_code = 404
            raise docker.errors.ImageNotFound(f"No such image: {image_id}", response=response, explanation=f"No such image: {image_id}")
        data = self.exports[image_id]

        def chunks():
            try:
                for i in range(0, len(data), 4096):
                    self.sent += 1
                    yield data[i:i + 4096]
            finally:
                self.closed += 1
        return chunks()


# ---- tiny wheels, made here -----------------------------------------------------------------

def make_wheel(house: Path, name: str, version: str, files: dict[str, str]) -> str:
    """A pure wheel of `files` (path in site-packages -> text) in house; its sha256."""
    dist = f"{name}-{version}.dist-info"
    files = {**files, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def row(path: str, text: str) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(text.encode())}"

    record = "\n".join([*(row(p, t) for p, t in files.items()), f"{dist}/RECORD,,"]) + "\n"
    path = house / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in {**files, f"{dist}/RECORD": record}.items():
            z.writestr(zipfile.ZipInfo(p, date_time=(2026, 1, 1, 0, 0, 0)), t)
    return hashlib.sha256(path.read_bytes()).hexdigest()


class NamesOnlyStore:
    """A store that holds every locked file, and stages each as an empty file of its name: what a
    build's context looks like, for unit tests that must not download gigabytes (stages/fetch.py)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.staged: list[tuple[str, Path]] = []

    def missing(self, items):
        return []

    def stage(self, item, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(b"")
        self.staged.append((item.sha256, dest))


def clone_at(dest: Path, commit: str) -> Path:
    """A clone of this checkout at commit, with this checkout's .venv: builds from it name that commit
    (never `-dirty`), whatever changes here meanwhile."""
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(dest)], check=True)
    subprocess.run(["git", "-C", str(dest), "checkout", "--quiet", commit], check=True)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    return dest


class _Gone(http.server.BaseHTTPRequestHandler):
    """Every address answers 404, a plain request or a tunnel to an HTTPS host alike; each is noted."""

    def _gone(self) -> None:
        self.server.asked.append(f"{self.command} {self.path}")  # type: ignore[attr-defined]
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_CONNECT = _gone

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def sources_gone():
    """A proxy on 127.0.0.1 for which every mirror and index has dropped everything, and the
    environment that sends a tool's downloads through it: (server, env); server.asked lists them."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Gone)
    server.asked = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = f"http://127.0.0.1:{server.server_address[1]}"
    env = {"http_proxy": proxy, "https_proxy": proxy, "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "no_proxy": "", "NO_PROXY": ""}
    try:
        yield server, env
    finally:
        server.shutdown()
        server.server_close()


def debian_suite(mirror: str, name: str, stanzas: list[str], arch: str = "amd64"):
    """A suite as apt keeps it in its lists, from Packages stanzas: an InRelease (clearsigned in
    form; apt checks the signature only when it downloads one) naming the index by its hash and size."""
    from pytorch_cuda_build.resolve import debian

    text = "\n".join(stanzas)
    data = lzma.compress(text.encode())
    release = (f"Origin: Debian\nLabel: Debian\nSuite: {name}\nCodename: {name}\nDate: Sat, 11 Jul 2026 10:16:37 UTC\n"
               f"Architectures: {arch}\nComponents: main\nSHA256:\n"
               f" {hashlib.sha256(text.encode()).hexdigest()} {len(text.encode())} main/binary-{arch}/Packages\n"
               f" {hashlib.sha256(data).hexdigest()} {len(data)} main/binary-{arch}/Packages.xz\n")
    signed = ("-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA512\n\n" + release +
              "-----BEGIN PGP SIGNATURE-----\n\niQ==\n-----END PGP SIGNATURE-----\n").encode()
    return debian.Suite(mirror, name, arch, signed, data, hashlib.sha256(data).hexdigest())
