"""The default row's image under Podman (Debian's 4.3.1), rootless, as under Docker: the banner,
the CPU half of the smoke suite, and the sshd and Jupyter modes with real clients.

Rootless: a user of this test's own, with a subordinate uid and gid range, its own storage
(native overlay) and XDG_RUNTIME_DIR, removed afterwards with everything it stored. The image
reaches it as the session's OCI layout (`podman pull oci:...`), the same bytes the daemon holds.

Two things are this VM's, not the image's, and are passed as such:
- it refuses the raised hard rlimits Podman asks for by default ("error setting rlimit type 7"):
  explicit low `--ulimit` values;
- /dev/net/tun is not open to users, so slirp4netns cannot start: `--network host`, and the
  servers listen on 127.0.0.1 ports of their own.
"""
from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests

from helpers import free_port, jupyter, needs_root, one_error_line, require, shown, ssh, ssh_keypair, wait_until

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.root,  # a rootless user of its own
              # The pull of the 6.5 GB image into Podman's store and the CPU smoke suite under it: about
              # 6 min of this project's CI on 2 cores, which its 60 min budget no longer holds.
              pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_PODMAN") != "1",
                                 reason="about 6 min on 2 cores: on request, PYTORCH_CUDA_TEST_PODMAN=1")]

ULIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096")
SUBIDS = "410000-475535"  # only where useradd gave the user no range of its own


def _root(*cmd: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)


def _has_range(path: str, user: str) -> bool:
    try:
        return any(line.split(":")[0] == user for line in Path(path).read_text().splitlines())
    except OSError:
        return False


class Rootless:
    """Podman as an ordinary user of this test's own."""

    def __init__(self) -> None:
        self.user = f"pcbpod{uuid.uuid4().hex[:6]}"

    def create(self) -> "Rootless":
        proc = _root("useradd", "--create-home", "--shell", "/bin/sh", self.user)
        assert proc.returncode == 0, shown(proc)
        if not all(_has_range(f, self.user) for f in ("/etc/subuid", "/etc/subgid")):  # useradd gave none
            proc = _root("usermod", "--add-subuids", SUBIDS, "--add-subgids", SUBIDS, self.user)
            assert proc.returncode == 0, shown(proc)
        pw = pwd.getpwnam(self.user)
        self.uid, self.home = pw.pw_uid, Path(pw.pw_dir)
        self.runtime_dir = Path(f"/run/user/{self.uid}")
        self.runtime_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chown(self.runtime_dir, pw.pw_uid, pw.pw_gid)
        conf = self.home / ".config" / "containers"
        conf.mkdir(parents=True)
        (conf / "storage.conf").write_text('[storage]\ndriver = "overlay"\n')  # the kernel's own, rootless
        for p in (self.home / ".config", conf, conf / "storage.conf"):
            os.chown(p, pw.pw_uid, pw.pw_gid)
        return self

    def podman(self, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
        env = ["env", "-i", f"HOME={self.home}", f"USER={self.user}", f"XDG_RUNTIME_DIR={self.runtime_dir}",
               "PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
        return subprocess.run(["runuser", "-u", self.user, "--", *env, "podman", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=self.home)

    def remove(self) -> None:
        """Everything create() made, as far as it got."""
        if hasattr(self, "runtime_dir"):
            self.podman("rm", "--all", "--force", timeout=120)
            self.podman("system", "reset", "--force", timeout=300)  # its layers belong to its subordinate uids
        _root("pkill", "-u", self.user)
        _root("userdel", "--remove", self.user)
        if hasattr(self, "runtime_dir"):
            shutil.rmtree(self.runtime_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def podman(default_oci_layout):
    require(shutil.which("podman"), "podman missing: engine.sh --with-registry (build.py selftest) installs it")
    needs_root("creating the rootless user (useradd)")
    layout, tag = default_oci_layout
    user = Rootless()
    try:
        user.create()
        t0 = time.monotonic()
        pulled = user.podman("pull", "--quiet", f"oci:{layout}:{tag}", timeout=1800)
        assert pulled.returncode == 0, shown(pulled)
        image = pulled.stdout.strip().splitlines()[-1]
        print(f"podman pull oci: {time.monotonic() - t0:.0f} s")
        info = json.loads(user.podman("info", "--format", "json").stdout)
        assert info["host"]["security"]["rootless"] is True and info["store"]["graphDriverName"] == "overlay", info["store"]
        yield user, image
    finally:
        user.remove()


def run(user: Rootless, image: str, *args: str, opts: tuple[str, ...] = (), timeout: int = 300):
    return user.podman("run", "--rm", "--network", "host", *ULIMITS, *opts, image, *args, timeout=timeout)


def test_the_image_is_the_one_docker_holds(podman, docker_client):
    user, image = podman
    proc = user.podman("image", "inspect", "--format", "{{.Config.User}}|{{json .Config.Labels}}", image)
    assert proc.returncode == 0, shown(proc)
    who, labels = proc.stdout.strip().split("|", 1)
    assert who == "1000:1000" and json.loads(labels) == docker_client.images.get("pytorch-cuda:v2.7").labels


def test_banner_runs_as_the_images_user_in_a_user_namespace(podman):
    user, image = podman
    proc = run(user, image, "sh", "-c", "id -u; cat /proc/self/uid_map")
    assert proc.returncode == 0, shown(proc)
    uid, *mapping = proc.stdout.strip().split("\n")
    assert uid == "1000"
    assert "2.7.1" in proc.stderr and "0.17.6" in proc.stderr, proc.stderr  # the banner (torch, DeepSpeed), on stderr
    assert "0 0 4294967295" not in " ".join(" ".join(mapping).split()), "not a user namespace: rootful"


def test_the_cpu_half_of_the_smoke_suite_passes_as_under_docker(podman, default_build):
    """The smoke suite as the gate runs it without a GPU: 2 gloo ranks, ZeRO 1-3 (with offload),
    FSDP2, DDP, torch.compile; its JSON report read back from the container and compared with
    the one the gate wrote under Docker for the same image."""
    user, image = podman
    under_docker = json.loads((default_build.results / "smoke-report.json").read_text())
    script = ("pytorch-cuda-smoke --report /tmp/report.json --timeout 600 >&2; rc=$?; "
              "echo REPORT; cat /tmp/report.json; exit $rc")
    proc = run(user, image, "sh", "-c", script, opts=("--shm-size", "2g", "-e", "PYTORCH_CUDA_NO_BANNER=1"), timeout=1500)
    assert proc.returncode == 0, shown(proc)
    report = json.loads(proc.stdout.split("REPORT\n", 1)[1])
    assert report["summary"]["FAIL"] == 0, report["summary"]
    passed = {(r["check"], r["rank"]) for r in report["results"] if r["status"] == "PASS"}
    assert passed == {(r["check"], r["rank"]) for r in under_docker["results"] if r["status"] == "PASS"}
    ran = {check.split(".")[0] for check, _ in passed}
    assert {"zero1", "zero2", "zero3", "zero3_offload", "fsdp2", "ddp", "compile"} <= ran, sorted(ran)


def test_sshd_mode_takes_a_key_login(podman, tmp_path):
    user, image = podman
    key, pub = ssh_keypair(tmp_path)
    port = free_port()
    with detached(user, image, ("-e", f"SSH_PUBLIC_KEY={pub}", "-e", f"SSH_PORT={port}", "-e", "SSH_LISTEN=127.0.0.1"),
                  "sshd") as alive:
        wait_until("sshd", lambda: f"Server listening on 127.0.0.1 port {port}" in alive()[1], alive=alive)
        proc = ssh(key, port, 'python -c "import torch, deepspeed; print(torch.__version__)"', known=tmp_path / "known")
        assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "2.7.1+cu126", shown(proc)


def test_jupyter_mode_serves_with_its_token_only(podman):
    user, image = podman
    token, port = secrets.token_hex(16), free_port()

    def answers() -> bool:
        try:
            return jupyter(port, None).status_code in (200, 403)
        except requests.ConnectionError:
            return False
    with detached(user, image, ("-e", f"JUPYTER_TOKEN={token}"),
                  "jupyter", "lab", "--ip", "127.0.0.1", "--port", str(port), "--no-browser") as alive:
        wait_until("jupyter lab", answers, timeout=180, alive=alive)
        assert jupyter(port, None).status_code == 403
        ok = jupyter(port, token)
        assert ok.status_code == 200 and "started" in ok.json(), ok.text


@contextlib.contextmanager
def detached(user: Rootless, image: str, opts: tuple[str, ...], *cmd: str):
    """`podman run -d` of the entrypoint on host networking; yields alive() -> (running, log) for
    wait_until, and removes the container whatever happened."""
    started = user.podman("run", "-d", "--network", "host", *ULIMITS, *opts, image, *cmd)
    assert started.returncode == 0, shown(started)
    cid = started.stdout.strip()

    def alive() -> tuple[bool, str]:
        state = user.podman("inspect", "--format", "{{.State.Running}}", cid).stdout.strip()
        log = user.podman("logs", cid)
        return state == "true", log.stdout + log.stderr
    try:
        yield alive
    finally:
        user.podman("rm", "--force", cid)


def test_a_bad_key_is_refused_in_one_line_under_podman_too(podman):
    user, image = podman
    proc = run(user, image, "sshd", opts=("-e", "SSH_PUBLIC_KEY=not a key", "-e", f"SSH_PORT={free_port()}",
                                          "-e", "PYTORCH_CUDA_NO_BANNER=1"))
    one_error_line(proc, 2, "is not an OpenSSH public key", prefix="pytorch-cuda: error: ", only_line=True)

