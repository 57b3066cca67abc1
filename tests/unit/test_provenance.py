"""provenance.py on OCI exports shaped as BuildKit writes them with --provenance (an index
wrapping the image manifest and an attestation manifest), without a daemon: the image is taken
apart from its provenance, the statement kept byte for byte, and only for the image it names."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from pytorch_cuda_build.buildkit import provenance
from pytorch_cuda_build.errors import BuildError
from pytorch_cuda_build.registry import attach

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
STATEMENT = json.dumps({"_type": "https://in-toto.io/Statement/v0.1", "predicateType": "https://slsa.dev/provenance/v0.2",
                        "subject": [], "predicate": {"invocation": {"parameters": {"args": {
                            "label:org.opencontainers.image.revision": "c0ffee", "label:io.pytorch-cuda.lock-sha256": "ab" * 32}}}}},
                       separators=(",", ":")).encode()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def export(path: Path, attested: bool = True, images: int = 1, name: str = "docker.io/library/pcb:1") -> dict:
    """An OCI tarball: blobs, oci-layout and index.json, as `buildx build --output type=oci` writes."""
    blobs: dict[str, bytes] = {}

    def put(data: bytes) -> str:
        blobs[_digest(data)] = data
        return _digest(data)

    config = put(b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}')
    manifests = []
    for n in range(images):
        raw = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "config": {"digest": config, "size": 1},
                          "layers": [], "n": n}).encode()
        manifests.append({"mediaType": MANIFEST, "digest": put(raw), "size": len(raw), "platform": {"os": "linux", "architecture": "amd64"}})
    image = manifests[0]["digest"]
    notes = {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": "1"}
    if attested:
        layer = put(STATEMENT)
        att = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "config": {"digest": put(b"{}"), "size": 2},
                          "layers": [{"mediaType": "application/vnd.in-toto+json", "digest": layer, "size": len(STATEMENT),
                                      "annotations": {"in-toto.io/predicate-type": "https://slsa.dev/provenance/v0.2"}}]}).encode()
        manifests.append({"mediaType": MANIFEST, "digest": put(att), "size": len(att), "platform": {"os": "unknown", "architecture": "unknown"},
                          "annotations": {"vnd.docker.reference.digest": image, "vnd.docker.reference.type": "attestation-manifest"}})
        wrapper = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}).encode()
        top = {"mediaType": INDEX, "digest": put(wrapper), "size": len(wrapper), "annotations": notes}
    else:
        top = {**manifests[0], "annotations": notes}
    files = {f"blobs/sha256/{d.split(':')[1]}": b for d, b in blobs.items()}
    files["oci-layout"] = b'{"imageLayoutVersion":"1.0.0"}'
    files["index.json"] = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": [top]}).encode()
    with tarfile.open(path, "w") as tar:
        for member_name, data in files.items():
            info = tarfile.TarInfo(member_name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return {"image": image, "files": files, "notes": notes}


def test_an_attested_export_loads_as_its_image_alone_and_keeps_buildkits_statement(tmp_path):
    made = export(tmp_path / "image.oci.tar")
    parts = provenance.split(tmp_path / "image.oci.tar")
    assert parts is not None and parts.image == made["image"] and parts.statement == STATEMENT
    index = json.loads(parts.index_json)
    assert index["manifests"] == [{"mediaType": MANIFEST, "digest": made["image"], "size": index["manifests"][0]["size"],
                                   "annotations": made["notes"]}]  # the name kept: docker load tags it

    out = io.BytesIO()
    provenance.stream(tmp_path / "image.oci.tar", parts.index_json, out)
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        streamed = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    assert streamed == {**made["files"], "index.json": parts.index_json}  # every blob as it was, index.json replaced


def test_an_export_without_provenance_is_loaded_as_it_is(tmp_path):
    export(tmp_path / "image.oci.tar", attested=False)
    assert provenance.split(tmp_path / "image.oci.tar") is None


def test_an_export_of_two_images_is_refused(tmp_path):
    export(tmp_path / "image.oci.tar", images=2)
    with pytest.raises(BuildError, match="holds 2 images"):
        provenance.split(tmp_path / "image.oci.tar")


def test_the_kept_statement_is_given_only_for_the_image_it_describes(tmp_path):
    image = "sha256:" + "1" * 64
    provenance.keep(tmp_path, image, STATEMENT)
    assert (tmp_path / provenance.STATEMENT_FILE).read_bytes() == STATEMENT  # byte for byte
    assert provenance.kept(tmp_path, image) == STATEMENT
    assert provenance.kept(tmp_path, "sha256:" + "2" * 64) is None  # a push of another build of the row
    (tmp_path / provenance.STATEMENT_FILE).write_bytes(STATEMENT.replace(b"c0ffee", b"bad000"))
    assert provenance.kept(tmp_path, image) is None  # altered after the build
    provenance.keep(tmp_path, image, None)  # a build on an engine that writes none: nothing stale left
    assert not (tmp_path / provenance.STATEMENT_FILE).exists() and not (tmp_path / provenance.RECORD_FILE).exists()


def test_the_recorded_arguments_name_the_commit_and_the_lock():
    args = provenance.parameters(STATEMENT)
    assert args["label:org.opencontainers.image.revision"] == "c0ffee"
    assert args["label:io.pytorch-cuda.lock-sha256"] == "ab" * 32
    v1 = {"predicateType": "https://slsa.dev/provenance/v1",
          "predicate": {"buildDefinition": {"externalParameters": {"request": {"args": {"label:x": "y"}}}}}}
    assert provenance.parameters(json.dumps(v1).encode()) == {"label:x": "y"}


def test_the_provenance_artifact_names_its_predicate_and_replaces_only_its_own_kind_in_the_fallback_index():
    kind = attach.provenance_kind("https://slsa.dev/provenance/v0.2")
    subject = {"mediaType": MANIFEST, "digest": "sha256:" + "3" * 64, "size": 10}
    manifest, blobs = attach.artifact(STATEMENT, subject, kind)
    (layer,) = manifest["layers"]
    assert manifest["artifactType"] == layer["mediaType"] == "application/vnd.in-toto+json" and manifest["subject"] == subject
    assert layer["annotations"]["in-toto.io/predicate-type"] == "https://slsa.dev/provenance/v0.2"
    assert blobs[layer["digest"]] == STATEMENT
    sbom = {"mediaType": MANIFEST, "digest": "sha256:" + "4" * 64, "size": 1, "artifactType": attach.SBOM.artifact_type}
    old = {"mediaType": MANIFEST, "digest": "sha256:" + "5" * 64, "size": 1, "artifactType": kind.artifact_type}
    new = {**old, "digest": "sha256:" + "6" * 64}
    index = attach.referrers_index(json.dumps({"schemaVersion": 2, "manifests": [sbom, old]}).encode(), new)
    assert index["manifests"] == [sbom, new]
