"""verify --image against a registry on 127.0.0.1, on small images (a few files FROM scratch)
labelled as build.py labels the default row: the published image against a local one
(`--against`), with the exit codes and lines a user gets. The full path, a rebuild of the
default row with the ops compiled (about 30 min on 2 cores), runs on request:
PYTORCH_CUDA_TEST_VERIFY_IMAGE=1 (docs/testing.md)."""
from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from pytorch_cuda_build.stages import build

from helpers import ROOT, default_image, run_build_py, sources_gone
from registry import LocalRegistry, push_small, require_binary, small_image

pytestmark = [pytest.mark.docker]

DOCKER = "/usr/bin/docker"
ROW = "2.7.1-cuda12.1-runtime"


def small(tmp_path, motd: str, revision: str | None = None) -> str:
    """Two files, labelled as build.py labels the default row."""
    labels = {"org.opencontainers.image.revision": revision or build.source(ROOT).revision, "io.pytorch-cuda.image": ROW}
    return small_image(tmp_path, {"/etc/motd": motd, "/etc/os-release": "ID=test\n"}, labels)


@pytest.fixture(scope="module")
def published(tmp_path_factory, docker_client):
    require_binary()
    tmp = tmp_path_factory.mktemp("verify-image")
    reg = LocalRegistry(tmp / "registry").start()
    made = uuid.uuid4().hex[:8]
    local = small(tmp, f"published {made}\n")
    digest = push_small(local, f"{reg.address('ml')}/pytorch-cuda:verify-{made}")
    other = small(tmp, f"changed {made}\n")
    elsewhere = small(tmp, f"published {made}\n", revision="0" * 40)
    elsewhere_digest = push_small(elsewhere, f"{reg.address('ml')}/pytorch-cuda:verify-{made}-c")
    try:
        yield {"reg": reg, "ref": f"{reg.address('ml')}/pytorch-cuda@{digest}", "local": local, "other": other,
               "elsewhere": f"{reg.address('ml')}/pytorch-cuda@{elsewhere_digest}"}
    finally:
        reg.stop()
        subprocess.run([DOCKER, "image", "rm", "--force", local, other, elsewhere], capture_output=True)


def test_the_published_image_and_the_same_local_build_are_one_image(published):
    proc = run_build_py(ROOT, "verify", "--image", published["ref"], "--against", published["local"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: THE SAME IMAGE" in proc.stdout


def test_an_image_that_differs_in_one_file_is_exit_1_and_names_it(published):
    proc = run_build_py(ROOT, "verify", "--image", published["ref"], "--against", published["other"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "differing layers: 0" in proc.stdout and "layer 0: etc/motd:" in proc.stdout, proc.stdout
    assert "etc/os-release" not in proc.stdout  # the file that is the same is not named
    assert "verdict: DIFFERENT" in proc.stdout


def test_a_checkout_at_another_commit_is_refused_in_one_line(published):
    proc = run_build_py(ROOT, "verify", "--image", published["elsewhere"], "--against", published["local"])
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and f"was built from {'0' * 40}: git checkout {'0' * 40}" in err[0], err


def test_a_digest_the_registry_does_not_have_is_bad_input(published):
    missing = published["ref"].split("@")[0] + "@sha256:" + "e" * 64
    proc = run_build_py(ROOT, "verify", "--image", missing, "--against", published["local"])
    assert proc.returncode == 2 and "is not in the registry" in proc.stderr, proc.stderr


@pytest.mark.skipif(os.environ.get("PYTORCH_CUDA_TEST_VERIFY_IMAGE") != "1",
                    reason="on request: PYTORCH_CUDA_TEST_VERIFY_IMAGE=1 (rebuilds the default row, ops compiled, ~30 min)")
def test_the_default_row_published_then_rebuilt_from_this_checkout_is_the_same_image(tmp_path):
    """The whole path: the default row's tagged image published to 127.0.0.1 with every locked file
    attached beside it, then `verify --image` on a store of its own, empty, with every mirror and
    index gone: it fills the store from the registry, rebuilds without cache and with the ops
    compiled, and finds one config digest."""
    require_binary()
    default_image()  # built and tested in this session (at once where the main lane did)
    reg = LocalRegistry(tmp_path / "registry").start()
    try:
        pushed = run_build_py(ROOT, "publish", "--torch", "2.7", "--cuda", "12.1", "--registry", reg.address("ml"), "--push",
                              "--attach-inputs", "all")
        assert pushed.returncode == 0, pushed.stdout[-3000:] + pushed.stderr[-3000:]
        assert "inputs sha256:" in pushed.stdout, pushed.stdout[-3000:]
        digest = reg.manifest("ml/pytorch-cuda", "v2.7")[0]
        with sources_gone() as (gone, cut):
            proc = run_build_py(ROOT, "verify", "--image", f"{reg.address('ml')}/pytorch-cuda@{digest}", timeout=7200,
                                env={**cut, "PYTORCH_CUDA_STORE": str(tmp_path / "empty-store")})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "fetch: the files attached beside" in proc.stderr and gone.asked == [], (gone.asked[:5], proc.stderr[-3000:])
    finally:
        reg.stop()
