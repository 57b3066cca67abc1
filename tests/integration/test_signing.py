"""Signed images against a registry on 127.0.0.1, on small images: a key made by `build.py
signing-key`, an image signed as publish signs it (registry/sign.py: skopeo --sign-by into a
lookaside directory), and the documented containers policy and registries.d (sign.policy,
sign.registries_d, as docs/security.md gives them) read by skopeo: the signed image passes,
and an unsigned one, another image put under the signed tag, and the signed image copied to
another repository are refused. The default row's own signature is test_publish.py's
(publish --sign-key)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest

from pytorch_cuda_build.registry import sign
from pytorch_cuda_build.registry.client import Registry, RegistryAPI

from helpers import ROOT, run_build_py
from registry import LocalRegistry, push_small, require_binary, small_image

pytestmark = [pytest.mark.docker]

DOCKER = "/usr/bin/docker"
PASSPHRASE = {sign.PASSPHRASE_ENV: "correct horse battery staple"}
DATED = "2.7.1-cuda12.1-runtime-20261127-test"


def copy(source: str, dest: str) -> None:
    subprocess.run(["skopeo", "copy", "--insecure-policy", "--src-tls-verify=false", "--dest-tls-verify=false", "--preserve-digests",
                    f"docker://{source}", f"docker://{dest}"], check=True, capture_output=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, docker_client):
    require_binary()
    if not shutil.which("skopeo") or not shutil.which("gpg"):
        pytest.fail("skopeo and gpg: engine.sh --with-registry installs them")
    tmp = tmp_path_factory.mktemp("signing")
    reg = LocalRegistry(tmp / "registry").start()
    made = run_build_py(ROOT, "signing-key", str(tmp / "key"), env=PASSPHRASE)
    assert made.returncode == 0, made.stderr
    repo = f"{reg.address('ml')}/pytorch-cuda"
    signed, unsigned = small_image(tmp, {"/f": "signed"}), small_image(tmp, {"/f": "unsigned"})
    signed_digest = push_small(signed, f"{repo}:{DATED}")
    unsigned_digest = push_small(unsigned, f"{repo}:unsigned")
    api = RegistryAPI(Registry(reg.host, "ml"), None, None)
    os.environ.update(PASSPHRASE)
    try:
        written = sign.sign(api, "pytorch-cuda", signed_digest, DATED, tmp / "key", tmp / "lookaside")
    finally:
        del os.environ[sign.PASSPHRASE_ENV]
    users = tmp / "users"  # what a user sets up from docs/security.md
    sign.registries_d(users / "registries.d", reg.address("ml"), (tmp / "lookaside").as_uri(), staging=False)
    (users / "policy.json").write_text(json.dumps(sign.policy(tmp / "key" / sign.PUBLIC, repo)))
    try:
        yield {"reg": reg, "repo": repo, "tmp": tmp, "users": users, "signed": signed_digest, "unsigned": unsigned_digest,
               "written": written}
    finally:
        reg.stop()
        subprocess.run([DOCKER, "image", "rm", "--force", signed, unsigned], capture_output=True)


def pull(setup, ref: str, policy: str = "policy.json") -> subprocess.CompletedProcess:
    """What a user's skopeo (or podman, same library) does with the documented policy: copy the image out, or refuse."""
    dest = setup["tmp"] / f"out-{uuid.uuid4().hex[:6]}"
    return subprocess.run(["skopeo", f"--policy={setup['users'] / policy}", f"--registries.d={setup['users'] / 'registries.d'}",
                           "copy", "--src-tls-verify=false", f"docker://{ref}", f"dir:{dest}"], capture_output=True, text=True)


def test_the_key_is_refused_again_and_the_signature_lies_where_a_lookaside_reads_it(setup):
    again = run_build_py(ROOT, "signing-key", str(setup["tmp"] / "key"), env=PASSPHRASE)
    assert again.returncode == 2 and "exists: a new key never replaces one" in again.stderr
    digest_hex = setup["signed"].split(":")[1]
    assert setup["written"] == setup["tmp"] / "lookaside" / "ml" / f"pytorch-cuda@sha256={digest_hex}" / "signature-1"


@pytest.mark.parametrize("how", ["by digest", "by its dated tag", "by another tag of the same digest"])
def test_the_signed_image_passes_the_policy(setup, how):
    ref = {"by digest": f"{setup['repo']}@{setup['signed']}", "by its dated tag": f"{setup['repo']}:{DATED}"}.get(how)
    if ref is None:
        ref = f"{setup['repo']}:v2.7-{uuid.uuid4().hex[:6]}"
        copy(f"{setup['repo']}@{setup['signed']}", ref)  # a moving tag publish sets to the same manifest
    proc = pull(setup, ref)
    assert proc.returncode == 0, proc.stderr


def test_an_unsigned_image_is_refused(setup):
    proc = pull(setup, f"{setup['repo']}@{setup['unsigned']}")
    assert proc.returncode != 0 and "signature" in proc.stderr.lower(), proc.stderr


def test_another_image_put_under_the_signed_tag_is_refused(setup):
    """Tampering in the registry: a tag of the signed repository now names an image no signature covers."""
    tag = f"{setup['repo']}:{DATED}-tampered"
    copy(f"{setup['repo']}@{setup['unsigned']}", tag)
    proc = pull(setup, tag)
    assert proc.returncode != 0 and "signature" in proc.stderr.lower(), proc.stderr


def test_the_signed_image_copied_to_another_repository_is_refused(setup):
    """A re-tagged copy in another repository that the key is also trusted for: the signature
    (copied into that repository's lookaside path too) names the original repository."""
    other = f"{setup['reg'].address('ml')}/copied"
    copy(f"{setup['repo']}@{setup['signed']}", f"{other}:v1")
    digest_dir = f"@{setup['signed'].replace(':', '=')}"
    source = setup["tmp"] / "lookaside" / "ml" / f"pytorch-cuda{digest_dir}"
    shutil.copytree(source, setup["tmp"] / "lookaside" / "ml" / f"copied{digest_dir}")
    (setup["users"] / "policy-other.json").write_text(json.dumps(sign.policy(setup["tmp"] / "key" / sign.PUBLIC, other)))
    proc = pull(setup, f"{other}:v1", "policy-other.json")
    assert proc.returncode != 0 and "ml/pytorch-cuda:" in proc.stderr and "is not accepted" in proc.stderr, proc.stderr
