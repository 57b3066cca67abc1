"""The fault-injection tier, on request (PYTORCH_CUDA_TEST_FAULTS=1): faults injected for real into the
README's build line, its publish and `lock`, each followed by the same command run again.

- SIGKILL of the run's process group (what the OOM killer or a CI runner's last resort does) at each
  stage (fetch's into an empty store of the run's own, mid-download): KILLS below, one row per stage, each found from the run's own output (its console lines, or
  BuildKit's steps in build.log, which the run streams there);
- the Docker daemon killed while the smoke suite runs (the 20.10 daemon, restarted after: `alone`);
- the state directory's disk filling during the build and the ops export (a small tmpfs);
- the local registry stopped in the middle of a push;
- the package index unreachable in the middle of a download (`lock`, through a relay on 127.0.0.1).

After each fault, three things hold (after_fault, rerun):
- no public tag and no registry tag names an image that did not pass its tests here;
- no file under images/ or the state directory is half-written;
- the same command run again passes, and leaves nothing of the failed run behind (its containers,
  its ops export, its pushes' local names).

Every scenario runs in a throwaway copy of the project publishing as pytorch-cuda-fault
(test_faults.fault_copy), whose layers are the session's default build (`built`): a scenario
builds only the steps it adds. Not in this project's CI: each scenario runs the row's gate or a
push of the 6.5 GB image at least twice (about 60 min for the tier on 2 cores, an estimate from
the gate's 158-308 s and the session push's 287 s, docs/measurements/ci-time.md); the GitHub
workflow's weekly schedule runs it (job `fault-injection`).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
from conftest import STATE_DIR
from test_faults import FAULT_REPO, built, error_lines, fault_copy, fault_tags, our_daemon, public_tags  # noqa: F401 (built: a fixture)

from pytorch_cuda_build import ca, paths
from pytorch_cuda_build.buildkit import opsseed
from pytorch_cuda_build.engine import containers
from pytorch_cuda_build.stages import fetch, tag

from helpers import fill, needs_root, tmpfs, tree_snapshot
from registry import LocalRegistry, require_binary

FAULTS_ENV = "PYTORCH_CUDA_TEST_FAULTS"
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.fault, pytest.mark.usefixtures("built"),
              pytest.mark.skipif(os.environ.get(FAULTS_ENV) != "1",
                                 reason=f"the fault-injection tier, on request: {FAULTS_ENV}=1 (docs/faults.md)")]

ROW = ("--torch", "2.7", "--cuda", "12.1")


# ---- a run of build.py, followed line by line ----------------------------------------------------


class Run:
    """build.py in its own process group (as a terminal or a CI runner starts it), its stderr read as
    it comes, so that a scenario can wait for the line that says a stage is under way. One thread
    reads each pipe to its end: nothing else may read them (communicate() would take the last
    lines, the error line among them, from under the stderr reader)."""

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None):
        self.root, self.lines, self._out = root, [], []
        self.proc = subprocess.Popen([sys.executable, str(root / "build.py"), *args], cwd=root, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     env={**os.environ, **(env or {})})  # no terminal: the CI console's lines
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stderr, self.lines), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stdout, self._out), daemon=True)]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(pipe, into: list[str]) -> None:
        for line in pipe:
            into.append(line.rstrip("\n"))

    @property
    def err(self) -> str:
        return "\n".join(self.lines)

    @property
    def out(self) -> str:
        return "\n".join(self._out)

    def wait_for(self, pattern: str, where: Path | None = None, timeout: float = 1800) -> None:
        """Until pattern (a regular expression) matches a line of stderr, or of the file `where`."""
        deadline = time.monotonic() + timeout
        found = re.compile(pattern, re.M)
        while time.monotonic() < deadline:
            text = where.read_text(errors="replace") if where is not None and where.exists() else self.err
            if found.search(text):
                return
            if self.proc.poll() is not None:
                self._drained(5)
                pytest.fail(f"build.py ended (exit {self.proc.returncode}) before {pattern!r} showed up:\n{self.err[-4000:]}")
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"{pattern!r} did not show up within {timeout:.0f} s:\n{self.err[-4000:]}")

    def kill(self) -> None:
        """SIGKILL to the whole group (build.py, its docker CLIs, its pytest), then reaped."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.finish(timeout=120)

    def finish(self, timeout: float = 3600) -> int:
        self.proc.wait(timeout=timeout)
        self._drained(30)
        return self.proc.returncode

    def _drained(self, timeout: float) -> None:
        for reader in self.readers:
            reader.join(timeout)


def build_py(root: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 3600) -> Run:
    run = Run(root, *args, env=env)
    run.finish(timeout)
    return run


# ---- what holds after a fault, and after the run again ---------------------------------------------


def passed_here(image_id: str) -> bool:
    return tag.passed(image_id) is not None  # the session's state directory, which build.py shares


def registry_tags(reg: LocalRegistry, repo: str) -> dict[str, tuple[str, str]]:
    """tag -> (its manifest digest, the config digest it names), in reg: the image ID is the config
    digest on the classic store, the manifest digest on the containerd store."""
    try:
        with urllib.request.urlopen(f"http://{reg.host}/v2/{repo}/tags/list", timeout=30) as r:
            names = json.loads(r.read()).get("tags") or []
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return {}
        raise
    found = {t: reg.manifest(repo, t) for t in names}
    return {t: vouched_for(reg, repo, t, *m) for t, m in found.items() if m}


# The referrers tag schema (OCI distribution 1.1), for a registry without the referrers API:
# `sha256-<hex>` is the index of what is attached to the image sha256:<hex>, `sha256-<hex>.sbom` and
# `sha256-<hex>.inputs` are publish's attachments to it (registry/attach.py).
REFERRERS_TAG = re.compile(r"sha256-([0-9a-f]{64})(\.[a-z]+)?")


def vouched_for(reg: LocalRegistry, repo: str, tag: str, digest: str, manifest: dict) -> tuple[str, str]:
    """(manifest digest, config digest) of the image a tag stands for: its own, or, for a tag of the
    referrers tag schema, its subject's, which must be in the registry too (and be the one an
    attachment's own `subject` names)."""
    schema = REFERRERS_TAG.fullmatch(tag)
    if schema is None and "subject" not in manifest:
        return digest, manifest.get("config", {}).get("digest", "")
    subject_digest = manifest["subject"]["digest"] if "subject" in manifest else f"sha256:{schema[1]}"
    assert schema is None or subject_digest == f"sha256:{schema[1]}", f"{tag} is attached to {subject_digest}"
    subject = reg.manifest(repo, subject_digest)
    assert subject is not None, f"{tag} stands for {subject_digest}, which {reg.host}/{repo} does not hold"
    return subject[0], subject[1].get("config", {}).get("digest", "")


def after_fault(client, root: Path, images_before: dict[str, bytes], public_before: dict, reg: LocalRegistry | None = None) -> None:
    """No tag names an untested image; nothing under images/ or the state directory is half-written."""
    for ref in fault_tags(client):
        image_id = client.images.get(ref).id
        assert passed_here(image_id), f"{ref} names {image_id}, which never passed its tests"
    assert public_tags(client) == public_before, "the public pytorch-cuda tags moved"
    if reg is not None:
        for t, ids in registry_tags(reg, f"ml/{FAULT_REPO}").items():
            assert any(map(passed_here, ids)), f"{reg.host}/ml/{FAULT_REPO}:{t} names {ids}, which never passed its tests"
    assert tree_snapshot(root / "images") == images_before, "a file under images/ changed"
    assert_state_whole()


def assert_state_whole() -> None:
    """Every record of the state directory reads whole: each JSON parses, each ops-seed pointer is a key."""
    for path in STATE_DIR.rglob("*.json"):
        json.loads(path.read_text())
    for pointer in ops_pointers(STATE_DIR):
        assert re.fullmatch(r"[0-9a-f]{64}\n", pointer.read_text()), pointer


def ops_pointers(state: Path) -> list[Path]:
    """The ops seed's pointers (an image's name -> the key of its entry) in a state directory, of every kind."""
    seed = state / opsseed.CONTEXT_DIR
    return [p for kind in opsseed.KINDS.values() for p in (seed / kind[1]).glob("*") if p.is_file() and not p.name.startswith(".")]


def left_by(client, pid: int) -> list[str]:
    """What a run of that process left: its containers, its ops exports, temp files in the state directory."""
    found = [c.name for c in client.containers.list(all=True, filters={"label": f"{containers.PID_LABEL}={pid}"})]
    found += [str(p) for p in (STATE_DIR / "ops-seed").glob(f".export-{pid}-*")]
    return found + [str(p) for p in STATE_DIR.rglob("*.tmp")]


def rerun(client, root: Path, killed: Run, *args: str, reg: LocalRegistry | None = None, env: dict[str, str] | None = None) -> Run:
    """The same command again: it passes, tags only a tested image, and leaves nothing of `killed`."""
    again = build_py(root, *args, env=env)
    assert again.proc.returncode == 0, f"{again.err[-4000:]}\n{again.out[-2000:]}"
    assert left_by(client, killed.proc.pid) == []
    for ref in fault_tags(client):
        assert passed_here(client.images.get(ref).id), ref
    if reg is not None:
        assert not [t for img in client.images.list() for t in img.tags if t.startswith(reg.host)], "a push's local name was left"
        for t, ids in registry_tags(reg, f"ml/{FAULT_REPO}").items():
            assert any(map(passed_here, ids)), t
    assert_state_whole()
    return again


# ---- SIGKILL at each stage -------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """Where a SIGKILL lands: the command, the line that says the stage is under way (a regular
    expression on stderr, or on build.log where in_build_log), and how long after it."""

    args: tuple[str, ...]
    marker: str
    in_build_log: bool = False
    after: float = 2.0
    steps: str = ""  # Dockerfile steps inserted before the image's USER line ({token}: this run's)
    ops: bool = False  # the ops step made to run again (a token in it; a sleep, so the kill lands inside it)
    tested_first: bool = False  # the copy's row built and tested before the run that is killed
    untagged_first: bool = False  # and its public tags removed, so the tag stage has work to do
    registry: bool = False  # the command pushes to a registry of the test's own
    empty_store: bool = False  # the run's store is one of its own, empty, so fetch downloads (gigabytes) when the kill lands


# One row per stage, in the pipeline's order (stages/__init__.py); a new stage is one more row.
KILLS = {
    # 1 lock: while uv resolves the row against the index (inputs.relock writes every file at the end)
    "lock": Kill(("lock", "--upgrade", *ROW), r"^==> resolving ", after=3.0),
    # 3 fetch: while the row's files download into an empty store (a file enters it only whole)
    "fetch": Kill((*ROW, "--no-test"), r"^==> fetch: .* into the store ", after=5.0, empty_store=True),
    # 4 build: while a RUN step of the image runs (BuildKit's client dies with the group)
    "build": Kill((*ROW, "--no-test"), r"RUN sleep 60 # {token}", in_build_log=True, steps="RUN sleep 60 # {token}"),
    # 4 build, the DeepSpeed ops' step (its cache mount is where a half-done compile would stay)
    "ops compile": Kill((*ROW, "--no-test"), r": {token} && python /opt/pytorch-cuda/opsbuild.py", in_build_log=True,
                        after=20.0, ops=True),
    # 5 gate: while the smoke suite runs in its container (found by its owner label, below)
    "gate": Kill((*ROW, "--retest"), r"^==> smoke suite: "),
    # 8 tag: as the stage before it ends; the tag moves come within milliseconds after
    "tag": Kill(ROW, r"^==> vulnerabilities: [\d.]+s$", after=0.0, tested_first=True, untagged_first=True),
    # 9 publish: in the middle of the push of the 6.5 GB image
    "publish": Kill((*ROW, "--push", "--registry", "{registry}"), r"^==> pushing ", after=5.0, tested_first=True, registry=True),
}


@pytest.fixture
def empty_registry(tmp_path):
    """A registry of the scenario's own, empty, so that its push is a whole one (minutes), not blobs already there."""
    require_binary()
    reg = LocalRegistry(tmp_path / "registry").start()
    yield reg
    reg.stop()


def prepared(kill: Kill, tmp: Path, client, reg: LocalRegistry) -> tuple[Path, tuple[str, ...], str]:
    """The project copy for a scenario, its command with this run's values, and this run's token."""
    token = uuid.uuid4().hex
    root = fault_copy(tmp / "p", client, kill.steps.format(token=token), commit=kill.registry)
    if kill.ops:
        tpl = root / "templates" / "ops_builder.j2"
        text = tpl.read_text()
        assert text.count("    python /opt/pytorch-cuda/opsbuild.py ") == 1, "the ops step's line moved: update this scenario"
        tpl.write_text(text.replace("    python /opt/pytorch-cuda/opsbuild.py ", f"    sleep 30 && : {token} && python /opt/pytorch-cuda/opsbuild.py "))
        from pytorch_cuda_build import matrix
        from pytorch_cuda_build.stages import render
        m = matrix.load(root / "matrix.yaml")
        render.write(root, m, list(m.images), log=lambda s: None)
    if kill.tested_first:
        first = build_py(root, *ROW, "--quiet")
        assert first.proc.returncode == 0, first.err[-4000:]
    if kill.untagged_first:
        for ref in fault_tags(client):
            client.images.remove(ref, noprune=True)
    return root, tuple(a.format(registry=reg.address("ml")) for a in kill.args), token


@pytest.mark.parametrize("stage", list(KILLS))
def test_sigkill_at_each_stage_leaves_nothing_untested_or_half_written_and_the_rerun_passes(
        stage, docker_client, empty_registry, tmp_path):
    kill = KILLS[stage]
    root, args, token = prepared(kill, tmp_path, docker_client, empty_registry)
    images_before, public_before = tree_snapshot(root / "images"), public_tags(docker_client)
    store = tmp_path / "store"
    env = {"PYTORCH_CUDA_STORE": str(store)} if kill.empty_store else None
    run = Run(root, *args, env=env)
    log = root / "build-results" / "2.7.1-cuda12.1-runtime" / "build.log"
    run.wait_for(kill.marker.replace("{token}", token), where=log if kill.in_build_log else None)
    if stage == "gate":  # the smoke container is up, and labelled with its owner
        deadline = time.monotonic() + 300
        while not docker_client.containers.list(filters={"label": [f"{containers.PID_LABEL}={run.proc.pid}", "pytorch-cuda.test=smoke"]}):
            assert time.monotonic() < deadline and run.proc.poll() is None, run.err[-3000:]
            time.sleep(0.5)
    time.sleep(kill.after)
    run.kill()
    assert run.proc.returncode == -signal.SIGKILL, run.err[-3000:]
    left = docker_client.containers.list(all=True, filters={"label": f"{containers.PID_LABEL}={run.proc.pid}"})
    if stage == "gate":
        assert left, "the killed run's smoke container should still be there for the next run to remove"
    after_fault(docker_client, root, images_before, public_before, empty_registry if kill.registry else None)
    if kill.empty_store:  # what entered the store is whole and the lock's; the rest waits in partial/ for the rerun
        assert all(fetch.file_sha256(blob) == blob.name for blob in store.glob("sha256/*"))
    again = rerun(docker_client, root, run, *args, reg=empty_registry if kill.registry else None, env=env)
    if left:  # the Done-when of issue 61: the next run removes the killed run's container and says so
        said = [ln for ln in again.lines if "of runs whose process is gone" in ln]
        assert len(said) == 1 and f"pid {run.proc.pid} " in said[0] and all(c.name in said[0] for c in left), again.err[-3000:]
    if stage == "lock":
        check = build_py(root, "lock", "--check", *ROW)  # the row's: matrix.yaml's one index line moved every row's inputs
        assert check.proc.returncode == 0, check.err


# ---- the daemon killed during the gate ------------------------------------------------------------


@pytest.mark.alone
@pytest.mark.root  # kills root's dockerd, and restarts it
def test_the_daemon_killed_during_the_gate_is_one_line_and_the_rerun_removes_its_container(docker_client, daemon_alone, tmp_path):
    """The issue's own case: the daemon dies while the smoke suite runs. One line naming the gate (it
    was a ChunkedEncodingError traceback from gate._wait), exit 2, no tag moved; the next run, with
    the daemon back, removes the container and passes."""
    ours = our_daemon()
    if ours is None or not ours[0].exists():
        pytest.skip("the daemon is not one that engine.sh or `build.py engine` starts: not ours to kill")
    pidfile, restart = ours
    needs_root("killing dockerd")  # the tier is asked for: it may kill this machine's dockerd, and restarts it
    root = fault_copy(tmp_path / "p", docker_client)
    images_before, public_before = tree_snapshot(root / "images"), public_tags(docker_client)
    run = Run(root, *ROW, "--retest")
    run.wait_for(r"^==> smoke suite: ")
    deadline = time.monotonic() + 300
    while not docker_client.containers.list(filters={"label": [f"{containers.PID_LABEL}={run.proc.pid}", "pytorch-cuda.test=smoke"]}):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.err[-3000:]
        time.sleep(0.5)
    time.sleep(10)  # into the suite
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    try:
        rc = run.finish(timeout=600)
        assert rc == 2, run.err[-3000:]
        lines = error_lines(run.err)
        assert len(lines) == 1 and "stopped answering during the gate" in lines[0] and "no tag was moved" in lines[0], run.err
        assert "Traceback" not in run.err
    finally:
        up = subprocess.run(restart, capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, up.stdout + up.stderr
    after_fault(docker_client, root, images_before, public_before)
    left = docker_client.containers.list(all=True, filters={"label": f"{containers.PID_LABEL}={run.proc.pid}"})
    again = rerun(docker_client, root, run, *ROW, "--retest")
    if left:
        assert any("of runs whose process is gone" in ln and f"pid {run.proc.pid} " in ln for ln in again.lines), again.err[-3000:]


# ---- the disk filling -------------------------------------------------------------------------------


def test_the_state_disk_filling_during_the_build_and_the_export_is_one_line_and_the_rerun_passes(docker_client, tmp_path):
    """The state directory on a small filesystem that fills while the image builds: the ops export
    after the build (and the records a run writes there) meet a full disk. One line, exit 2, no
    tag moved, no half export left; with room again, the same command passes."""
    token = uuid.uuid4().hex
    root = fault_copy(tmp_path / "p", docker_client, f"RUN sleep 20 # {token}")
    images_before, public_before, tags_before = tree_snapshot(root / "images"), public_tags(docker_client), fault_tags(docker_client)
    # Room for the ops export once the filler is gone; 1 GiB of RAM while it is there.
    with tmpfs(tmp_path / "small", "1g") as mnt:
        # The store stays where the session's build filled it: a store on the small disk would fill at
        # the fetch (one line too: tests/unit/test_store.py), before the build this scenario is about.
        env = {"PYTORCH_CUDA_STATE": str(mnt / "state"), "PYTORCH_CUDA_STORE": str(paths.STORE_DIR)}
        run = Run(root, *ROW, "--no-test", env=env)
        run.wait_for(rf"RUN sleep 20 # {token}", where=root / "build-results" / "2.7.1-cuda12.1-runtime" / "build.log")
        fill(mnt / "filler")
        rc = run.finish()
        assert rc == 2, run.err[-3000:]
        lines = error_lines(run.err)
        assert len(lines) == 1 and "no space left on device" in lines[0] and "Traceback" not in run.err, run.err[-3000:]
        assert not list((mnt / "state").rglob(".export-*")) and not list((mnt / "state").rglob("*.tmp"))
        assert fault_tags(docker_client) == tags_before and public_tags(docker_client) == public_before
        assert tree_snapshot(root / "images") == images_before
        (mnt / "filler").unlink()
        again = build_py(root, *ROW, "--no-test", env=env)
        assert again.proc.returncode == 0, again.err[-3000:]
        pointers = ops_pointers(mnt / "state")
        assert pointers and all(re.fullmatch(r"[0-9a-f]{64}\n", p.read_text()) for p in pointers), pointers
        assert not list((mnt / "state").rglob(".export-*"))


# ---- the registry stopped mid-push ----------------------------------------------------------------


def test_the_registry_stopped_in_the_middle_of_a_push_leaves_its_tags_on_tested_images(docker_client, empty_registry, tmp_path):
    root = fault_copy(tmp_path / "p", docker_client, commit=True)
    first = build_py(root, *ROW, "--quiet")
    assert first.proc.returncode == 0, first.err[-3000:]
    images_before, public_before = tree_snapshot(root / "images"), public_tags(docker_client)
    args = (*ROW, "--push", "--registry", empty_registry.address("ml"), "--retries", "2")
    run = Run(root, *args, env={"PYTORCH_CUDA_RETRY_BACKOFF": "0.2"})
    run.wait_for(r"^==> pushing ")
    time.sleep(5)
    empty_registry.stop()  # SIGKILL: an outage, not a shutdown
    rc = run.finish()
    empty_registry.start()
    assert rc == 1, run.err[-3000:]
    lines = error_lines(run.err)
    assert len(lines) == 1 and "stopped at" in lines[0] and "Traceback" not in run.err, run.err[-3000:]
    after_fault(docker_client, root, images_before, public_before, empty_registry)
    rerun(docker_client, root, run, *args, reg=empty_registry)
    image_id = docker_client.images.get(fault_tags(docker_client)[0]).id
    assert all(image_id in ids for ids in registry_tags(empty_registry, f"ml/{FAULT_REPO}").values())


# ---- the index unreachable mid-download -----------------------------------------------------------


class Relay(BaseHTTPRequestHandler):
    """The package index on 127.0.0.1: each request relayed to pypi.org (its files' URLs rewritten to
    come through here too), until `cut_after` files have been served; the next is cut in the middle
    and the relay then stops answering at all."""

    upstream = "https://pypi.org"
    files = "https://files.pythonhosted.org"
    cut_after = 40
    served = 0
    cut = threading.Event()
    verify: str | bool = True

    def _upstream(self) -> str:
        return (self.files + self.path.removeprefix("/files")) if self.path.startswith("/files/") else self.upstream + self.path

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        """uv asks a file's size first (to read a wheel's metadata by ranges): the answer with no
        Accept-Ranges, so that it downloads each file whole, through do_GET."""
        r = requests.head(self._upstream(), headers={"Accept": self.headers.get("Accept", "*/*")}, verify=self.verify, timeout=60,
                          allow_redirects=True)
        self.send_response(r.status_code)
        for name in ("Content-Type", "Content-Length"):
            if name in r.headers:
                self.send_header(name, r.headers[name])
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        r = requests.get(self._upstream(), headers={"Accept": self.headers.get("Accept", "*/*")}, verify=self.verify, timeout=60)
        body = r.content.replace(self.files.encode(), f"http://{self.server.server_address[0]}:{self.server.server_address[1]}/files".encode())
        self.send_response(r.status_code)
        self.send_header("Content-Type", r.headers.get("Content-Type", "application/octet-stream"))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.path.startswith("/files/"):
            type(self).served += 1
            if type(self).served > self.cut_after:
                self.wfile.write(body[: len(body) // 2])  # half of it, then the connection is gone
                type(self).cut.set()
                self.close_connection = True
                return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # uv gave up on this relay: nothing to answer
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.network
def test_the_index_unreachable_in_the_middle_of_a_download_changes_no_lock(docker_client, tmp_path):
    """`lock --upgrade` of the row against an index that stops in the middle of a file: one line,
    images/ as it was; with the index back, the same command passes and `lock --check` agrees."""
    root = fault_copy(tmp_path / "p", docker_client)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    Relay.verify = ca.ca_bundle(None) or True
    port = server.server_address[1]
    mp = root / "matrix.yaml"
    text = mp.read_text()
    assert text.count("index: https://pypi.org/simple") == 1
    mp.write_text(text.replace("index: https://pypi.org/simple", f"index: http://127.0.0.1:{port}/simple"))
    images_before = tree_snapshot(root / "images")
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    run = Run(root, "lock", "--upgrade", *ROW)
    assert Relay.cut.wait(900), f"the relay never cut a download: {run.err[-3000:]}"
    server.shutdown()
    server.server_close()  # from now on nothing answers at that address
    rc = run.finish(timeout=900)
    assert rc in (1, 2), run.err[-3000:]
    lines = error_lines(run.err)
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "Traceback" not in run.err, run.err[-3000:]
    assert tree_snapshot(root / "images") == images_before and not list((root / "images").rglob("*.tmp"))
    Relay.served, Relay.cut_after = 0, 10**9
    Relay.cut.clear()
    server = ThreadingHTTPServer(("127.0.0.1", port), Relay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        again = build_py(root, "lock", "--upgrade", *ROW)
        assert again.proc.returncode == 0, again.err[-3000:]
        check = build_py(root, "lock", "--check", *ROW)  # the row's: matrix.yaml's one index line moved every row's inputs
        assert check.proc.returncode == 0, check.err
        assert not list((root / "images").rglob("*.tmp"))
    finally:
        server.shutdown()
        server.server_close()
    shutil.rmtree(root / "build-results", ignore_errors=True)
