"""BuildKit's SLSA provenance of a row image: asked for at build, kept beside the image, attached at push.

Where build.py exports the build as OCI (the containerd store, or a docker-container builder),
it asks BuildKit for provenance in mode=max, which records the build's command-line labels:
among them the commit (org.opencontainers.image.revision) and the lock hash
(io.pytorch-cuda.lock-sha256, given on the command line too for this reason, with the value the
Dockerfile's LABEL has, so the config does not change). BuildKit returns it as an attestation
manifest in an index that wraps the image. Provenance records times, so that index (and an image
ID taken from it) would differ with every build. So the build loads the image manifest alone,
whose digest is the one build.py promises, and keeps BuildKit's in-toto statement byte for byte in
build-results/<image>/provenance.intoto.json, with the manifest digest it describes in
provenance.json; publish attaches it beside that image as an OCI artifact (attach.py), as it does
the SBOM. Docker 20.10's built-in BuildKit writes no provenance: its images are published without.
"""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ..errors import BuildError
from ..files import write_all_atomic

STATEMENT_FILE = "provenance.intoto.json"  # BuildKit's in-toto statement, as it wrote it
RECORD_FILE = "provenance.json"            # which image manifest it describes
PREDICATE_TYPES = ("https://slsa.dev/provenance/v0.2", "https://slsa.dev/provenance/v1")
ATTESTATION = "attestation-manifest"  # BuildKit's vnd.docker.reference.type for it
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
BUILD_FLAG = "--provenance=mode=max"  # max: the command line's labels are recorded (min leaves them out)


@dataclass(frozen=True)
class Split:
    """An OCI export's image and its provenance: the index.json that names the image alone,
    the image manifest's digest, and BuildKit's statement (None where it wrote none)."""

    index_json: bytes
    image: str
    statement: bytes | None


def _blob(tar: tarfile.TarFile, digest: str) -> bytes:
    try:
        member = tar.extractfile("blobs/sha256/" + digest.removeprefix("sha256:"))
    except KeyError:
        member = None
    if member is None:
        raise BuildError(f"loading the built image: the build's OCI export has no blob {digest[:19]}", str(tar.name))
    return member.read()


def split(tarball: Path) -> Split | None:
    """The image without its attestations, and its provenance; None for an export whose
    index.json already names one image manifest (nothing to take apart)."""
    with tarfile.open(tarball) as tar:
        top = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        entries = top.get("manifests") or []
        if len(entries) != 1 or entries[0].get("mediaType") not in INDEX_TYPES:
            return None
        wrapper = json.loads(_blob(tar, entries[0]["digest"]))
        images = [m for m in wrapper.get("manifests") or [] if (m.get("annotations") or {}).get("vnd.docker.reference.type") != ATTESTATION]
        if len(images) != 1:  # a multi-platform export is not what build.py loads
            raise BuildError(f"loading the built image: the build's OCI export holds {len(images)} images; build.py loads "
                             "one platform's", str(tarball))
        image = images[0]
        statement = None
        for m in wrapper["manifests"]:
            notes = m.get("annotations") or {}
            if notes.get("vnd.docker.reference.type") == ATTESTATION and notes.get("vnd.docker.reference.digest") == image["digest"]:
                for layer in json.loads(_blob(tar, m["digest"])).get("layers") or []:
                    if (layer.get("annotations") or {}).get("in-toto.io/predicate-type") in PREDICATE_TYPES:
                        statement = _blob(tar, layer["digest"])
        # The image's entry keeps the name annotations the wrapper had, so `docker load` tags it.
        entry = {k: v for k, v in image.items() if k != "platform"} | {"annotations": entries[0].get("annotations") or {}}
        index = {**top, "manifests": [entry]}
        return Split(json.dumps(index).encode(), image["digest"], statement)


def stream(tarball: Path, index_json: bytes, out: IO[bytes]) -> None:
    """The export to out as a tar, its index.json replaced: streamed, the image is not copied on disk."""
    with tarfile.open(tarball) as src, tarfile.open(fileobj=out, mode="w|") as dst:
        for member in src:
            if member.name == "index.json":
                info = tarfile.TarInfo("index.json")
                info.size, info.mtime, info.mode = len(index_json), member.mtime, member.mode
                dst.addfile(info, io.BytesIO(index_json))
            elif member.isfile():
                dst.addfile(member, src.extractfile(member))
            else:
                dst.addfile(member)


def keep(results: Path, image: str, statement: bytes | None) -> None:
    """Write what the build made, and remove what an earlier build left (its provenance names another image)."""
    forget(results)
    if statement is None:
        return
    record = {"image": image, "statement_sha256": "sha256:" + hashlib.sha256(statement).hexdigest(),
              "predicate_type": json.loads(statement).get("predicateType")}
    write_all_atomic([(results / STATEMENT_FILE, statement.decode("utf-8")),
                      (results / RECORD_FILE, json.dumps(record, indent=2) + "\n")])


def forget(results: Path) -> None:
    for name in (RECORD_FILE, STATEMENT_FILE):
        (results / name).unlink(missing_ok=True)


def kept(results: Path, image: str) -> bytes | None:
    """The statement the build kept for the image manifest `image`; None where there is none for
    it (built by an engine that writes none, or the image pushed is another build's)."""
    try:
        record = json.loads((results / RECORD_FILE).read_text())
        statement = (results / STATEMENT_FILE).read_bytes()
    except (OSError, ValueError):
        return None
    if record.get("image") != image or record.get("statement_sha256") != "sha256:" + hashlib.sha256(statement).hexdigest():
        return None
    return statement


def parameters(statement: bytes) -> dict[str, str]:
    """The build's recorded arguments (SLSA v0.2 invocation.parameters.args, v1
    buildDefinition.externalParameters.request.args): label:NAME and build-arg:NAME to values."""
    doc = json.loads(statement)
    predicate = doc.get("predicate") or {}
    if "invocation" in predicate:
        return dict((predicate["invocation"].get("parameters") or {}).get("args") or {})
    request = ((predicate.get("buildDefinition") or {}).get("externalParameters") or {}).get("request") or {}
    return dict(request.get("args") or {})
