"""No secret in any layer of the tested default image: the build's CA bundle (a BuildKit
secret), private keys, ssh host keys (sshd mode makes them per container) and Jupyter tokens,
searched in every file of every layer that `docker save` writes, and in the history and config;
and the scan itself shown to find such files where they are.

Read-only on the tested image: the whole suite runs this module in its second lane
(tooling/selftest.py), beside the main lane."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from helpers import PRIVATE_KEYS, SECRET_FILES, default_image, scan_layers

pytestmark = [pytest.mark.docker, pytest.mark.second_lane]


@pytest.fixture(scope="module")
def image(docker_client, default_build) -> str:
    # default_build first: the session's one tested build, which default_image() then finds done
    return default_image()


def _pem_blocks(text: str) -> set[str]:
    import re

    return {m.replace("\r", "").strip() for m in re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text, re.S)}


def _host_public_cas() -> set[str]:
    """Debian's Mozilla set on this host (ca-certificates), none where the host has no such copy."""
    return {b for f in Path("/usr/share/ca-certificates/mozilla").glob("*.crt") for b in _pem_blocks(f.read_text())}


def test_no_secret_in_any_layer(image, docker_client):
    """The secret scan over every file of every layer of the tested image: the build's CA bundle
    (a BuildKit secret), private keys, ssh host keys (sshd mode makes them per container) and
    Jupyter tokens; and over its history and config."""
    from pytorch_cuda_build.ca import default_ca_bundle

    history = json.dumps(docker_client.api.history(image))
    config = json.dumps(docker_client.images.get(image).attrs["Config"])
    needles = []
    bundle = default_ca_bundle()
    if bundle:
        # Public CAs the image ships anyway: Debian's set and the copies Python packages vendor (certifi).
        baked = docker_client.containers.run(
            image, ["sh", "-c", "cat /etc/ssl/certs/ca-certificates.crt; find /opt/venv -name cacert.pem -exec cat {} +"],
            remove=True, environment={"PYTORCH_CUDA_NO_BANNER": "1"}).decode()
        # Also the host's own copy of Mozilla's set: a host whose ca-certificates is older than the
        # image's still trusts CAs since removed (TrustCor, E-Tugra), and Debian's bootstrap pip,
        # which an early layer keeps, vendors them too. What is left is the host's local additions.
        private = _pem_blocks(open(bundle).read()) - _pem_blocks(baked) - _host_public_cas()  # e.g. a TLS proxy's CA
        # The second line of a PEM certificate (64 base64 characters) identifies it.
        needles += [p.split("\n")[1].encode() for p in private]
        assert bundle not in history + config
    for text in (history, config):
        assert "BEGIN CERTIFICATE" not in text and "PRIVATE KEY" not in text and "JUPYTER_TOKEN" not in text
        assert not any(n.decode() in text for n in needles)
    layers, hits = scan_layers(image, needles, SECRET_FILES, heads=PRIVATE_KEYS)
    assert layers >= 5, f"only {layers} layers read from docker save"
    assert not hits, f"secrets found in: {hits}"


def test_the_layer_scan_finds_a_host_key_where_there_is_one(docker_client, default_rootfs):
    """The secret scan (test_no_secret_in_any_layer) on an image that does hold an ssh host key
    and a private key file: it must name both, or its silence proves nothing."""
    key = "-----BEGIN OPENSSH PRIVATE KEY-----\\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ==\\n-----END OPENSSH PRIVATE KEY-----\\n"
    box = docker_client.containers.run(default_rootfs, ["sh", "-c", f"mkdir -p /etc/ssh && printf '%b' '{key}' > /etc/ssh/ssh_host_ed25519_key "
                                                      f"&& printf '%b' '{key}' > /srv/deploy_key && cp /bin/ls /srv/not-a-key"],
                                       detach=True)
    ref = f"pytorch-cuda-scan-probe:{uuid.uuid4().hex[:12]}"
    try:
        assert box.wait(timeout=60)["StatusCode"] == 0
        box.commit(*ref.split(":"))
        _, hits = scan_layers(ref, [], SECRET_FILES, heads=PRIVATE_KEYS)
    finally:
        box.remove(force=True)
        docker_client.images.remove(ref, force=True) if docker_client.images.list(name=ref) else None
    assert sorted(h.split(":", 1)[1].lstrip("./") for h in hits) == ["etc/ssh/ssh_host_ed25519_key", "etc/ssh/ssh_host_ed25519_key",
                                                                    "srv/deploy_key"], hits
