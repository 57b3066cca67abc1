"""Publishing the tested (2.7, 12.1) image to a real registry on 127.0.0.1.

The registry is Debian's docker-registry, the session's (conftest.session_registry); the tests
stop it mid-push, put it in read-only mode and put it behind htpasswd, and check that no moving
tag (the row's name, the aliases) moves before the dated immutable tag is verified in place, and
that a retry completes the job. That a dated tag never moves: test_immutable_tag.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys

import docker.errors
import pytest

from pytorch_cuda_build.registry import attach
from pytorch_cuda_build.stages import gate, tag
from pytorch_cuda_build.stages import publish as publishing

from helpers import ROOT, config_of, image_exists, run_build_py, shown
from published import DEFAULT, RESULTS, publish, remote_state
from registry import LocalRegistry

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def registry(session_registry):
    return session_registry


@pytest.fixture(scope="module")
def image_id(docker_client, default_build):
    """The row built and tested, as the README builds it: the session's one build of it."""
    return docker_client.images.get(DEFAULT.refs()[0]).id


@pytest.fixture(scope="module")
def config(docker_client, image_id) -> str:
    """The config digest the registry's manifests name for the row (its ID on the classic store)."""
    return config_of(docker_client, image_id)


@pytest.fixture(scope="module")
def all_tags(default_published) -> list[str]:
    """Every tag a publish of the row sets: the dated immutable one first, then the moving ones."""
    return default_published.tags


@pytest.fixture(scope="module")
def pushed(default_published) -> dict:
    """published.json's record of the session's one publish of the row (conftest.default_published:
    the registry stopped under its first run, a second run completing it, signed)."""
    return default_published.record


def test_publish_attaches_the_rows_sbom_beside_its_image(registry, pushed):
    """The SBOM the build wrote, as an artifact whose subject is the pushed image, listed under the
    referrers fallback tag (this registry has no referrers API)."""
    digest = pushed["digest"]
    _, index = registry.manifest(f"ml/{DEFAULT.repository}", attach.fallback_tag(digest))
    (entry,) = [m for m in index["manifests"] if m["artifactType"] == attach.ARTIFACT_TYPE]
    _, artifact = registry.manifest(f"ml/{DEFAULT.repository}", entry["digest"])
    assert artifact["subject"]["digest"] == digest
    assert artifact["layers"][0]["digest"] == "sha256:" + hashlib.sha256((RESULTS / "sbom.cdx.json").read_bytes()).hexdigest()


def test_publish_signs_the_rows_image_under_its_dated_tag(registry, pushed, default_published, all_tags):
    """The signature publish wrote: GPG-signed by the key, naming the pushed manifest digest and
    the dated tag as its identity (the policy's checks on small images: test_signing.py)."""
    digest = pushed["digest"]
    path = default_published.lookaside / "ml" / f"{DEFAULT.repository}@{digest.replace(':', '=')}" / "signature-1"
    assert f"signed {registry.address('ml')}/{DEFAULT.repository}@{digest} as :{all_tags[0]}: {path}" in default_published.retry.stdout
    home = default_published.key / "gnupg"
    out = subprocess.run(["gpg", "--homedir", str(home), "--batch", "--decrypt", str(path)], capture_output=True)
    assert out.returncode == 0 and b"Good signature" in out.stderr, out.stderr
    payload = json.loads(out.stdout)
    assert payload["critical"]["image"]["docker-manifest-digest"] == digest
    assert payload["critical"]["identity"]["docker-reference"] == f"{registry.address('ml')}/{DEFAULT.repository}:{all_tags[0]}"


def test_dry_run_prints_the_moves_and_pushes_nothing(registry, image_id, all_tags):
    proc = publish(registry.address("dry"))
    assert proc.returncode == 0, shown(proc)
    # the row's four tags and, first, the base it was built on
    assert proc.stdout.count("would push") == len(all_tags) + 1 == 5 and "dry run: nothing pushed" in proc.stdout
    assert "/dry/pytorch-cuda-rootfs:bookworm-" in proc.stdout
    assert [r for r in registry.catalog() if r.startswith("dry/")] == []  # the module's other tests push elsewhere


@pytest.mark.fault
def test_registry_stopped_mid_push_moves_no_alias_and_a_retry_completes(registry, config, all_tags, pushed, default_published):
    stopped = default_published.stopped  # the run the registry was stopped under (published.through_a_stop)
    err = stopped["stderr"]
    assert stopped["returncode"] == 1, f"exit {stopped['returncode']}\n{stopped['stdout']}\n{err}"
    assert "stopped at" in err and "Tags now:" in err, err
    assert f"{registry.address('ml')}/pytorch-cuda:v2.7: unknown (registry 127.0.0.1" in err, err
    assert stopped["push_tags_left"] == []  # no local push tag left
    assert all(stopped["remote"][t] is None for t in DEFAULT.tags), stopped["remote"]  # the name and the aliases never moved

    assert default_published.retry.stdout.count("pushed, verified") == 4, default_published.retry.stdout
    assert remote_state(registry, "ml", all_tags) == {t: config for t in all_tags}
    assert registry.manifest("ml/pytorch-cuda", pushed["digest"])[0] == pushed["digest"]


def test_republish_is_idempotent(registry, pushed):
    proc = publish(registry.address("ml"), "--push")
    assert proc.returncode == 0, shown(proc)
    assert proc.stdout.count("already there") == 5 and "pushing" not in proc.stderr, shown(proc)


@pytest.mark.fault
def test_read_only_registry_moves_nothing_then_recovers(registry, config, all_tags):
    registry.start(readonly=True)
    try:
        proc = publish(registry.address("ro"), "--push", "--retries", "2")
        assert proc.returncode == 1, shown(proc)
        assert "attempt 2/2" in proc.stderr, proc.stderr  # retried with backoff before giving up
        for tag in all_tags:
            assert f"{registry.address('ro')}/pytorch-cuda:{tag}: absent" in proc.stderr, proc.stderr
    finally:
        registry.start()
    assert remote_state(registry, "ro", all_tags) == {t: None for t in all_tags}
    proc = publish(registry.address("ro"), "--push")
    assert proc.returncode == 0, shown(proc)
    assert remote_state(registry, "ro", all_tags) == {t: config for t in all_tags}


@pytest.mark.parametrize("address, needle", [
    ("http://127.0.0.1:5000/ml", "malformed registry address"),
    ("127.0.0.1:5000", "malformed registry address"),
    ("127.0.0.1:5000/ML", "malformed registry address"),
    ("127.0.0.1:99999/ml", "port 99999 is not 1-65535"),
    ("127.0.0.1:1/ml", "registry 127.0.0.1:1 unreachable"),
])
def test_bad_registry_address_is_one_line_and_pushes_nothing(address, needle, image_id):
    proc = publish(address, "--push", "--retries", "1")
    assert proc.returncode == 2, shown(proc)
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "pushing" not in proc.stderr


def test_row_never_built_or_never_tested_pushes_nothing(registry, docker_client, image_id):
    proc = run_build_py(ROOT, "publish", "--torch", "2.6", "--registry", registry.address("gate"), "--push")
    assert proc.returncode == 2 and "was never built here" in proc.stderr, shown(proc)
    # An image under the 12.6 row's immutable tag that no test run ever recorded.
    other = DEFAULT.repository + ":2.7.1-cuda12.6-runtime"
    try:
        real = docker_client.images.get(other)  # a real 12.6 build on this machine: put it back after
    except docker.errors.ImageNotFound:
        real = None
    untested = docker_client.images.list(name="pytorch-cuda-rootfs")[0]
    untested.tag(*other.split(":"))
    try:
        proc = run_build_py(ROOT, "publish", "--torch", "2.7", "--cuda", "12.6", "--registry", registry.address("gate"), "--push")
        assert proc.returncode == 2 and "never passed its tests" in proc.stderr, shown(proc)
    finally:
        docker_client.images.remove(other, noprune=True)
        if real is not None:
            real.tag(*other.split(":"))
    assert not [r for r in registry.catalog() if r.startswith("gate/")]


def test_credentials_are_required_used_and_never_printed(tmp_path, image_id):
    secret = "s3cret-Pa55word-for-tests"
    reg = LocalRegistry(tmp_path).start(users={"ci": secret})
    try:
        proc = publish(reg.address("auth"))
        assert proc.returncode == 2 and "needs credentials" in proc.stderr, shown(proc)
        wrong = publish(reg.address("auth"), env={"PYTORCH_CUDA_REGISTRY_USER": "ci", "PYTORCH_CUDA_REGISTRY_PASSWORD": "nope"})
        assert wrong.returncode == 2 and "refused the credentials" in wrong.stderr, shown(wrong)
        good = publish(reg.address("auth"), env={"PYTORCH_CUDA_REGISTRY_USER": "ci", "PYTORCH_CUDA_REGISTRY_PASSWORD": secret})
        assert good.returncode == 0 and good.stdout.count("would push") == 5, shown(good)
        for p in (proc, wrong, good):
            assert secret not in p.stdout + p.stderr
    finally:
        reg.stop()


def test_the_base_is_published_under_the_id_the_row_names(registry, image_id, pushed, docker_client):
    """A rebuild elsewhere gives the publisher's digest only on the same base, and a base rebuilt
    from a mirror that moved is another one: the base goes to the registry, named by the row's label."""
    base_id = docker_client.images.get(image_id).labels[publishing.BASE_LABEL]
    base = pushed["base"]
    assert base["image_id"] == base_id and base["repository"] == f"{registry.address('ml')}/pytorch-cuda-rootfs"
    assert base["tag"].startswith("bookworm-") and base["tag"].endswith("-" + base_id.removeprefix("sha256:")[:12])
    digest, manifest = registry.manifest("ml/pytorch-cuda-rootfs", base["tag"])
    assert digest == base["digest"] and manifest["config"]["digest"] == config_of(docker_client, base_id)
    by_digest = registry.manifest("ml/pytorch-cuda-rootfs", base["digest"])
    assert by_digest is not None and by_digest[0] == digest


@pytest.mark.alone  # the default image is gone until the pull brings it back: no other lane may use it meanwhile
def test_published_image_pulled_back_by_digest_is_the_tested_image_and_runs(registry, image_id, pushed, docker_client, daemon_alone):
    """Delete the image here, pull it by digest: the image ID that comes back is the one that
    passed the session's smoke and structure tests (the ID is the digest of the config, which
    names every layer's content), and it starts and imports the stack. Its smoke suite again
    would test the same bytes a second time (minutes of CI: `build.py test --image` does it by hand)."""
    by_digest = f"{pushed['repository']}@{pushed['digest']}"
    docker_client.images.remove(image_id, force=True)
    try:
        pulled = docker_client.images.pull(by_digest)
        assert pulled.id == image_id  # the very image that passed, byte for byte
        assert tag.reusable_pass(image_id, False, gate.code_hash(ROOT)), "no pass record of this session for the pulled ID"
        out = docker_client.containers.run(by_digest, ["python", "-c", "import torch, deepspeed; print(torch.__version__, deepspeed.__version__)"],
                                           remove=True, environment={"PYTORCH_CUDA_NO_BANNER": "1"}).decode()
        torch, deepspeed = out.splitlines()[-1].split()  # the last line: DeepSpeed's import logs to stdout
        assert (torch.split("+")[0], deepspeed) == (DEFAULT.torch, DEFAULT.deepspeed), out
    finally:  # put the public tags back on the (identical) image, or rebuild if the pull failed
        if image_exists(docker_client, image_id):
            tag.promote(docker_client, DEFAULT, image_id)
            docker_client.images.remove(by_digest, noprune=True)  # the pull's repo@digest entry; the image keeps its tags
        else:
            restored = run_build_py(ROOT, "--torch", "2.7", "--cuda", "12.1", "--quiet", timeout=3600)
            assert restored.returncode == 0, shown(restored)


@pytest.mark.fault
def test_interrupt_during_a_push_moves_no_alias(tmp_path, image_id, docker_client):
    reg = LocalRegistry(tmp_path).start()  # empty: the layers really upload
    try:
        proc = subprocess.Popen([sys.executable, str(ROOT / "build.py"), "publish", "--torch", "2.7", "--cuda", "12.1",
                                 "--registry", reg.address("int"), "--push"], cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        assert reg.wait_for_log("POST /v2/int/pytorch-cuda/blobs/uploads/", timeout=300), reg.log.read_text()[-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, f"{out}\n{err}"
        assert "error: interrupted; no alias moved" in err and f"{reg.address('int')}/pytorch-cuda:v2.7: absent" in err, err
        assert reg.manifest("int/pytorch-cuda", "v2.7") is None and reg.manifest("int/pytorch-cuda", "v2.7-cuda12.1") is None
        assert not docker_client.images.list(name=f"{reg.host}/int/pytorch-cuda")  # its push tag is gone
    finally:
        reg.stop()
