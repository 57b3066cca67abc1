"""publish's registry read-back through the Bearer-token flow (ghcr.io, Docker Hub, ECR), against
a real registry in token-auth mode and a real token service (tests/registry.py's TokenIssuer).
The Basic-auth flow is covered with htpasswd in test_publish.py. No Docker daemon is needed:
the image read back is pushed over the distribution API with a token."""
from __future__ import annotations

import json

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.errors import RegistryRefused
from pytorch_cuda_build.registry import attach
from pytorch_cuda_build.registry import client as registry

from helpers import ROOT
from registry import LocalRegistry, TokenIssuer, push_small_image, require_binary

DEFAULT = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
SECRET = "t0ken-flow-Pa55word"


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory):
    require_binary()
    issuer = TokenIssuer(tmp_path_factory.mktemp("issuer"), {"ci": SECRET}).start()
    reg = LocalRegistry(tmp_path_factory.mktemp("token-registry")).start(tokens=issuer)
    repo = f"ml/{DEFAULT.repository}"
    pushed = push_small_image(reg, repo, "v2.7", issuer.token("ci", [f"repository:{repo}:pull,push"]))
    yield reg, issuer, pushed
    reg.stop()
    issuer.stop()


def api(reg: LocalRegistry, password: str | None) -> registry.RegistryAPI:
    creds = {"username": "ci", "password": password} if password else None
    return registry.RegistryAPI(registry.Registry.parse(reg.address("ml")), creds, None, timeout=10)


def test_read_back_gets_a_token_for_the_repository_and_the_digests_it_pushed(token_registry):
    reg, issuer, (digest, config) = token_registry
    client = api(reg, SECRET)
    client.ping(DEFAULT)
    remote = client.manifest(DEFAULT, "v2.7")
    assert (remote.digest, remote.config) == (digest, config)
    assert client.manifest(DEFAULT, "never-pushed") is None
    asked = [r for r in issuer.requests if r["user"] == "ci"]
    assert {"user": "ci", "basic": True, "scope": [f"repository:ml/{DEFAULT.repository}:pull"],
            "service": issuer.service} in asked


def test_without_credentials_the_anonymous_token_is_refused_and_says_how_to_log_in(token_registry):
    reg, issuer, _ = token_registry
    with pytest.raises(RegistryRefused, match=r"needs credentials: `docker login 127\.0\.0\.1:\d+`"):
        api(reg, None).manifest(DEFAULT, "v2.7")
    assert {"user": None, "basic": False} in [{k: r[k] for k in ("user", "basic")} for r in issuer.requests]


def test_a_wrong_password_is_refused_by_the_token_service_and_never_shown(token_registry):
    reg, _, _ = token_registry
    with pytest.raises(RegistryRefused, match=r"refused the credentials given \(token\): unable to retrieve auth token") as e:
        api(reg, "wrong-" + SECRET).ping(DEFAULT)
    assert SECRET not in str(e.value)


def test_a_token_service_that_is_down_is_a_transient_error(tmp_path):
    require_binary()
    (tmp_path / "issuer").mkdir()
    issuer = TokenIssuer(tmp_path / "issuer", {"ci": SECRET})
    issuer.server.server_close()  # never started: its port refuses connections
    reg = LocalRegistry(tmp_path / "registry").start(tokens=issuer)
    try:
        with pytest.raises(registry.Transient, match="token service of 127.0.0.1"):
            api(reg, SECRET).ping(DEFAULT)
    finally:
        reg.stop()


def test_the_sbom_attaches_through_the_token_flow_and_its_fallback_index_keeps_artifact_type(token_registry, tmp_path):
    """publish --push attaches the row's SBOM (registry/attach.py): the artifact through skopeo, the
    referrers fallback index through the distribution API's PUT, each with a token for the
    repository (push and pull)."""
    reg, issuer, (digest, _) = token_registry
    sbom = tmp_path / "sbom.cdx.json"
    sbom.write_text('{"bomFormat": "CycloneDX", "specVersion": "1.5", "components": []}')
    client = api(reg, SECRET)
    found = attach.attach_sbom(client, DEFAULT.repository, digest, sbom)
    index = json.loads(client.raw(DEFAULT.repository, attach.fallback_tag(digest)))
    assert [(m["digest"], m.get("artifactType")) for m in index["manifests"]] == [(found, attach.ARTIFACT_TYPE)]
    pushes = [r for r in issuer.requests if r["user"] == "ci" and any(s.endswith(":pull,push") or ",push" in s for s in r["scope"])]
    assert pushes, issuer.requests
