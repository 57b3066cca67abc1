"""The ways into an image besides a shell, run as users run them, on the built default row:

- `sshd` mode: key-only login as the image's user with a real ssh client; passwords, root
  and other keys refused; each container its own host keys (no layer holds one: the layer
  scan in test_secrets.py);
- `jupyter lab`: token auth always (403 without it, 200 with it), a kernel started and run
  over Jupyter's REST and websocket API, a notebook saved in /workspace;
- `tensorboard --logdir /workspace/runs --bind_all` serves what torch's SummaryWriter wrote;
- every bad input (key, token, port, /workspace) is one line on stderr and a non-zero exit.

Host networking, 127.0.0.1 and a port of its own for every service (tests/helpers.serving).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
import requests

from helpers import (
    as_root,
    default_image,
    free_port,
    jupyter,
    logs,
    one_error_line,
    owned_by_image_user,
    run_once,
    serving,
    shown,
    ssh,
    ssh_keypair,
    wait_until,
)

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.second_lane]

QUIET = ("-e", "PYTORCH_CUDA_NO_BANNER=1")


@pytest.fixture(scope="module")
def image(docker_client, default_build) -> str:
    return default_image()


def run_host_net(image: str, cmd: list[str], opts: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return run_once(image, cmd, ("--network", "host", *QUIET, *opts))


# The entrypoint refuses bad input with this one line on stderr and nothing else.
IMAGE_ERROR = {"prefix": "pytorch-cuda: error: ", "only_line": True}


# ---- ssh --------------------------------------------------------------------------------------

def sshd_up(cid: str, port: int) -> None:
    wait_until("sshd", lambda: f"Server listening on 127.0.0.1 port {port}" in logs(cid), cid)


@pytest.fixture(scope="module")
def sshd(image, tmp_path_factory):
    keys = tmp_path_factory.mktemp("ssh")
    key, pub = ssh_keypair(keys)
    port = free_port()
    with serving(image, ["sshd"], ("-e", f"SSH_PUBLIC_KEY={pub}", "-e", f"SSH_PORT={port}", "-e", "SSH_LISTEN=127.0.0.1",
                                   "-e", "NCCL_DEBUG=INFO")) as cid:
        sshd_up(cid, port)
        yield {"cid": cid, "port": port, "key": key, "known": keys / "known_hosts", "dir": keys}


def test_ssh_key_login_runs_torch_and_deepspeed_with_the_containers_environment(sshd, image):
    proc = ssh(sshd["key"], sshd["port"], 'python -c "import torch, deepspeed; print(torch.__version__, deepspeed.__version__)"',
               known=sshd["known"])
    assert proc.returncode == 0, shown(proc)
    # The last line: importing DeepSpeed without a GPU logs its accelerator choice to stdout first.
    assert re.match(r"^2\.7\.1\+cu126 0\.17\.6$", proc.stdout.strip().splitlines()[-1]), shown(proc)
    # Same PATH and venv as `docker run`, for a command (pdsh's way) and for a login shell.
    want = subprocess.run(["docker", "exec", sshd["cid"], "sh", "-c", 'echo "$PATH|$VIRTUAL_ENV|$NCCL_DEBUG"'],
                          capture_output=True, text=True).stdout.strip()
    got = ssh(sshd["key"], sshd["port"], 'echo "$PATH|$VIRTUAL_ENV|$NCCL_DEBUG"', known=sshd["known"]).stdout.strip()
    assert got == want and want.startswith("/opt/venv/bin:"), (got, want)
    login = ssh(sshd["key"], sshd["port"], "bash -lc 'echo \"$PATH|$VIRTUAL_ENV|$NCCL_DEBUG\"; id -un'", known=sshd["known"])
    assert login.stdout.split() == [want, "trainer"], shown(login)


def test_ssh_refuses_passwords_root_and_other_keys(sshd):
    other, _ = ssh_keypair(sshd["dir"], "other")
    for proc in (ssh(other, sshd["port"], "true", known=sshd["known"]),
                 ssh(sshd["key"], sshd["port"], "true", user="root", known=sshd["known"]),
                 ssh(sshd["key"], sshd["port"], "true", known=sshd["known"],
                     extra=("-o", "PubkeyAuthentication=no", "-o", "PreferredAuthentications=password,keyboard-interactive"))):
        assert proc.returncode == 255, shown(proc)
        # Public key is the only method the server offers at all.
        assert "Permission denied (publickey)." in proc.stderr, shown(proc)


def test_each_container_has_its_own_host_keys(sshd, image):
    def host_keys(port: int) -> set[str]:
        scan = subprocess.run(["ssh-keyscan", "-p", str(port), "127.0.0.1"], capture_output=True, text=True, timeout=60)
        return {line.split(None, 1)[1] for line in scan.stdout.splitlines() if line and not line.startswith("#")}

    _, pub = ssh_keypair(sshd["dir"], "second")
    port = free_port()
    with serving(image, ["sshd"], ("-e", f"SSH_PUBLIC_KEY={pub}", "-e", f"SSH_PORT={port}", "-e", "SSH_LISTEN=127.0.0.1")) as cid:
        sshd_up(cid, port)
        first, second = host_keys(sshd["port"]), host_keys(port)
    assert first and second and not first & second, (first, second)


@pytest.mark.parametrize("key, says", [
    ("", "SSH_PUBLIC_KEY is empty"),
    ("not a key at all", "is not an OpenSSH public key"),
    ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI\nssh-ed25519 AAAA", "several lines"),
])
def test_a_bad_public_key_never_opens_a_server(image, key, says):
    port = free_port()
    proc = run_host_net(image, ["sshd"], ("-e", f"SSH_PUBLIC_KEY={key}", "-e", f"SSH_PORT={port}", "-e", "SSH_LISTEN=127.0.0.1"))
    one_error_line(proc, 2, says, **IMAGE_ERROR)


def test_sshd_without_a_key_or_on_a_taken_port_fails(image, sshd):
    one_error_line(run_host_net(image, ["sshd"]), 2, "SSH_PUBLIC_KEY is not set", **IMAGE_ERROR)
    pub = (sshd["key"].parent / "id_ed25519.pub").read_text().strip()
    taken = run_host_net(image, ["sshd"], ("-e", f"SSH_PUBLIC_KEY={pub}", "-e", f"SSH_PORT={sshd['port']}", "-e", "SSH_LISTEN=127.0.0.1"))
    one_error_line(taken, 1, f"port {sshd['port']} on 127.0.0.1 is already in use", **IMAGE_ERROR)


# ---- JupyterLab -------------------------------------------------------------------------------

def jupyter_up(cid: str, port: int) -> None:
    def answers():
        try:
            return jupyter(port, None).status_code in (200, 403)  # it answers (403: it wants the token)
        except requests.ConnectionError:
            return False
    wait_until("jupyter lab", answers, cid, timeout=180)


@pytest.fixture(scope="module")
def lab(image, tmp_path_factory):
    ws = owned_by_image_user(tmp_path_factory.mktemp("workspace"))
    port, token = free_port(), secrets.token_hex(16)
    with serving(image, ["jupyter", "lab", "--ip=127.0.0.1", f"--port={port}"],
                 ("-e", f"JUPYTER_TOKEN={token}", "-v", f"{ws}:/workspace")) as cid:
        jupyter_up(cid, port)
        yield {"cid": cid, "port": port, "token": token, "workspace": ws}


def test_jupyter_needs_the_token(lab):
    assert jupyter(lab["port"], None).status_code == 403
    assert jupyter(lab["port"], "wrong-token").status_code == 403
    assert jupyter(lab["port"], lab["token"]).status_code == 200
    # The lab page itself: without a token, a login page and nothing of the server's files.
    assert jupyter(lab["port"], None, "/api/contents").status_code == 403


def execute(port: int, token: str, kernel_id: str, code: str, timeout: float = 120) -> str:
    """Run code in a kernel over Jupyter's websocket channel, as JupyterLab does; return its text/plain result."""
    import websocket

    ws = websocket.create_connection(f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels",
                                     header=[f"Authorization: token {token}"], timeout=timeout)
    try:
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({"header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex,
                                       "msg_type": "execute_request", "version": "5.3"},
                            "parent_header": {}, "metadata": {}, "channel": "shell",
                            "content": {"code": code, "silent": False, "store_history": False,
                                        "user_expressions": {}, "allow_stdin": False}}))
        result, idle, error = None, False, None
        while not (idle and result is not None) and not error:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            if kind == "execute_result":
                result = msg["content"]["data"]["text/plain"]
            elif kind == "error":
                error = f"{msg['content']['ename']}: {msg['content']['evalue']}"
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
                if result is None:
                    error = "the kernel went idle without a result"
        assert not error, error
        return result
    finally:
        ws.close()


def test_a_kernel_runs_torch_and_the_notebook_is_saved_in_workspace(lab):
    port, token = lab["port"], lab["token"]
    kernel = jupyter(port, token, "/api/kernels", method="POST", json={"name": "python3"})
    assert kernel.status_code == 201, kernel.text
    try:
        version = execute(port, token, kernel.json()["id"], "import torch; torch.__version__")
    finally:
        jupyter(port, token, f"/api/kernels/{kernel.json()['id']}", method="DELETE")
    assert version == "'2.7.1+cu126'"
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
          "cells": [{"cell_type": "code", "id": "torch-version", "metadata": {}, "execution_count": 1,
                     "source": "import torch; torch.__version__",
                     "outputs": [{"output_type": "execute_result", "execution_count": 1, "metadata": {},
                                  "data": {"text/plain": version}}]}]}
    saved = jupyter(port, token, "/api/contents/proof.ipynb", method="PUT", json={"type": "notebook", "content": nb})
    assert saved.status_code in (200, 201), saved.text
    # The image user's folder (0700, uid 1000), which this user may not enter where it is not root
    # (a hosted runner's): looked at as root, through sudo there.
    on_disk = str(lab["workspace"] / "proof.ipynb")
    assert as_root("stat", "--format", "%u", on_disk).stdout.strip() == "1000"
    text = json.loads(as_root("cat", on_disk).stdout)["cells"][0]["outputs"][0]["data"]["text/plain"]
    assert "".join(text) == "'2.7.1+cu126'"  # nbformat stores multi-line strings on disk as lists of lines


def test_jupyter_without_a_token_generates_one_and_prints_it(image, tmp_path):
    ws = owned_by_image_user(tmp_path / "ws")
    port = free_port()
    with serving(image, ["jupyter", "lab", "--ip=127.0.0.1", f"--port={port}"], ("-v", f"{ws}:/workspace")) as cid:
        jupyter_up(cid, port)
        token = wait_until("the token in the log", lambda: re.findall(r"[?&]token=([0-9a-f]{32,})", logs(cid)), cid)[0]
        assert jupyter(port, None).status_code == 403
        assert jupyter(port, token).status_code == 200


def test_jupyter_refuses_an_empty_token_a_readonly_workspace_and_a_taken_port(image, tmp_path):
    ws = owned_by_image_user(tmp_path / "ws")
    port = free_port()
    lab = ["jupyter", "lab", "--ip=127.0.0.1", f"--port={port}"]
    one_error_line(run_host_net(image, lab, ("-e", "JUPYTER_TOKEN=", "-v", f"{ws}:/workspace")), 2, "JUPYTER_TOKEN is empty",
                   **IMAGE_ERROR)
    one_error_line(run_host_net(image, [*lab, "--IdentityProvider.token="], ("-v", f"{ws}:/workspace")), 2,
                   "would turn authentication off", **IMAGE_ERROR)
    one_error_line(run_host_net(image, lab, ("-v", f"{ws}:/workspace:ro")), 1, "/workspace is not writable", **IMAGE_ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        one_error_line(run_host_net(image, lab, ("-v", f"{ws}:/workspace")), 1, f"port {port} on 127.0.0.1 is already in use",
                       **IMAGE_ERROR)
    assert not list(Path(ws).iterdir())  # nothing half-written


# ---- TensorBoard ------------------------------------------------------------------------------

WRITE_EVENTS = ("from torch.utils.tensorboard import SummaryWriter\n"
                "w = SummaryWriter('/workspace/runs/smoke')\n"
                "[w.add_scalar('loss', 1.0 / (i + 1), i) for i in range(5)]\n"
                "w.close()\n")


def test_tensorboard_serves_what_torch_wrote(image, tmp_path):
    ws = owned_by_image_user(tmp_path / "ws")
    wrote = run_host_net(image, ["python", "-c", WRITE_EVENTS], ("-v", f"{ws}:/workspace"))
    assert wrote.returncode == 0, shown(wrote)
    port = free_port()
    with serving(image, ["tensorboard", "--logdir", "/workspace/runs", "--bind_all", "--port", str(port)],
                 ("-v", f"{ws}:/workspace")) as cid:
        def page():
            try:
                r = requests.get(f"http://127.0.0.1:{port}/", timeout=10)
                return r if r.status_code == 200 else None
            except requests.ConnectionError:
                return None
        assert "TensorBoard" in wait_until("tensorboard", page, cid, timeout=180).text
        runs = wait_until("the run", lambda: requests.get(f"http://127.0.0.1:{port}/data/runs", timeout=10).json(), cid)
        assert runs == ["smoke"], runs
        scalars = requests.get(f"http://127.0.0.1:{port}/data/plugin/scalars/scalars",
                               params={"run": "smoke", "tag": "loss"}, timeout=10)
        assert scalars.status_code == 200 and [s[1] for s in scalars.json()] == [0, 1, 2, 3, 4], scalars.text
    assert os.path.isdir(ws / "runs" / "smoke")
