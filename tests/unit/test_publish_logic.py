"""Publish and matrix logic that needs no daemon: addresses, credentials, the CI matrix; the
dated immutable tag from the image's labels, a plan that never moves an immutable tag, and
the pushed digest as each engine reports it."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import docker.errors
import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.commands import propose
from pytorch_cuda_build.errors import BadValue, EnvironmentProblem, ImageUnfit, ImmutableTagTaken, PublishError, RegistryRefused
from pytorch_cuda_build.registry import client as registry
from pytorch_cuda_build.stages import publish, render

from helpers import ROOT, ExportingEngine, layer_tar, oci_export, run_build_py

MATRIX = matrix.load(ROOT / "matrix.yaml")
ROW = MATRIX.select("2.7", "12.1")
LOCK = "7904bf67" + "0" * 56
BASE_ID = "sha256:" + "b" * 64
LABELS = {publish.CREATED_LABEL: "2026-11-22T23:59:59Z", publish.LOCK_LABEL: LOCK, publish.BASE_LABEL: BASE_ID}
BASE_TAG = render.base_ref(ROW).split(":")[1] + "-" + "b" * 12


@pytest.mark.parametrize(("text", "host", "ns", "api"), [
    ("127.0.0.1:5000/ml", "127.0.0.1:5000", "ml", "http://127.0.0.1:5000/v2/"),
    ("localhost/team/images", "localhost", "team/images", "http://localhost/v2/"),
    ("ghcr.io/acme", "ghcr.io", "acme", "https://ghcr.io/v2/"),
    ("registry.example.com:8443/ml-infra", "registry.example.com:8443", "ml-infra", "https://registry.example.com:8443/v2/"),
    ("docker.io/acme", "docker.io", "acme", "https://registry-1.docker.io/v2/"),
    ("[::1]:5000/ml", "[::1]:5000", "ml", "http://[::1]:5000/v2/"),
])
def test_registry_addresses(text, host, ns, api):
    reg = registry.Registry.parse(text)
    assert (reg.host, reg.namespace, reg.loopback) == (host, ns, api.startswith("http:"))  # loopback: plain HTTP, as Docker
    assert reg.repository(MATRIX.images[0]) == f"{host}/{ns}/pytorch-cuda"


@pytest.mark.parametrize("text", ["", "127.0.0.1:5000", "https://ghcr.io/acme", "ghcr.io/Acme", "ghcr.io/acme:tag",
                                  "ghcr.io//acme", "ghcr.io/acme/", "-bad.io/acme", "host:0/ml", "host:70000/ml", "host:x/ml"])
def test_malformed_registry_addresses_are_usage_errors(text):
    with pytest.raises(BadValue, match="malformed registry address"):
        registry.Registry.parse(text)


def test_credentials_from_the_environment_need_both(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))  # no docker login here
    reg = registry.Registry.parse("ghcr.io/acme")
    monkeypatch.delenv(registry.USER_ENV, raising=False)
    monkeypatch.delenv(registry.PASSWORD_ENV, raising=False)
    assert registry.credentials(reg) is None
    monkeypatch.setenv(registry.USER_ENV, "bot")
    with pytest.raises(BadValue, match="set both"):
        registry.credentials(reg)
    monkeypatch.setenv(registry.PASSWORD_ENV, "pw")
    assert registry.credentials(reg) == {"username": "bot", "password": "pw"}


def test_credentials_from_docker_login(monkeypatch, tmp_path):
    monkeypatch.delenv(registry.USER_ENV, raising=False)
    monkeypatch.delenv(registry.PASSWORD_ENV, raising=False)
    auth = base64.b64encode(b"robot:t0ken").decode()
    (tmp_path / "config.json").write_text(json.dumps({"auths": {"registry.example.com:8443": {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert registry.credentials(registry.Registry.parse("registry.example.com:8443/ml")) == {"username": "robot", "password": "t0ken"}
    assert registry.credentials(registry.Registry.parse("ghcr.io/acme")) is None


def test_matrix_json_is_the_fan_out():
    proc = run_build_py(ROOT, "matrix", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["include"]
    assert [(r["image"], r["platform"]) for r in rows] == [(i.name, p) for i in MATRIX.images for p in i.platforms]
    arm = [r for r in rows if r["platform"] == "linux/arm64"]
    assert arm and all(r["arch"] == "arm64" for r in arm)  # built natively: the workflow picks each platform's runner
    indexes = json.loads(run_build_py(ROOT, "matrix", "--indexes").stdout)["include"]
    assert [r["image"] for r in indexes] == [i.name for i in MATRIX.images if len(i.platforms) > 1] == sorted({r["image"] for r in arm}, key=[i.name for i in MATRIX.images].index)
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
    (["--torch", "2.7", "--compression", "zstd"], "--compression needs --push"),  # nothing to compress without a push
    (["publish", "--torch", "2.11", "--registry", "127.0.0.1:5000/ml", "--merge", "--compression", "zstd"], "do not go together"),
])
def test_publish_usage_errors_are_one_line(args, text):
    proc = run_build_py(ROOT, *args, env={"DOCKER_HOST": "unix:///nonexistent/docker.sock", "PYTORCH_CUDA_REGISTRY": ""})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and text in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_frozen_index_proposes_only_what_was_uploaded_by_then():
    from pytorch_cuda_build.commands import propose

    data = {"name": "torch", "versions": ["2.15.0", "2.15.1"], "files": [
        {"filename": "torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl", "upload-time": "2026-10-01T10:00:00.000Z"},
        {"filename": "torch-2.15.1-cp311-cp311-manylinux_2_28_x86_64.whl", "upload-time": "2026-12-01T10:00:00Z"}]}
    assert propose.released_by(data, "2026-11-22T21:30:00Z") == ["2.15.0"]
    assert propose.released_by(data, None) == ["2.15.0", "2.15.1"]


# ---- the read-back client (skopeo): what its messages mean, and where credentials go ----------

REG = registry.Registry.parse("127.0.0.1:5000/ml")


def skopeo_said(msg: str) -> str:
    """stderr as skopeo 1.9 writes a fatal error (logrus), with Go's quoting inside msg."""
    quoted = msg.replace('"', '\\"')
    return f'time="2026-11-24T00:07:17Z" level=fatal msg="Error parsing image name \\"docker://127.0.0.1:5000/ml/x:y\\": {quoted}"\n'


@pytest.mark.parametrize(("msg", "creds", "kind", "needle"), [
    ("reading manifest nope in 127.0.0.1:5000/ml/pytorch-cuda: manifest unknown: manifest unknown", True, registry._Absent, "manifest unknown"),
    ("reading manifest v2.7 in ghcr.io/acme/pytorch-cuda: name unknown: repository name not known to registry", True, registry._Absent, "name unknown"),
    ("reading manifest v2.7 in 127.0.0.1:5000/ml/pytorch-cuda: unauthorized: authentication required", False, RegistryRefused, "needs credentials: `docker login 127.0.0.1:5000`"),
    ("reading manifest v2.7 in 127.0.0.1:5000/ml/pytorch-cuda: unauthorized: authentication required", True, RegistryRefused, "refused the credentials given: reading"),
    ("unable to retrieve auth token: invalid username/password: unauthorized: authentication required", True, RegistryRefused, "refused the credentials given (token)"),
    ('pinging container registry 127.0.0.1:5000: Get "http://127.0.0.1:5000/v2/": dial tcp 127.0.0.1:5000: connect: connection refused', True, registry.Transient, "registry 127.0.0.1:5000 unreachable"),
    ('Get "http://127.0.0.1:6000/token?scope=repository%3Aml%3Apull": dial tcp 127.0.0.1:6000: connect: connection refused', True, registry.Transient, "token service of 127.0.0.1:5000 unreachable"),
    ("pinging container registry 127.0.0.1:5000: invalid status code from registry 503 (Service Unavailable)", True, registry.Transient, "unreachable"),
    ("reading manifest v2.7 in 127.0.0.1:5000/ml/pytorch-cuda: toomanyrequests: rate limit", True, registry.Transient, "unreachable"),
    ("pinging container registry 127.0.0.1:5000: invalid status code from registry 404 (Not Found)", True, EnvironmentProblem, "is not a container registry"),
    ("can't talk to a V1 container registry", True, EnvironmentProblem, "is not a container registry"),
    ("reading manifest v2.7 in 127.0.0.1:5000/ml/pytorch-cuda: something new", True, PublishError, "skopeo could not read from 127.0.0.1:5000: reading manifest"),
])
def test_skopeo_messages_become_the_right_error(msg, creds, kind, needle):
    client = registry.RegistryAPI(REG, {"username": "ci", "password": "pw"} if creds else None, None)
    err = client._failure(skopeo_said(msg))
    assert type(err) is kind and needle in str(err), err
    assert "Error parsing image name" not in str(err)


def test_credentials_reach_skopeo_in_a_private_file_never_on_its_command_line(monkeypatch, tmp_path):
    seen = {}

    def run(cmd, **kw):
        authfile = next(a.split("=", 1)[1] for a in cmd if a.startswith("--authfile="))
        seen.update(cmd=cmd, auth=json.loads(open(authfile).read()), path=authfile, home=kw["env"]["HOME"])
        return subprocess.CompletedProcess(cmd, 0, stdout=b'{"schemaVersion": 2, "config": {"digest": "sha256:c0"}}', stderr=b"")

    monkeypatch.setattr(registry.shutil, "which", lambda name: "/usr/bin/skopeo")
    monkeypatch.setattr(registry.subprocess, "run", run)
    client = registry.RegistryAPI(REG, {"username": "ci", "password": "s3cret"}, None)
    remote = client.manifest(MATRIX.images[0], "v2.7")
    assert remote.config == "sha256:c0" and remote.digest.startswith("sha256:")
    assert not any("s3cret" in a for a in seen["cmd"])
    assert seen["auth"] == {"auths": {"127.0.0.1:5000": {"auth": base64.b64encode(b"ci:s3cret").decode()}}}
    assert not os.path.exists(seen["path"]) and seen["path"].startswith(seen["home"])
    assert "--tls-verify=false" in seen["cmd"] and seen["cmd"][-1] == "docker://127.0.0.1:5000/ml/pytorch-cuda:v2.7"


def test_without_skopeo_the_read_back_says_what_to_install(monkeypatch):
    monkeypatch.setattr(registry.shutil, "which", lambda name: None)
    with pytest.raises(EnvironmentProblem, match="skopeo is not installed"):
        registry.RegistryAPI(REG, None, None).manifest(MATRIX.images[0], "v2.7")


def test_ping_reads_the_repository_published_to_not_a_made_up_one(monkeypatch):
    """A registry like Docker Hub denies a token for a repository the account cannot see."""
    asked = []
    client = registry.RegistryAPI(REG, None, None)
    monkeypatch.setattr(client, "_read", lambda name, tag: asked.append((name, tag)))
    client.ping(MATRIX.images[0])
    assert asked == [("ml/pytorch-cuda", "pytorch-cuda-ping")]


# ---- the dated tag ---------------------------------------------------------------------

def test_dated_tag_is_row_commit_day_and_lock():
    assert publish.dated_tag(ROW, LABELS, "ref") == "2.7.1-cuda12.1-runtime-20261122-7904bf67"


def test_dated_tag_day_is_utc_not_the_local_offset():
    # 23:30 at UTC-05:00 is the next day in UTC.
    labels = {**LABELS, publish.CREATED_LABEL: "2026-11-22T23:30:00-05:00"}
    assert publish.dated_tag(ROW, labels, "ref").endswith("-20261123-7904bf67")


@pytest.mark.parametrize(("labels", "needle"), [
    ({}, publish.LOCK_LABEL),
    ({publish.CREATED_LABEL: "2026-11-22T00:00:00Z"}, publish.LOCK_LABEL),
    ({publish.CREATED_LABEL: "2026-11-22T00:00:00Z", publish.LOCK_LABEL: "7904bf67"}, publish.LOCK_LABEL),
    ({publish.LOCK_LABEL: LOCK}, publish.CREATED_LABEL),
    ({publish.LOCK_LABEL: LOCK, publish.CREATED_LABEL: "yesterday"}, publish.CREATED_LABEL),
    ({publish.LOCK_LABEL: LOCK, publish.CREATED_LABEL: "1970-01-01T00:00:00Z"}, "without a commit time"),
])
def test_an_image_without_the_labels_gets_no_dated_tag(labels, needle):
    with pytest.raises(ImageUnfit, match=needle) as e:
        publish.dated_tag(ROW, labels, "pytorch-cuda:2.7.1-cuda12.1-runtime")
    assert "rebuild it" in str(e.value) and "\n" not in str(e.value)


# ---- plan: immutable first, never moved --------------------------------------------------

class FakeImage:
    def __init__(self, image_id: str, labels: dict):
        self.id, self.labels = image_id, labels


class FakeClient:
    def __init__(self, image: FakeImage, store: str = "classic", base: bool = True, exports: dict[str, bytes] | None = None):
        self.image, self.store, self.base = image, store, base
        self.images = self
        self.api = ExportingEngine(exports or {})  # the containerd store's `docker save`, of these images

    def get(self, ref):
        if ref == BASE_ID:
            if not self.base:
                raise docker.errors.ImageNotFound("gone")
            return FakeImage(BASE_ID, {})
        return self.image

    def info(self):  # what Docker 26 says of its containerd image store, or 20.10 of overlay2
        if self.store == "containerd":
            return {"Driver": "overlayfs", "DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]]}
        return {"Driver": "overlay2", "DriverStatus": [["Backing Filesystem", "extfs"], ["Supports d_type", "true"]]}


class FakeAPI:
    def __init__(self, remote: dict[str, registry.Remote]):
        self.reg = registry.Registry.parse("127.0.0.1:5000/ml")
        self.remote = remote

    def ping(self, image):
        pass

    def manifest(self, image, tag, repository=None):
        return self.remote.get(f"{repository}:{tag}" if repository else tag)


@pytest.fixture
def tested(monkeypatch):
    monkeypatch.setattr(publish.tags, "passed", lambda image_id, *a: {"mode": "cpu"})


def _plan(remote: dict, store: str = "classic", labels: dict = LABELS, base: bool = True, image_id: str = "sha256:" + "a" * 64,
          exports: dict[str, bytes] | None = None) -> list[publish.Move]:
    c = FakeClient(FakeImage(image_id, labels), store, base, exports)
    return publish.plan(c, FakeAPI(remote), [ROW], retry=lambda fn, what: fn())


def test_plan_pushes_the_base_and_the_dated_tag_first_then_the_moving_tags(tested):
    moves = _plan({})
    assert [(m.base, m.tag, m.immutable) for m in moves] == [
        ("pytorch-cuda-rootfs", BASE_TAG, True),
        ("", "2.7.1-cuda12.1-runtime-20261122-7904bf67", True), ("", "2.7.1-cuda12.1-runtime", False),
        ("", "v2.7-cuda12.1", False), ("", "v2.7", False)]
    assert moves[0].image_id == BASE_ID
    assert moves[0].target(registry.Registry.parse("127.0.0.1:5000/ml")) == f"127.0.0.1:5000/ml/pytorch-cuda-rootfs:{BASE_TAG}"


def test_a_base_tag_holding_another_base_is_refused_like_a_dated_tag(tested):
    other = registry.Remote("sha256:" + "d" * 64, "sha256:" + "c" * 64)
    with pytest.raises(ImmutableTagTaken) as e:
        _plan({f"pytorch-cuda-rootfs:{BASE_TAG}": other})
    line, = e.value.lines()
    assert f"pytorch-cuda-rootfs:{BASE_TAG}" in line and BASE_ID in line


def test_the_record_and_the_table_name_the_base_apart_from_the_row(tested, tmp_path):
    reg = registry.Registry.parse("127.0.0.1:5000/ml")
    moves = _plan({})
    for i, mv in enumerate(moves):
        mv.after = registry.Remote(f"sha256:{i}" + "0" * 63, None)
    publish.write_record(tmp_path, reg, ROW, moves)
    record = json.loads((tmp_path / "published.json").read_text())
    assert record["digest"] == moves[1].after.digest and record["image_id"] == "sha256:" + "a" * 64
    assert record["tags"] == [m.tag for m in moves[1:]]
    assert record["base"] == {"image_id": BASE_ID, "repository": "127.0.0.1:5000/ml/pytorch-cuda-rootfs",
                              "tag": BASE_TAG, "digest": moves[0].after.digest}
    lines = publish.table(moves, reg, push=True)
    assert f"pull by digest: 127.0.0.1:5000/ml/pytorch-cuda@{moves[1].after.digest}" in lines
    assert f"base for rebuilds: 127.0.0.1:5000/ml/pytorch-cuda-rootfs@{moves[0].after.digest}" in lines


@pytest.mark.parametrize(("labels", "base", "needle"), [
    ({k: v for k, v in LABELS.items() if k != publish.BASE_LABEL}, True, "no valid label org.opencontainers.image.base.digest"),
    (LABELS, False, "no longer in this engine's store"),
])
def test_a_row_whose_base_cannot_be_published_is_refused_before_any_push(tested, labels, base, needle):
    with pytest.raises(ImageUnfit, match=needle) as e:
        _plan({}, labels=labels, base=base)
    assert "rebuild" in str(e.value) and "\n" not in str(e.value)


def test_plan_refuses_a_dated_tag_held_by_another_image(tested):
    other = registry.Remote("sha256:" + "d" * 64, "sha256:" + "b" * 64)
    with pytest.raises(ImmutableTagTaken) as e:
        _plan({"2.7.1-cuda12.1-runtime-20261122-7904bf67": other})
    assert e.value.exit_code == 2
    line, = e.value.lines()
    assert "127.0.0.1:5000/ml/pytorch-cuda:2.7.1-cuda12.1-runtime-20261122-7904bf67" in line
    assert other.digest in line and other.config in line and "sha256:" + "a" * 64 in line


def test_plan_lets_moving_tags_move_and_skips_a_dated_tag_already_in_place(tested):
    here = registry.Remote("sha256:" + "d" * 64, "sha256:" + "a" * 64)
    elsewhere = registry.Remote("sha256:" + "e" * 64, "sha256:" + "b" * 64)
    base, *moves = _plan({"2.7.1-cuda12.1-runtime-20261122-7904bf67": here, "2.7.1-cuda12.1-runtime": elsewhere})
    assert moves[0].in_place and not moves[1].in_place and not base.in_place


def test_on_the_containerd_store_the_local_id_is_compared_with_the_manifest_digest(tested):
    """There the image ID is the manifest's digest, and a registry's config digest never equals it."""
    image = oci_export([layer_tar({"f": b"x"})])
    here = registry.Remote(image.image_id, image.config)  # manifest digest = local ID
    config_only = registry.Remote("sha256:" + "e" * 64, image.image_id)  # a classic-store match, not this one
    at = {"image_id": image.image_id, "exports": {image.image_id: image.tar}}
    base, *moves = _plan({"2.7.1-cuda12.1-runtime-20261122-7904bf67": here, "2.7.1-cuda12.1-runtime": config_only}, "containerd", **at)
    assert base.by_manifest and moves[0].by_manifest and moves[0].in_place and not moves[1].in_place
    with pytest.raises(ImmutableTagTaken):
        _plan({"2.7.1-cuda12.1-runtime-20261122-7904bf67": config_only}, "containerd", **at)


# ---- what a push reports: Docker 20.10 an aux record, 26 on the containerd store a status line ----

class PushingClient:
    def __init__(self, events):
        self.events, self.removed = events, []
        self.images = self
        self.api = self

    def get(self, ref):
        return self

    def tag(self, repo, tag):
        pass

    def remove(self, ref, noprune=False):
        self.removed.append(ref)

    def push(self, repo, tag, stream, decode, auth_config):
        yield from self.events


@pytest.mark.parametrize("events,by_manifest,expected", [
    ([{"status": "Pushed"}, {"aux": {"Tag": "t", "Digest": "sha256:" + "1" * 64, "Size": 1}}], False, "sha256:" + "1" * 64),
    ([{"status": "Pushed"}, {"status": f"t: digest: sha256:{'2' * 64} size: 750"}], True, "sha256:" + "2" * 64),
    ([{"status": "Pushed"}], True, "sha256:" + "a" * 64),  # the containerd store's ID is the manifest pushed
])
def test_the_pushed_digest_is_read_from_what_each_engine_says(events, by_manifest, expected):
    mv = publish.Move(ROW, "sha256:" + "a" * 64, "t", True, by_manifest=by_manifest)
    c = PushingClient(events)
    assert publish.push_one(c, mv, registry.Registry.parse("127.0.0.1:5000/ml"), None) == expected
    assert c.removed == ["127.0.0.1:5000/ml/pytorch-cuda:t"]  # the local registry-named tag goes again


def test_a_classic_store_push_that_names_no_digest_is_retried():
    mv = publish.Move(ROW, "sha256:" + "a" * 64, "t", True)
    with pytest.raises(registry.Transient, match="reported no digest"):
        publish.push_one(PushingClient([{"status": "Pushed"}]), mv, registry.Registry.parse("127.0.0.1:5000/ml"), None)
