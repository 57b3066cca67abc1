"""The SBOM attached as an OCI artifact (registry/attach.py) against a registry on 127.0.0.1
(Debian's docker-registry 2.8: no referrers API), on a small image: the artifact names the image
as its subject and holds the SBOM's bytes, the referrers fallback tag lists it beside what other
tools put there, and a second attach replaces ours instead of adding one. The default row's
publish attaches its own: test_publish.py."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from pytorch_cuda_build.registry import attach

from registry import LocalRegistry, small_published

pytestmark = [pytest.mark.docker]



@pytest.fixture(scope="module")
def pushed(tmp_path_factory, docker_client):
    tmp = tmp_path_factory.mktemp("sbom")
    sbom = tmp / "sbom.cdx.json"
    sbom.write_text(json.dumps({"bomFormat": "CycloneDX", "specVersion": "1.5", "components": [{"name": "torch"}]}))
    with small_published(tmp, "attach") as (reg, api, digest, _):
        yield {"reg": reg, "api": api, "digest": digest, "sbom": sbom, "tmp": tmp}


def blob(reg: LocalRegistry, digest: str) -> bytes:
    with urllib.request.urlopen(f"http://{reg.host}/v2/ml/pytorch-cuda/blobs/{digest}", timeout=30) as r:
        return r.read()


def test_the_sbom_is_an_artifact_whose_subject_is_the_image_listed_by_the_fallback_tag(pushed):
    reg, digest = pushed["reg"], pushed["digest"]
    found = attach.attach_sbom(pushed["api"], "pytorch-cuda", digest, pushed["sbom"])
    with pytest.raises(urllib.error.HTTPError) as no_api:  # why the fallback: this registry has no referrers API
        urllib.request.urlopen(f"http://{reg.host}/v2/ml/pytorch-cuda/referrers/{digest}", timeout=30)
    assert no_api.value.code == 404
    index_digest, index = reg.manifest("ml/pytorch-cuda", attach.fallback_tag(digest))
    assert [(m["digest"], m["artifactType"]) for m in index["manifests"]] == [(found, "application/vnd.cyclonedx+json")]
    artifact_digest, manifest = reg.manifest("ml/pytorch-cuda", found)
    assert artifact_digest == found and manifest["subject"]["digest"] == digest
    assert manifest["artifactType"] == "application/vnd.cyclonedx+json"
    assert blob(reg, manifest["layers"][0]["digest"]) == pushed["sbom"].read_bytes()
    assert reg.manifest("ml/pytorch-cuda", attach.fallback_tag(digest) + ".sbom")[0] == found


def test_attaching_again_keeps_other_tools_entries_and_one_sbom(pushed):
    reg, digest, api = pushed["reg"], pushed["digest"], pushed["api"]
    attach.attach_sbom(api, "pytorch-cuda", digest, pushed["sbom"])
    # another tool's referrer in the same fallback index (say, a signature), then a new SBOM
    existing = json.loads(api.raw("pytorch-cuda", attach.fallback_tag(digest)))
    theirs = {"mediaType": attach.MANIFEST, "digest": existing["manifests"][0]["digest"], "size": existing["manifests"][0]["size"],
              "artifactType": "application/vnd.example.signature"}
    index = attach.referrers_index(json.dumps(existing).encode(), theirs)
    assert len(index["manifests"]) == 2  # ours kept, theirs added
    api.put_manifest("pytorch-cuda", attach.fallback_tag(digest), json.dumps(index).encode(), attach.INDEX)
    pushed["sbom"].write_text(json.dumps({"bomFormat": "CycloneDX", "specVersion": "1.5", "components": []}))
    newer = attach.attach_sbom(api, "pytorch-cuda", digest, pushed["sbom"])
    _, listed = reg.manifest("ml/pytorch-cuda", attach.fallback_tag(digest))
    assert theirs in listed["manifests"]  # the other tool's entry kept
    assert [m["digest"] for m in listed["manifests"] if m["artifactType"] == "application/vnd.cyclonedx+json"] == [newer]
