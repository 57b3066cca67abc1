"""docker_env's reading of Docker's errors, without a daemon: an API error is the daemon refusing
(with its status and message), a lost connection is the daemon gone, and the CLI prints
either as one line."""
from __future__ import annotations

import docker.errors
import pytest
import requests
import urllib3.exceptions

from pytorch_cuda_build import errors
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import BuildError, CommandFailed, DockerRefused, EngineLost, EnvironmentProblem, NotReady


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


@pytest.fixture(autouse=True)
def daemon_answers(monkeypatch):
    """A daemon that answers the ping failure() sends after a server error (no real one is asked)."""
    monkeypatch.setattr(docker_env, "_daemon_answers", lambda: True)


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


def test_a_server_error_with_no_daemon_behind_it_is_a_daemon_lost(monkeypatch):
    """A 5xx from a daemon dying mid-request (or a proxy before a dead one): a ping after it finds
    no daemon, so it reads as the daemon gone, with the stage and what to do; a 4xx never does."""
    monkeypatch.setattr(docker_env, "_daemon_answers", lambda: False)
    err = docker_env.failure("the gate", _api_error(500, "connection reset by peer"))
    assert isinstance(err, EngineLost) and err.exit_code == 2 and err.stage == "the gate"
    assert str(err) == (f"the Docker daemon at {docker_env.daemon_address()} stopped answering during the gate "
                        "(500: connection reset by peer); start it and run the same command again: no tag was moved")
    assert isinstance(docker_env.failure("the gate", _api_error(404, "No such container: x")), DockerRefused)


@pytest.mark.parametrize("e", [
    requests.exceptions.ChunkedEncodingError("('Connection broken: IncompleteRead(0 bytes read)')"),
    requests.exceptions.ReadTimeout("UnixHTTPConnectionPool(host='localhost', port=None): Read timed out. (read timeout=60)"),
    urllib3.exceptions.ProtocolError("('Connection aborted.', RemoteDisconnected('Remote end closed connection'))"),
    ConnectionResetError(104, "Connection reset by peer"),
])
def test_calls_turns_each_transport_failure_into_one_engine_lost_line(e):
    with pytest.raises(EngineLost) as info:
        with docker_env.calls("the tag", "the tags moved so far name the tested image"):
            raise e
    line = str(info.value)
    assert "\n" not in line and "stopped answering during the tag" in line
    assert line.endswith("start it and run the same command again: the tags moved so far name the tested image")


def test_calls_lets_our_errors_and_bugs_through_unchanged():
    with pytest.raises(NotReady):
        with docker_env.calls("the gate"):
            raise NotReady("no image x", ref="x")
    with pytest.raises(KeyError):  # a bug of ours: the CLI shows its traceback
        with docker_env.calls("the gate"):
            raise KeyError("x")


class Daemon:
    def __init__(self, up: bool):
        self.up = up

    def ping(self):
        if not self.up:
            raise requests.exceptions.ConnectionError("('Connection aborted.', FileNotFoundError(2, 'No such file or directory'))")
        return True


@pytest.mark.parametrize("failed", [BuildError("step [runtime 3/9] RUN x", "build.log"),
                                    errors.TestFailure("structure tests", "3 failed", "structure.log"),
                                    CommandFailed("docker save x", 1, "EOF")])
def test_a_failed_step_after_which_the_daemon_is_gone_names_the_daemon(failed):
    """A step that failed because the daemon died reads as the daemon lost; with the daemon still
    there, the step's own failure stands."""
    with pytest.raises(EngineLost, match="stopped answering during the build; start it"):
        with docker_env.calls("the build", c=Daemon(up=False)):
            raise failed
    with pytest.raises(type(failed)):
        with docker_env.calls("the build", c=Daemon(up=True)):
            raise failed
