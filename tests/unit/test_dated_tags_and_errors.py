"""Issue 11, without a daemon: the dated immutable tag comes from the image's labels, an
immutable tag is never moved, and a Docker API error reads apart from a daemon gone."""
from __future__ import annotations

import json

import docker.errors
import pytest
import requests
from helpers import ROOT

from pytorch_cuda_build import docker_env, matrix, publish, render
from pytorch_cuda_build.errors import DockerRefused, EnvironmentProblem, ImmutableTagTaken, UsageError

ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
LOCK = "7904bf67" + "0" * 56
BASE_ID = "sha256:" + "b" * 64
LABELS = {publish.CREATED_LABEL: "2026-11-22T23:59:59Z", publish.LOCK_LABEL: LOCK, publish.BASE_LABEL: BASE_ID}
BASE_TAG = render.base_ref(ROW).split(":")[1] + "-" + "b" * 12


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
    with pytest.raises(UsageError, match=needle) as e:
        publish.dated_tag(ROW, labels, "pytorch-cuda:2.7.1-cuda12.1-runtime")
    assert "rebuild it" in str(e.value) and "\n" not in str(e.value)


# ---- plan: immutable first, never moved --------------------------------------------------

class FakeImage:
    def __init__(self, image_id: str, labels: dict):
        self.id, self.labels = image_id, labels


class FakeClient:
    def __init__(self, image: FakeImage, store: str = "classic", base: bool = True):
        self.image, self.store, self.base = image, store, base
        self.images = self

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
    def __init__(self, remote: dict[str, publish.Remote]):
        self.reg = publish.Registry.parse("127.0.0.1:5000/ml")
        self.remote = remote

    def ping(self, image):
        pass

    def manifest(self, image, tag, repository=None):
        return self.remote.get(f"{repository}:{tag}" if repository else tag)


@pytest.fixture
def tested(monkeypatch):
    monkeypatch.setattr(publish.tags, "passed", lambda image_id, *a: {"mode": "cpu"})


def _plan(remote: dict, store: str = "classic", labels: dict = LABELS, base: bool = True) -> list[publish.Move]:
    c = FakeClient(FakeImage("sha256:" + "a" * 64, labels), store, base)
    return publish.plan(c, FakeAPI(remote), [ROW], retry=lambda fn, what: fn())


def test_plan_pushes_the_base_and_the_dated_tag_first_then_the_moving_tags(tested):
    moves = _plan({})
    assert [(m.base, m.tag, m.immutable) for m in moves] == [
        ("pytorch-cuda-rootfs", BASE_TAG, True),
        ("", "2.7.1-cuda12.1-runtime-20261122-7904bf67", True), ("", "2.7.1-cuda12.1-runtime", False),
        ("", "v2.7-cuda12.1", False), ("", "v2.7", False)]
    assert moves[0].image_id == BASE_ID
    assert moves[0].target(publish.Registry.parse("127.0.0.1:5000/ml")) == f"127.0.0.1:5000/ml/pytorch-cuda-rootfs:{BASE_TAG}"


def test_a_base_tag_holding_another_base_is_refused_like_a_dated_tag(tested):
    other = publish.Remote("sha256:" + "d" * 64, "sha256:" + "c" * 64)
    with pytest.raises(ImmutableTagTaken) as e:
        _plan({f"pytorch-cuda-rootfs:{BASE_TAG}": other})
    line, = e.value.lines()
    assert f"pytorch-cuda-rootfs:{BASE_TAG}" in line and BASE_ID in line


def test_the_record_and_the_table_name_the_base_apart_from_the_row(tested, tmp_path):
    reg = publish.Registry.parse("127.0.0.1:5000/ml")
    moves = _plan({})
    for i, mv in enumerate(moves):
        mv.after = publish.Remote(f"sha256:{i}" + "0" * 63, None)
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
    with pytest.raises(UsageError, match=needle) as e:
        _plan({}, labels=labels, base=base)
    assert "rebuild" in str(e.value) and "\n" not in str(e.value)


def test_plan_refuses_a_dated_tag_held_by_another_image(tested):
    other = publish.Remote("sha256:" + "d" * 64, "sha256:" + "b" * 64)
    with pytest.raises(ImmutableTagTaken) as e:
        _plan({"2.7.1-cuda12.1-runtime-20261122-7904bf67": other})
    assert e.value.exit_code == 2
    line, = e.value.lines()
    assert "127.0.0.1:5000/ml/pytorch-cuda:2.7.1-cuda12.1-runtime-20261122-7904bf67" in line
    assert other.digest in line and other.config in line and "sha256:" + "a" * 64 in line


def test_plan_lets_moving_tags_move_and_skips_a_dated_tag_already_in_place(tested):
    here = publish.Remote("sha256:" + "d" * 64, "sha256:" + "a" * 64)
    elsewhere = publish.Remote("sha256:" + "e" * 64, "sha256:" + "b" * 64)
    base, *moves = _plan({"2.7.1-cuda12.1-runtime-20261122-7904bf67": here, "2.7.1-cuda12.1-runtime": elsewhere})
    assert moves[0].in_place and not moves[1].in_place and not base.in_place


def test_on_the_containerd_store_the_local_id_is_compared_with_the_manifest_digest(tested):
    """There the image ID is the manifest's digest, and a registry's config digest never equals it."""
    here = publish.Remote("sha256:" + "a" * 64, "sha256:" + "c" * 64)  # manifest digest = local ID
    config_only = publish.Remote("sha256:" + "e" * 64, "sha256:" + "a" * 64)  # a classic-store match, not this one
    base, *moves = _plan({"2.7.1-cuda12.1-runtime-20261122-7904bf67": here, "2.7.1-cuda12.1-runtime": config_only}, "containerd")
    assert base.by_manifest and moves[0].by_manifest and moves[0].in_place and not moves[1].in_place
    with pytest.raises(ImmutableTagTaken):
        _plan({"2.7.1-cuda12.1-runtime-20261122-7904bf67": config_only}, "containerd")


# ---- Docker errors: refused (with status and message) or gone ----------------------------

class FakeResponse:
    """What docker-py reads from a requests.Response when it builds an APIError."""

    def __init__(self, status: int, message: str, reason: str = "Internal Server Error"):
        self.status_code, self.reason, self.url = status, reason, "http+docker://localhost/v1.47/containers/create"
        self._message = message
        self.text = f'{{"message": "{message}"}}'

    def json(self):
        return {"message": self._message}


def _api_error(status: int, message: str) -> docker.errors.APIError:
    response = FakeResponse(status, message)
    http = requests.exceptions.HTTPError(f"{status} Server Error", response=response)
    try:  # the SDK's own path from an HTTP error to APIError/NotFound
        docker.errors.create_api_error_from_http_exception(http)
    except docker.errors.APIError as e:
        return e
    raise AssertionError("docker-py raised nothing")


GPU = 'could not select device driver "" with capabilities: [[gpu]]'


def test_an_api_error_is_a_refusal_with_status_and_message():
    err = docker_env.failure("`test`", _api_error(500, GPU))
    assert isinstance(err, DockerRefused) and err.exit_code == 2
    assert str(err).startswith("the Docker daemon at ") and f"refused `test` (500: {GPU})" in str(err)
    assert "stopped answering" not in str(err)


def test_not_found_is_a_refusal_too():
    err = docker_env.failure("`publish`", _api_error(404, "No such image: pytorch-cuda:nope"))
    assert isinstance(err, DockerRefused) and "(404: No such image: pytorch-cuda:nope)" in str(err)


def test_lost_with_an_api_error_names_the_refusal():
    """cli.main maps every SDK error through lost(); an answer must not read as a daemon gone."""
    assert "refused" in str(docker_env.lost("`test`", _api_error(500, GPU)))


def _wrapped(inner: BaseException) -> docker.errors.DockerException:
    try:
        try:
            raise inner
        except BaseException as e:
            raise docker.errors.DockerException(f"Error while fetching server API version: {e}") from e
    except docker.errors.DockerException as outer:
        return outer


@pytest.mark.parametrize("e", [
    requests.exceptions.ConnectionError("('Connection aborted.', ConnectionRefusedError(111, 'Connection refused'))"),
    requests.exceptions.ConnectionError("('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))"),
    _wrapped(requests.exceptions.ConnectionError("('Connection aborted.', FileNotFoundError(2, 'No such file or directory'))")),
    ConnectionRefusedError(111, "Connection refused"),
])
def test_connection_failures_are_a_daemon_gone(e):
    err = docker_env.failure("`build`", e)
    assert not isinstance(err, DockerRefused) and isinstance(err, EnvironmentProblem)
    assert "stopped answering during `build`" in str(err) and "\n" not in str(err)


def test_an_api_error_wrapped_by_the_sdk_is_still_a_refusal():
    err = docker_env.failure("`sbom`", _wrapped(_api_error(500, "disk full")))
    assert isinstance(err, DockerRefused) and "(500: disk full)" in str(err)


def test_cli_prints_an_api_error_as_one_refusal_line(monkeypatch, capsys):
    """End to end through cli.main: the SDK raising APIError mid-command is one line, no traceback."""
    from pytorch_cuda_build import cli

    class Refusing:
        images = property(lambda self: self)

        def get(self, ref):
            raise _api_error(500, GPU)
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: Refusing())
    rc = cli.main(["publish", "--torch", "2.7", "--cuda", "12.1", "--registry", "127.0.0.1:9/ml"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("error: the Docker daemon at ") and f"(500: {GPU})" in err, err


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
    assert publish.push_one(c, mv, publish.Registry.parse("127.0.0.1:5000/ml"), None) == expected
    assert c.removed == ["127.0.0.1:5000/ml/pytorch-cuda:t"]  # the local registry-named tag goes again


def test_a_classic_store_push_that_names_no_digest_is_retried():
    mv = publish.Move(ROW, "sha256:" + "a" * 64, "t", True)
    with pytest.raises(publish.Transient, match="reported no digest"):
        publish.push_one(PushingClient([{"status": "Pushed"}]), mv, publish.Registry.parse("127.0.0.1:5000/ml"), None)
