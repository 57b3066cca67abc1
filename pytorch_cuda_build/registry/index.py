"""A row on several platforms: one image index of each platform's tested image.

A classic image store keeps one platform per tag, so the index is made at publish time, as
`docker buildx imagetools create` makes one from pushed images. Each platform's image is pushed
as today's images are (publish.push_one: its config, the tested image ID, read back; or its
zstd form, zstd.py) under its own immutable tag `<dated>-<arch>`; the index of those manifests is
then pushed with skopeo (`--multi-arch index-only`) to the dated tag, read back, and only then to
the moving tags.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import PublishError
from .client import RegistryAPI

INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
REF_NAME = "org.opencontainers.image.ref.name"
INDEX_REF = "index"  # the layout's name for the index it pushes


def list_document(manifests: list[tuple[str, bytes]]) -> bytes:
    """The OCI index of pushed manifests, (platform, manifest bytes) each. Its entries keep their
    manifests' own media types (Docker 20.10 pushes Docker's); an OCI layout names only OCI
    manifests and indexes, which is why the index is OCI's, not Docker's manifest list."""
    entries = [{"mediaType": json.loads(raw).get("mediaType"), "digest": _digest(raw), "size": len(raw),
                "platform": {"architecture": platform.split("/")[1], "os": platform.split("/")[0]}}
               for platform, raw in manifests]
    return json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": entries}, separators=(",", ":")).encode()


def write_layout(dest: Path, document: bytes) -> None:
    """An OCI layout holding only the index (its manifests are in the registry already), named
    INDEX_REF: what `skopeo copy --multi-arch index-only` pushes."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    (blobs / _digest(document).removeprefix("sha256:")).write_bytes(document)
    (dest / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    top = {"schemaVersion": 2, "manifests": [{"mediaType": INDEX, "digest": _digest(document),
                                              "size": len(document), "annotations": {REF_NAME: INDEX_REF}}]}
    (dest / "index.json").write_text(json.dumps(top))


def digest_of(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _digest(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def check_index(api: RegistryAPI, name: str, reference: str, configs: dict[str, str]) -> str:
    """Read an index back, and each platform's manifest by digest: exactly these platforms, each
    with its config. The index's digest."""
    raw = api.raw(name, reference)
    if raw is None:
        raise PublishError(f"{name}:{reference} is absent right after its push")
    doc = json.loads(raw)
    if doc.get("mediaType") not in (INDEX, DOCKER_LIST):
        raise PublishError(f"{name}:{reference} is not an image index ({doc.get('mediaType')})")
    found = {f"{m['platform']['os']}/{m['platform']['architecture']}": m["digest"] for m in doc.get("manifests", [])}
    if set(found) != set(configs):
        raise PublishError(f"{name}:{reference} lists {', '.join(sorted(found))}, not {', '.join(sorted(configs))}")
    for platform, config in configs.items():
        got = (json.loads(api.raw(name, found[platform]) or b"{}").get("config") or {}).get("digest")
        if got != config:
            raise PublishError(f"{name}@{found[platform]} ({platform}) has config {got}, not the tested image's {config}")
    return _digest(raw)
