"""A real daemon: the containers the tool creates are gone afterwards, even when start fails.

Uses the small Debian rootfs image, the default row's base (made with mmdebstrap where this
machine lacks it; no registry, no image build); asserts only on this session's own containers
(label pytorch-cuda.run=<session id>).
"""
from __future__ import annotations

import docker.errors
import pytest

from pytorch_cuda_build.stages import gate

pytestmark = pytest.mark.docker


def ours(client) -> list:
    return client.containers.list(all=True, filters={"label": f"{gate.RUN_LABEL}={gate.RUN_ID}"})


def test_a_container_that_cannot_start_is_removed(docker_client, default_rootfs):
    # The daemon creates it, then start fails (no such executable): it would stay behind, Created.
    with pytest.raises(docker.errors.APIError):
        with gate.throwaway_container(docker_client, default_rootfs, ["/nonexistent-binary"], kind="smoke", log=print):
            pytest.fail("started a container whose command does not exist")
    assert not ours(docker_client)


def test_a_container_is_removed_after_it_ran_and_on_an_error_inside(docker_client, default_rootfs):
    with gate.throwaway_container(docker_client, default_rootfs, ["/bin/sh", "-c", "echo hi"], kind="smoke", log=print) as c:
        assert gate._wait(c, 60) == 0 and c.logs() == b"hi\n"
        assert [x.id for x in ours(docker_client)] == [c.id]
    assert not ours(docker_client)
    with pytest.raises(RuntimeError):
        with gate.throwaway_container(docker_client, default_rootfs, ["/bin/sh", "-c", "sleep 60"], kind="smoke", log=print):
            raise RuntimeError("the step failed while the container ran")
    assert not ours(docker_client)


def test_timeout_kills_and_the_container_goes(docker_client, default_rootfs):
    with gate.throwaway_container(docker_client, default_rootfs, ["/bin/sh", "-c", "sleep 60"], kind="smoke", log=print) as c:
        assert gate._wait(c, 1) == 124
    assert not ours(docker_client)


def test_what_the_image_user_wrote_is_handed_back_to_a_caller_that_is_not_root(docker_client, default_rootfs, tmp_path,
                                                                              monkeypatch):
    """The smoke suite writes its report as uid 1000; a CI runner's user (uid 1001 on GitHub's)
    must be able to read it and remove it. hand_back chowns it in a root container."""
    out = tmp_path / "results"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    with gate.throwaway_container(docker_client, default_rootfs, ["/bin/sh", "-c", "mkdir /results/logs && echo x > /results/logs/a && chmod 600 /results/logs/a"],
                                   kind="smoke", log=print, user="1000", volumes={str(out): {"bind": "/results", "mode": "rw"}}) as c:
        assert c.wait(timeout=60)["StatusCode"] == 0
    assert (out / "logs" / "a").stat().st_uid == 1000
    monkeypatch.setattr(gate.os, "geteuid", lambda: 1001)
    monkeypatch.setattr(gate.os, "getuid", lambda: 1001)
    monkeypatch.setattr(gate.os, "getgid", lambda: 1002)
    gate.hand_back(docker_client, default_rootfs, out, log=print)
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in (out / "logs", out / "logs" / "a")}
    assert owners == {(1001, 1002)}
    assert ours(docker_client) == []
