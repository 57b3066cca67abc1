"""What a push attaches beside a row image in the registry, as OCI 1.1 artifacts: its CycloneDX
SBOM, BuildKit's SLSA provenance, and the locked files it was built from (its inputs: by default
the Debian files a mirror can drop; with `--attach-inputs all`, the wheels and sdists too), one
layer per file, its digest the file's sha256 as the lock names it, so that a rebuild years later
fills its store from the registry (`fetch --from-image`, `verify --image`).

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
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pytorch_cuda_runtime.lockfile import Input

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


INPUTS = Kind("application/vnd.pytorch-cuda.inputs.v1", "inputs", ".inputs")
DEB = "application/vnd.debian.binary-package"  # a .deb layer; every other file is plain bytes
FILE = "application/octet-stream"
URL_ANNOTATION = "io.pytorch-cuda.url"  # where the lock says the file came from

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


def _layout(folder: Path, manifest: dict, blobs: dict[str, bytes | Path]) -> tuple[Path, str]:
    """An OCI layout of one manifest and its blobs (bytes, or a file linked in); (layout, its ref name)."""
    layout = folder / "layout"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    for digest, data in blobs.items():
        dest = layout / "blobs" / "sha256" / digest.split(":")[1]
        if isinstance(data, Path):
            try:
                os.link(data, dest)  # a store's file: no copy of gigabytes
            except OSError:
                shutil.copyfile(data, dest)
        else:
            dest.write_bytes(data)
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
    manifest, blobs = artifact(document, _subject(api, name, digest, kind), kind)
    return _push(api, name, digest, manifest, dict(blobs), kind)


def _subject(api: RegistryAPI, name: str, digest: str, kind: Kind) -> dict:
    subject_raw = api.raw(name, digest)
    if subject_raw is None:
        raise PublishError(f"{name}@{digest} is not in the registry: nothing to attach {kind.title} to")
    return {"mediaType": json.loads(subject_raw).get("mediaType") or MANIFEST, "digest": digest, "size": len(subject_raw)}


def inputs_artifact(items: list[Input], subject: dict) -> dict:
    """The inputs artifact's manifest: one layer per file, its digest the file's sha256, its title
    the file's name and its annotation the address the lock gives."""
    layers = [{"mediaType": DEB if i.file.endswith(".deb") else FILE, "digest": f"sha256:{i.sha256}", "size": i.size,
               "annotations": {"org.opencontainers.image.title": i.file, URL_ANNOTATION: i.url}}
              for i in sorted(items, key=lambda i: (i.file, i.sha256))]
    return {"schemaVersion": 2, "mediaType": MANIFEST, "artifactType": INPUTS.artifact_type, "config": EMPTY_CONFIG,
            "layers": layers, "subject": subject}


def attach_inputs(api: RegistryAPI, name: str, digest: str, items: list[Input], blob: Callable[[Input], Path]) -> str:
    """Push the files (blob: where each lies, the store's copy) as name@digest's inputs artifact; its digest."""
    manifest = inputs_artifact(items, _subject(api, name, digest, INPUTS))
    blobs: dict[str, bytes | Path] = {f"sha256:{i.sha256}": blob(i) for i in items}
    return _push(api, name, digest, manifest, {**blobs, EMPTY_DIGEST: b"{}"}, INPUTS)


def read_inputs(api: RegistryAPI, name: str, digest: str, folder: Path) -> Path | None:
    """The inputs artifact attached to name@digest, its blobs copied into folder (an OCI layout);
    the folder of its files by sha256 (blobs/sha256/<hex>), or None where the image has none."""
    raw = api.raw(name, fallback_tag(digest) + INPUTS.tag_suffix)
    if raw is None:
        return None
    found = "sha256:" + hashlib.sha256(raw).hexdigest()
    api.copy_to_layout(name, found, folder)
    return folder / "blobs"


def _push(api: RegistryAPI, name: str, digest: str, manifest: dict, blobs: dict[str, bytes | Path], kind: Kind) -> str:
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
