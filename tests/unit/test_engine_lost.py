"""A Docker daemon that stops answering, stage by stage, with fake clients (no daemon): each failure
(a reply cut short, a connection refused or reset, a timeout) is one line of the error tree naming
the stage and what to do, through the CLI's one handler, with no traceback and no tag moved; and
where a command means "no such image", only that reads as "build it first"."""
from __future__ import annotations

import io
import time
from pathlib import Path
from types import SimpleNamespace

import docker.errors
import pytest
import requests

from pytorch_cuda_build import cli, console, matrix, pipeline
from pytorch_cuda_build.commands import record, verify
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import BuildError, EngineLost, NotReady
from pytorch_cuda_build.registry.client import Registry, Transient
from pytorch_cuda_build.stages import publish
from pytorch_cuda_build.tooling import bench

from helpers import ROOT

ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
CUT_SHORT = requests.exceptions.ChunkedEncodingError("('Connection broken: IncompleteRead(0 bytes read, 2 more expected)')")
RESET = requests.exceptions.ConnectionError("('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))")
REFUSED = requests.exceptions.ConnectionError("('Connection aborted.', ConnectionRefusedError(111, 'Connection refused'))")
TIMEOUT = requests.exceptions.ReadTimeout("UnixHTTPConnectionPool(host='localhost', port=None): Read timed out. (read timeout=600)")


def raising(e: BaseException):
    def fail(*args, **kwargs):
        raise e
    return fail


class Gone:
    """A daemon that answered once and now answers nothing: every call fails as `e`."""

    def __init__(self, e: BaseException = REFUSED):
        self.e = e
        self.images = SimpleNamespace(get=raising(e), remove=raising(e))
        self.containers = SimpleNamespace(create=raising(e), get=raising(e), list=raising(e))
        self.ping = self.info = self.version = raising(e)


@pytest.fixture(autouse=True)
def no_daemon_behind(monkeypatch):
    monkeypatch.setattr(docker_env, "_daemon_answers", lambda: False)


def one_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- the gate ---------------------------------------------------------------------------------------


class DyingMidSmoke:
    """The image is there; the smoke container starts; the daemon dies while the suite runs, so the
    reply to the wait is cut short and the removal after it finds no daemon (as seen: issue 61)."""

    def __init__(self):
        self.images = SimpleNamespace(get=lambda ref: SimpleNamespace(id="sha256:" + "a" * 64))
        self.created: list[dict] = []
        self.containers = SimpleNamespace(create=self._create, get=raising(REFUSED))

    def _create(self, image, command, name, labels, **opts):
        self.created.append(labels)
        return SimpleNamespace(start=lambda: None, wait=raising(CUT_SHORT), logs=lambda: b"")


def test_the_daemon_dying_during_the_smoke_suite_is_one_line_naming_the_gate(monkeypatch, tmp_path, capsys):
    daemon = DyingMidSmoke()
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: daemon)
    monkeypatch.setattr(docker_env, "gpu_request", lambda c: None)
    monkeypatch.setattr(pipeline, "results_dir", lambda root, image: tmp_path / image.name)
    rc = cli.main(["test", "--torch", "2.7", "--cuda", "12.1"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert one_error(err) == (f"error: the Docker daemon at {docker_env.daemon_address()} stopped answering during the gate "
                              f"({CUT_SHORT}); start it and run the same command again: no tag was moved")
    # what it could not remove is said, and the next run removes it (its labels name this process)
    assert "the next run removes it" in err and daemon.created and "pytorch-cuda.pid" in daemon.created[0]
    assert not (tmp_path / ROW.name / "smoke-report.json").exists()
    assert pipeline.tag.passed("sha256:" + "a" * 64) is None  # no pass recorded


def test_test_says_build_it_first_only_when_the_image_is_missing(monkeypatch, tmp_path):
    """pipeline.test_image: ImageNotFound is "build it first"; a daemon gone is never read as that."""
    missing = SimpleNamespace(images=SimpleNamespace(get=raising(docker.errors.ImageNotFound("No such image: pytorch-cuda:v2.7"))))
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: missing)
    with pytest.raises(NotReady, match="no image pytorch-cuda:v2.7 on this daemon; build it first"):
        pipeline.test_image(tmp_path, ROW, "pytorch-cuda:v2.7", False, lambda m: None)
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: Gone(TIMEOUT))
    with pytest.raises(EngineLost, match="stopped answering during the gate"):
        pipeline.test_image(tmp_path, ROW, "pytorch-cuda:v2.7", False, lambda m: None)


# ---- a row's stages: build, tag ----------------------------------------------------------------------


def row(tmp_path: Path) -> pipeline._Row:
    return pipeline._Row(tmp_path, ROW, pipeline.Options(), console.Quiet(err=io.StringIO()))


def test_a_build_step_that_failed_because_the_daemon_died_names_the_daemon(tmp_path):
    with pytest.raises(EngineLost, match=r"stopped answering during the build; start it and run the same command again: no tag was moved$"):
        with row(tmp_path).stage("build", Gone()):
            raise BuildError("step [runtime 4/9] RUN pip install", str(tmp_path / "build.log"))


def test_the_daemon_dying_between_two_tag_moves_says_the_moved_tags_name_the_tested_image(tmp_path):
    moved: list[tuple[str, str]] = []

    def tag(repo, t):
        if moved:
            raise RESET
        moved.append((repo, t))

    image = SimpleNamespace(tag=tag, attrs={"Size": 1})
    c = SimpleNamespace(images=SimpleNamespace(get=lambda ref: image, remove=lambda *a, **k: None))
    r = row(tmp_path)
    r.result.image_id = "sha256:" + "b" * 64
    with pytest.raises(EngineLost) as info:
        r.promote(c, publish=False)
    assert "stopped answering during the tag" in str(info.value)
    assert str(info.value).endswith("the tags moved so far name the tested image, none an untested one")
    assert moved == [tuple(ROW.refs()[0].rsplit(":", 1))]  # the row's own tag first, at the tested image
    assert not (tmp_path / "build-results").exists()  # no summary written for a row not tagged whole


def test_the_vulnerabilities_stage_is_no_docker_stage(tmp_path):
    """PyPI's and Debian's network errors there are never read as the daemon's."""
    with pytest.raises(requests.exceptions.ConnectionError):
        with row(tmp_path).stage("vulnerabilities", docker=False):
            raise REFUSED


# ---- publish ----------------------------------------------------------------------------------------


def test_a_push_the_daemon_cut_short_is_a_retried_failure_naming_the_push():
    reg = Registry.parse("127.0.0.1:5000/ml")
    mv = publish.Move(ROW, "sha256:" + "c" * 64, "v2.7", immutable=False)

    def push(repo, tag, stream, decode, auth_config):
        yield {"status": "Pushing"}
        raise CUT_SHORT

    c = SimpleNamespace(images=SimpleNamespace(get=lambda ref: SimpleNamespace(tag=lambda repo, t: None), remove=raising(REFUSED)),
                        api=SimpleNamespace(push=push))
    with pytest.raises(Transient, match=r"stopped answering during the push of 127\.0\.0\.1:5000/ml/pytorch-cuda:v2\.7 .*"
                                         r"the tags pushed before it name tested images"):
        publish.push_one(c, mv, reg, None)


def test_the_daemon_gone_before_a_publish_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: Gone(RESET))
    rc = cli.main(["publish", "--torch", "2.7", "--cuda", "12.1", "--registry", "127.0.0.1:9/ml"])
    line = one_error(capsys.readouterr().err)
    assert rc == 2 and "stopped answering during the publish" in line
    assert line.endswith("every tag the registry holds names a tested image; the same command finishes the push")


# ---- record, verify ---------------------------------------------------------------------------------


def test_the_daemon_gone_during_record_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: Gone(TIMEOUT))
    monkeypatch.setattr(docker_env, "build_client", lambda docker=None: docker_env.BuildClient(("docker", "build"), {}, "docker"))
    out = tmp_path / "record.json.xz"
    with pytest.raises(EngineLost, match="stopped answering during the record"):
        record.record_local("pytorch-cuda:v2.7", ROW.name, out, None, lambda m: None)
    assert list(tmp_path.iterdir()) == []


def test_a_save_cut_short_by_the_daemon_is_the_daemon_lost(monkeypatch, tmp_path):
    """`docker save` dies with the daemon, half a tar written: the save's own failure, and with
    the daemon gone after it, the daemon is named; never a tar error's traceback."""
    cli_stub = tmp_path / "docker"
    cli_stub.write_text("#!/bin/sh\nhead -c 700 /dev/zero\necho 'error during connect: EOF' >&2\nexit 1\n")
    cli_stub.chmod(0o755)
    image = SimpleNamespace(id="sha256:" + "d" * 64)
    c = SimpleNamespace(images=SimpleNamespace(get=lambda ref: image), version=lambda: {"Version": "20.10"}, info=lambda: {},
                        ping=raising(REFUSED))
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: c)
    monkeypatch.setattr(docker_env, "build_client", lambda docker=None: docker_env.BuildClient((str(cli_stub), "build"), {}, "stub"))
    with pytest.raises(EngineLost, match="stopped answering during the record"):
        record.record_local("pytorch-cuda:v2.7", ROW.name, tmp_path / "out.json.xz", None, lambda m: None)
    assert not (tmp_path / "out.json.xz").exists()


def test_the_daemon_gone_during_verify_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: Gone(RESET))
    monkeypatch.setattr(docker_env, "build_client", lambda docker=None: docker_env.BuildClient(("docker", "build"), {}, "docker"))
    with pytest.raises(EngineLost, match="stopped answering during the verify"):
        verify.run(tmp_path, ROW, tmp_path / "verify", None, None, lambda m: None)


def test_verify_and_bench_catch_only_a_missing_image():
    """What they mean is "no such image"; a daemon gone goes up, to be named at the boundary."""
    absent = SimpleNamespace(images=SimpleNamespace(get=raising(docker.errors.ImageNotFound("no such image")),
                                                    remove=raising(docker.errors.ImageNotFound("no such image"))))
    verify._remove(absent, "pytorch-cuda-verify:x-1")
    assert bench._exists(absent, "pytorch-cuda:v2.11-arm64") is False
    with pytest.raises(requests.exceptions.ConnectionError):
        verify._remove(Gone(), "pytorch-cuda-verify:x-1")
    with pytest.raises(requests.exceptions.ConnectionError):
        bench._exists(Gone(), "pytorch-cuda:v2.11-arm64")
    said: list[str] = []
    verify._remove_leaving(Gone(), "pytorch-cuda-verify:x-1", said.append)  # on the way out: said, never masking
    assert said and "could not remove pytorch-cuda-verify:x-1" in said[0] and "docker image rm" in said[0]


# ---- the smoke follower (display only) ------------------------------------------------------------


class Following(console.Quiet):
    follows_smoke = True


@pytest.mark.parametrize("e", [RESET, CUT_SHORT, docker.errors.NotFound("No such container")])
def test_the_smoke_follower_rides_over_the_daemons_errors(e):
    with pipeline.following_smoke(SimpleNamespace(containers=SimpleNamespace(list=raising(e))), "sha256:x", Following(err=io.StringIO())):
        pass


def test_a_bug_in_the_smoke_follower_reaches_the_caller():
    polled: list[int] = []

    def broken(**kwargs):
        polled.append(1)
        raise KeyError("Image")

    with pytest.raises(KeyError):  # raised once the gate is over, in the caller's thread
        with pipeline.following_smoke(SimpleNamespace(containers=SimpleNamespace(list=broken)), "sha256:x", Following(err=io.StringIO())):
            while not polled:  # the gate runs while the follower polls once
                time.sleep(0.01)
