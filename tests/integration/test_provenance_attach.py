"""BuildKit's provenance, end to end on Docker 26's containerd store, on small images: a row image
built with the export arguments build.py uses (provenance, the lock label), loaded as build.py
loads it, then `build.py publish --push` to Debian's docker-registry on 127.0.0.1. The tags hold
the image manifest the build made (the digest promise), and the provenance attached beside it
names the commit and the row's lock. (On Docker 20.10, which writes none, a push says so:
test_immutable_tag.py.)"""
from __future__ import annotations

import json
import urllib.request
import uuid

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.buildkit import provenance
from pytorch_cuda_build.registry import attach
from pytorch_cuda_build.stages import publish, sbom, security

from helpers import build_small_oci, containerd_client, project_copy, run_build_py, shown

pytestmark = [pytest.mark.docker, pytest.mark.engine26]

REVISION = "5" * 40
CREATED = "2026-11-27T10:00:00Z"


@pytest.fixture(scope="module")
def engine():
    with containerd_client() as engine:
        yield engine


def blob(reg, repo: str, digest: str) -> bytes:
    with urllib.request.urlopen(f"http://{reg.host}/v2/{repo}/blobs/{digest}", timeout=30) as r:
        return r.read()


def test_a_pushed_row_carries_buildkits_provenance_naming_the_commit_and_the_lock(engine, registry, tmp_path):
    c, env = engine
    project = project_copy(tmp_path / "project")
    repo = f"pytorch-cuda-prov-{uuid.uuid4().hex[:8]}"
    text = (project / "matrix.yaml").read_text()
    (project / "matrix.yaml").write_text(text.replace("\nrepository: pytorch-cuda\n", f"\nrepository: {repo}\n"))
    row = matrix.load(project / "matrix.yaml").select("2.7", "12.1")
    lock_sha256 = publish.lock_files_sha256(project, row)
    results = project / "build-results" / row.name
    results.mkdir(parents=True)
    base_ref, row_ref = f"{repo}-base:tiny", f"{repo}:{row.name}"
    made = [base_ref, row_ref]
    try:
        revision = {"org.opencontainers.image.revision": REVISION}
        base_id = build_small_oci(tmp_path, base_ref, "FROM scratch\nCOPY file /base-file\n", lock_sha256, labels=revision)
        image_id = build_small_oci(tmp_path, row_ref, f"FROM {base_ref}\nCOPY file /file\n"
                                   f'LABEL {publish.CREATED_LABEL}="{CREATED}" {publish.LOCK_LABEL}="{lock_sha256}" '
                                   f'{publish.BASE_LABEL}="{base_id}"\n', lock_sha256, labels=revision, results=results)
        kept = json.loads((results / provenance.RECORD_FILE).read_text())
        assert kept["image"] == image_id and kept["predicate_type"] == "https://slsa.dev/provenance/v0.2"
        assert c.images.get(row_ref).id == image_id  # loaded as the image manifest, not the index around it

        state = tmp_path / "state"
        state.mkdir()
        (state / "tested.json").write_text(json.dumps({image_id: [{"image": row.name, "mode": "cpu", "code": "t", "passed_at": 0}]}))
        security.write_report(row.name, [], [], results / security.REPORT, {"test": "no advisories"})
        (results / sbom.FILE).write_text('{"bomFormat": "CycloneDX", "specVersion": "1.5", "components": []}')
        proc = run_build_py(project, "publish", "--torch", "2.7", "--cuda", "12.1", "--registry", registry.address("prov"), "--push",
                            env={**env, "PYTORCH_CUDA_STATE": str(state)}, timeout=300)
        assert proc.returncode == 0, shown(proc)
        name = f"prov/{repo}"
        pushed = registry.manifest(name, row.tags[0])
        assert pushed is not None and pushed[0] == image_id, pushed  # the tag holds the build's own manifest
        assert "provenance sha256:" in proc.stdout and f"attached to {registry.address('prov')}/{repo}@{image_id}" in proc.stdout, shown(proc)

        _, index = registry.manifest(name, attach.fallback_tag(image_id))
        (entry,) = [m for m in index["manifests"] if m.get("artifactType") == "application/vnd.in-toto+json"]
        digest, artifact = registry.manifest(name, entry["digest"])
        assert artifact["subject"]["digest"] == image_id
        assert registry.manifest(name, attach.fallback_tag(image_id) + ".provenance")[0] == digest
        statement = blob(registry, name, artifact["layers"][0]["digest"])
        assert statement == (results / provenance.STATEMENT_FILE).read_bytes()  # BuildKit's, byte for byte
        args = provenance.parameters(statement)
        assert args["label:org.opencontainers.image.revision"] == REVISION
        assert args[f"label:{publish.LOCK_LABEL}"] == lock_sha256
    finally:
        for ref in reversed(made):
            try:
                c.images.remove(ref, force=True)
            except Exception:  # never built: the assertion above says why
                pass
