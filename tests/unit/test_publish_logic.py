"""Publish and matrix logic that needs no daemon: addresses, credentials, the CI matrix."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, run_build_py

from pytorch_cuda_build import matrix, propose, publish
from pytorch_cuda_build.errors import EnvironmentProblem, PublishError, UsageError

MATRIX = matrix.load(ROOT / "matrix.yaml")


@pytest.mark.parametrize(("text", "host", "ns", "api"), [
    ("127.0.0.1:5000/ml", "127.0.0.1:5000", "ml", "http://127.0.0.1:5000/v2/"),
    ("localhost/team/images", "localhost", "team/images", "http://localhost/v2/"),
    ("ghcr.io/acme", "ghcr.io", "acme", "https://ghcr.io/v2/"),
    ("registry.example.com:8443/ml-infra", "registry.example.com:8443", "ml-infra", "https://registry.example.com:8443/v2/"),
    ("docker.io/acme", "docker.io", "acme", "https://registry-1.docker.io/v2/"),
    ("[::1]:5000/ml", "[::1]:5000", "ml", "http://[::1]:5000/v2/"),
])
def test_registry_addresses(text, host, ns, api):
    reg = publish.Registry.parse(text)
    assert (reg.host, reg.namespace, reg.loopback) == (host, ns, api.startswith("http:"))  # loopback: plain HTTP, as Docker
    assert reg.repository(MATRIX.images[0]) == f"{host}/{ns}/pytorch-cuda"


@pytest.mark.parametrize("text", ["", "127.0.0.1:5000", "https://ghcr.io/acme", "ghcr.io/Acme", "ghcr.io/acme:tag",
                                  "ghcr.io//acme", "ghcr.io/acme/", "-bad.io/acme", "host:0/ml", "host:70000/ml", "host:x/ml"])
def test_malformed_registry_addresses_are_usage_errors(text):
    with pytest.raises(UsageError, match="malformed registry address"):
        publish.Registry.parse(text)


def test_credentials_from_the_environment_need_both(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))  # no docker login here
    reg = publish.Registry.parse("ghcr.io/acme")
    monkeypatch.delenv(publish.USER_ENV, raising=False)
    monkeypatch.delenv(publish.PASSWORD_ENV, raising=False)
    assert publish.credentials(reg) is None
    monkeypatch.setenv(publish.USER_ENV, "bot")
    with pytest.raises(UsageError, match="set both"):
        publish.credentials(reg)
    monkeypatch.setenv(publish.PASSWORD_ENV, "pw")
    assert publish.credentials(reg) == {"username": "bot", "password": "pw"}


def test_credentials_from_docker_login(monkeypatch, tmp_path):
    monkeypatch.delenv(publish.USER_ENV, raising=False)
    monkeypatch.delenv(publish.PASSWORD_ENV, raising=False)
    auth = base64.b64encode(b"robot:t0ken").decode()
    (tmp_path / "config.json").write_text(json.dumps({"auths": {"registry.example.com:8443": {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert publish.credentials(publish.Registry.parse("registry.example.com:8443/ml")) == {"username": "robot", "password": "t0ken"}
    assert publish.credentials(publish.Registry.parse("ghcr.io/acme")) is None


def test_matrix_json_is_the_fan_out():
    proc = run_build_py(ROOT, "matrix", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["include"]
    assert [r["image"] for r in rows] == [i.name for i in MATRIX.images]
    default = next(r for r in rows if r["image"] == "2.7.1-cuda12.1-runtime")
    assert default["tags"] == ["2.7.1-cuda12.1-runtime", "v2.7-cuda12.1", "v2.7"] and default["default"]
    assert default["build_args"] == "--torch 2.7.1 --cuda 12.1 --flavor runtime"
    for r in rows:  # every row's build_args select exactly that row
        t, c, f = r["build_args"].split()[1::2]
        assert MATRIX.select(t, c, f).name == r["image"]


def test_a_reader_that_stops_early_gets_no_traceback():
    """`build.py matrix --json | head -1`: a pipe whose reader is gone before the first write."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "build.py"), "matrix", "--json"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, "")


def test_new_releases_are_newer_minors_and_newer_patches():
    have = MATRIX  # newest rows: 2.14.1 and 2.15.0
    versions = ["2.3.1", "2.14.0", "2.14.1", "2.14.2", "2.15.0", "2.16.0rc1", "2.16.0", "2.16.1", "2.16.2+cpu", "2.17.0.dev1", "nightly"]
    assert propose.new_releases(have, versions) == ["2.14.2", "2.16.1"]
    assert propose.new_releases(have, ["2.15.0", "2.4.1"]) == []
    assert "no torch release" in propose.render([])


@pytest.mark.network
def test_propose_reads_the_pins_from_the_index(tmp_path):
    """Against the real index: drop the newest row and get it proposed back, same pins."""
    text = (ROOT / "matrix.yaml").read_text()
    newest = MATRIX.images[-1]
    cut = text.index(f"  - torch: {newest.torch}")
    (tmp_path / "matrix.yaml").write_text(text[:cut])
    proc = run_build_py(ROOT, "--matrix", str(tmp_path / "matrix.yaml"), "matrix", "--propose", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (f"  - torch: {newest.torch}\n    cuda: \"{newest.cuda}\"\n    wheel_cuda: \"{newest.wheel_cuda}\"\n"
            f"    cudnn: {newest.cudnn}\n    nccl: {newest.nccl}\n") in proc.stdout, proc.stdout


@pytest.mark.parametrize(("args", "text"), [
    (["publish", "--registry", "127.0.0.1:5000/ml"], "pick the rows"),
    (["publish", "--all", "--torch", "2.7", "--registry", "127.0.0.1:5000/ml"], "pick the rows"),
    (["publish", "--torch", "2.7"], "no registry"),
    (["publish", "--torch", "2.7", "--registry", "127.0.0.1:5000/ml", "--retries", "0"], "argument --retries: must be at least 1"),
    (["--torch", "2.7", "--push"], "no registry"),  # before an hour of building, not after
    (["--torch", "2.7", "--push", "--registry", "https://ghcr.io/acme"], "malformed registry address"),
])
def test_publish_usage_errors_are_one_line(args, text):
    proc = run_build_py(ROOT, *args, env={"DOCKER_HOST": "unix:///nonexistent/docker.sock", "PYTORCH_CUDA_REGISTRY": ""})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and text in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_frozen_index_proposes_only_what_was_uploaded_by_then():
    from pytorch_cuda_build import propose

    data = {"name": "torch", "versions": ["2.15.0", "2.15.1"], "files": [
        {"filename": "torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl", "upload-time": "2026-10-01T10:00:00.000Z"},
        {"filename": "torch-2.15.1-cp311-cp311-manylinux_2_28_x86_64.whl", "upload-time": "2026-12-01T10:00:00Z"}]}
    assert propose.released_by(data, "2026-11-22T21:30:00Z") == ["2.15.0"]
    assert propose.released_by(data, None) == ["2.15.0", "2.15.1"]


# ---- the read-back client (skopeo): what its messages mean, and where credentials go ----------

REG = publish.Registry.parse("127.0.0.1:5000/ml")


def skopeo_said(msg: str) -> str:
    """stderr as skopeo 1.9 writes a fatal error (logrus), with Go's quoting inside msg."""
    quoted = msg.replace('"', '\\"')
    return f'time="2026-11-24T00:07:17Z" level=fatal msg="Error parsing image name \\"docker://127.0.0.1:5000/ml/x:y\\": {quoted}"\n'


@pytest.mark.parametrize(("msg", "creds", "kind", "needle"), [
    ("reading manifest nope in 127.0.0.1:5000/ml/pytorch-cuda: manifest unknown: manifest unknown", True, publish._Absent, "manifest unknown"),
    ("reading manifest v2.7 in ghcr.io/acme/pytorch-cuda: name unknown: repository name not known to registry", True, publish._Absent, "name unknown"),
    ("reading manifest v2.7 in 127.0.0.1:5000/ml/pytorch-cuda: unauthorized: authentication required", False, UsageError, "needs credentials: `docker login 127.0.0.1:5000`"),
    ("reading manifest v2.7 in 127.0.0.1:5000/ml/pytorch-cuda: unauthorized: authentication required", True, UsageError, "refused the credentials given: reading"),
    ("unable to retrieve auth token: invalid username/password: unauthorized: authentication required", True, UsageError, "refused the credentials given (token)"),
    ('pinging container registry 127.0.0.1:5000: Get "http://127.0.0.1:5000/v2/": dial tcp 127.0.0.1:5000: connect: connection refused', True, publish.Transient, "registry 127.0.0.1:5000 unreachable"),
    ('Get "http://127.0.0.1:6000/token?scope=repository%3Aml%3Apull": dial tcp 127.0.0.1:6000: connect: connection refused', True, publish.Transient, "token service of 127.0.0.1:5000 unreachable"),
    ("pinging container registry 127.0.0.1:5000: invalid status code from registry 503 (Service Unavailable)", True, publish.Transient, "unreachable"),
    ("reading manifest v2.7 in 127.0.0.1:5000/ml/pytorch-cuda: toomanyrequests: rate limit", True, publish.Transient, "unreachable"),
    ("pinging container registry 127.0.0.1:5000: invalid status code from registry 404 (Not Found)", True, EnvironmentProblem, "is not a container registry"),
    ("can't talk to a V1 container registry", True, EnvironmentProblem, "is not a container registry"),
    ("reading manifest v2.7 in 127.0.0.1:5000/ml/pytorch-cuda: something new", True, PublishError, "skopeo could not read from 127.0.0.1:5000: reading manifest"),
])
def test_skopeo_messages_become_the_right_error(msg, creds, kind, needle):
    client = publish.RegistryAPI(REG, {"username": "ci", "password": "pw"} if creds else None, None)
    err = client._failure(skopeo_said(msg))
    assert type(err) is kind and needle in str(err), err
    assert "Error parsing image name" not in str(err)


def test_credentials_reach_skopeo_in_a_private_file_never_on_its_command_line(monkeypatch, tmp_path):
    seen = {}

    def run(cmd, **kw):
        authfile = next(a.split("=", 1)[1] for a in cmd if a.startswith("--authfile="))
        seen.update(cmd=cmd, auth=json.loads(open(authfile).read()), path=authfile, home=kw["env"]["HOME"])
        return subprocess.CompletedProcess(cmd, 0, stdout=b'{"schemaVersion": 2, "config": {"digest": "sha256:c0"}}', stderr=b"")

    monkeypatch.setattr(publish.shutil, "which", lambda name: "/usr/bin/skopeo")
    monkeypatch.setattr(publish.subprocess, "run", run)
    client = publish.RegistryAPI(REG, {"username": "ci", "password": "s3cret"}, None)
    remote = client.manifest(MATRIX.images[0], "v2.7")
    assert remote.config == "sha256:c0" and remote.digest.startswith("sha256:")
    assert not any("s3cret" in a for a in seen["cmd"])
    assert seen["auth"] == {"auths": {"127.0.0.1:5000": {"auth": base64.b64encode(b"ci:s3cret").decode()}}}
    assert not os.path.exists(seen["path"]) and seen["path"].startswith(seen["home"])
    assert "--tls-verify=false" in seen["cmd"] and seen["cmd"][-1] == "docker://127.0.0.1:5000/ml/pytorch-cuda:v2.7"


def test_without_skopeo_the_read_back_says_what_to_install(monkeypatch):
    monkeypatch.setattr(publish.shutil, "which", lambda name: None)
    with pytest.raises(EnvironmentProblem, match="skopeo is not installed"):
        publish.RegistryAPI(REG, None, None).manifest(MATRIX.images[0], "v2.7")


def test_ping_reads_the_repository_published_to_not_a_made_up_one(monkeypatch):
    """A registry like Docker Hub denies a token for a repository the account cannot see."""
    asked = []
    client = publish.RegistryAPI(REG, None, None)
    monkeypatch.setattr(client, "_read", lambda name, tag: asked.append((name, tag)))
    client.ping(MATRIX.images[0])
    assert asked == [("ml/pytorch-cuda", "pytorch-cuda-ping")]
