"""The image's CycloneDX SBOM, attached to it in the registry as an OCI artifact.

BuildKit's own SBOM attestations are SPDX only and need a scanner image from a registry our
hosts cannot reach, so `publish --push` pushes the SBOM the build wrote
(build-results/<image>/sbom.cdx.json, the one baked into the image at
/opt/pytorch-cuda/sbom.cdx.json) as an OCI 1.1 artifact: an image manifest with
`artifactType: application/vnd.cyclonedx+json`, the empty config, the SBOM as its one layer, and
`subject` naming the image's manifest.

Where it can be found from the image, both ways the OCI distribution spec gives:
- a registry with the referrers API (`GET /v2/<name>/referrers/<digest>`) indexes the artifact
  by its `subject` when it is pushed;
- a registry without one (Debian's docker-registry 2.8, for one) is given the spec's tag-schema
  fallback: an index under the tag `sha256-<hex of the image digest>` listing the artifact, kept
  with any entries other tools put there.
The artifact itself also carries the tag `sha256-<hex>.sbom` (cosign's tag for an attached SBOM),
so tools that know neither can find it, and so skopeo, which pushes only to a tag, can push it.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from ..errors import PublishError

ARTIFACT_TYPE = "application/vnd.cyclonedx+json"
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json",
                "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", "size": 2}
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"


def fallback_tag(digest: str) -> str:
    """The referrers tag schema: `sha256-<hex>` for the subject sha256:<hex>."""
    return digest.replace(":", "-")


def artifact(sbom: bytes, subject: dict) -> tuple[dict, dict[str, bytes]]:
    """The artifact manifest and its blobs (digest -> bytes)."""
    layer_digest = "sha256:" + hashlib.sha256(sbom).hexdigest()
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "artifactType": ARTIFACT_TYPE, "config": EMPTY_CONFIG,
                "layers": [{"mediaType": ARTIFACT_TYPE, "digest": layer_digest, "size": len(sbom),
                            "annotations": {"org.opencontainers.image.title": "sbom.cdx.json"}}],
                "subject": subject}
    return manifest, {layer_digest: sbom, EMPTY_CONFIG["digest"]: b"{}"}


def referrers_index(existing: bytes | None, entry: dict) -> dict:
    """The fallback index with entry in it: existing entries kept, an older entry of ours (same
    artifact type) replaced, so a republish leaves one SBOM per image."""
    index = json.loads(existing) if existing else {"schemaVersion": 2, "mediaType": INDEX, "manifests": []}
    others = [m for m in index.get("manifests") or [] if m.get("artifactType") != ARTIFACT_TYPE]
    return {**index, "manifests": [*others, entry]}


def _layout(folder: Path, manifest: dict, blobs: dict[str, bytes]) -> tuple[Path, str]:
    """An OCI layout of one manifest and its blobs; (layout, its ref name)."""
    layout = folder / "layout"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    for digest, data in blobs.items():
        (layout / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(data)
    raw = json.dumps(manifest).encode()
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    (layout / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(raw)
    entry = {"mediaType": MANIFEST, "digest": digest, "size": len(raw),
             "annotations": {"org.opencontainers.image.ref.name": "it"}}
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    return layout, "it"


def attach_sbom(api, name: str, digest: str, sbom_path: Path) -> str:
    """Push sbom_path as name@digest's SBOM artifact and list it under the fallback tag; its digest."""
    try:
        sbom = sbom_path.read_bytes()
    except OSError as e:
        raise PublishError(f"no SBOM to attach: {sbom_path}: {e.strerror} (the build writes it; rebuild the row)") from None
    subject_raw = api.raw(name, digest)
    if subject_raw is None:
        raise PublishError(f"{name}@{digest} is not in the registry: nothing to attach an SBOM to")
    subject = {"mediaType": json.loads(subject_raw).get("mediaType") or MANIFEST, "digest": digest, "size": len(subject_raw)}
    manifest, blobs = artifact(sbom, subject)
    raw = json.dumps(manifest).encode()
    artifact_digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-sbom-") as tmp:
        layout, ref = _layout(Path(tmp) / "artifact", manifest, blobs)
        api.push_layout(layout, ref, name, fallback_tag(digest) + ".sbom")
    entry = {"mediaType": MANIFEST, "digest": artifact_digest, "size": len(raw), "artifactType": ARTIFACT_TYPE}
    index = referrers_index(api.raw(name, fallback_tag(digest)), entry)
    # Byte for byte: skopeo would re-serialize the index without the entries' artifactType.
    api.put_manifest(name, fallback_tag(digest), json.dumps(index).encode(), INDEX)
    return artifact_digest
