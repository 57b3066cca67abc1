"""What a push attaches beside a row image in the registry, as OCI 1.1 artifacts: its CycloneDX
SBOM and BuildKit's SLSA provenance.

The SBOM: BuildKit's own SBOM attestations are SPDX only and need a scanner image from a registry
our hosts cannot reach, so a push attaches the SBOM the build wrote
(build-results/<image>/sbom.cdx.json, the one baked into the image at
/opt/pytorch-cuda/sbom.cdx.json). The provenance: the in-toto statement BuildKit wrote for the
image, byte for byte (provenance.py). Each is an image manifest with its `artifactType`, the empty
config, the document as its one layer, and `subject` naming the image's manifest.

Where it can be found from the image, both ways the OCI distribution spec gives:
- a registry with the referrers API (`GET /v2/<name>/referrers/<digest>`) indexes the artifact
  by its `subject` when it is pushed;
- a registry without one (Debian's docker-registry 2.8, for one) is given the spec's tag-schema
  fallback: an index under the tag `sha256-<hex of the image digest>` listing the artifacts, kept
  with any entries other tools put there.
Each artifact also carries a tag of its own, `sha256-<hex>.sbom` (cosign's tag for an attached
SBOM) and `sha256-<hex>.provenance`, so tools that know neither can find it, and so skopeo, which
pushes only to a tag, can push it.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import PublishError
from .client import RegistryAPI


@dataclass(frozen=True)
class Kind:
    """One kind of attached document: its artifact type (also its layer's media type), its file
    name, the suffix of its own tag, and its layer's annotations beside the title."""

    artifact_type: str
    title: str
    tag_suffix: str
    annotations: tuple[tuple[str, str], ...] = ()


SBOM = Kind("application/vnd.cyclonedx+json", "sbom.cdx.json", ".sbom")
ARTIFACT_TYPE = SBOM.artifact_type


def provenance_kind(predicate_type: str) -> Kind:
    return Kind("application/vnd.in-toto+json", "provenance.intoto.json", ".provenance",
                (("in-toto.io/predicate-type", predicate_type),))


EMPTY_DIGEST = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"  # of b"{}"
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json", "digest": EMPTY_DIGEST, "size": 2}
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"


def fallback_tag(digest: str) -> str:
    """The referrers tag schema: `sha256-<hex>` for the subject sha256:<hex>."""
    return digest.replace(":", "-")


def artifact(document: bytes, subject: dict, kind: Kind = SBOM) -> tuple[dict, dict[str, bytes]]:
    """The artifact manifest and its blobs (digest -> bytes)."""
    layer_digest = "sha256:" + hashlib.sha256(document).hexdigest()
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "artifactType": kind.artifact_type, "config": EMPTY_CONFIG,
                "layers": [{"mediaType": kind.artifact_type, "digest": layer_digest, "size": len(document),
                            "annotations": {"org.opencontainers.image.title": kind.title, **dict(kind.annotations)}}],
                "subject": subject}
    return manifest, {layer_digest: document, EMPTY_DIGEST: b"{}"}


def referrers_index(existing: bytes | None, entry: dict) -> dict:
    """The fallback index with entry in it: existing entries kept, an older entry of ours (same
    artifact type) replaced, so a republish leaves one of each kind per image."""
    index: dict = json.loads(existing) if existing else {"schemaVersion": 2, "mediaType": INDEX, "manifests": []}
    others = [m for m in index.get("manifests") or [] if m.get("artifactType") != entry["artifactType"]]
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


def attach_sbom(api: RegistryAPI, name: str, digest: str, sbom_path: Path) -> str:
    """Push sbom_path as name@digest's SBOM artifact and list it under the fallback tag; its digest."""
    try:
        sbom = sbom_path.read_bytes()
    except OSError as e:
        raise PublishError(f"no SBOM to attach: {sbom_path}: {e.strerror} (the build writes it; rebuild the row)") from None
    return attach(api, name, digest, sbom, SBOM)


def attach(api: RegistryAPI, name: str, digest: str, document: bytes, kind: Kind) -> str:
    """Push document as name@digest's artifact of kind and list it under the fallback tag; its digest."""
    subject_raw = api.raw(name, digest)
    if subject_raw is None:
        raise PublishError(f"{name}@{digest} is not in the registry: nothing to attach {kind.title} to")
    subject = {"mediaType": json.loads(subject_raw).get("mediaType") or MANIFEST, "digest": digest, "size": len(subject_raw)}
    manifest, blobs = artifact(document, subject, kind)
    raw = json.dumps(manifest).encode()
    artifact_digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-attach-") as tmp:
        layout, ref = _layout(Path(tmp) / "artifact", manifest, blobs)
        api.push_layout(layout, ref, name, fallback_tag(digest) + kind.tag_suffix)
    entry = {"mediaType": MANIFEST, "digest": artifact_digest, "size": len(raw), "artifactType": kind.artifact_type}
    index = referrers_index(api.raw(name, fallback_tag(digest)), entry)
    # Byte for byte: skopeo would re-serialize the index without the entries' artifactType.
    api.put_manifest(name, fallback_tag(digest), json.dumps(index).encode(), INDEX)
    return artifact_digest
