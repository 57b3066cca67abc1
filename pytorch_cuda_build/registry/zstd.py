"""An image's zstd form, for `publish --compression zstd`: its layers compressed with zstd, its
config kept byte for byte, so the registry's config digest is the tested image's.

Docker 26 pushes an image as its store holds it (gzip) and cannot recompress, and skopeo 1.9's
docker-daemon transport speaks Docker API 1.22, which Docker 26 refuses. So the image comes out of
the engine's own export (`docker save`: an OCI layout on the containerd store), streamed: each
layer is decompressed and compressed again with the zstd program into a scratch OCI layout; the
manifest becomes OCI's (a Docker manifest cannot name a zstd layer) with the same config. skopeo
then pushes that layout with --preserve-digests, so every byte pushed was written here and the
manifest digest is known before the push. (skopeo 1.9's own --dest-compress-format is not used:
it keeps a gzip blob that the repository already holds under the source's digest.)

The export is the tested image: its manifest must hash to the local image ID (the containerd
store's image ID is its manifest digest), every blob to its name, and every recompressed layer
must hold the diff its config names (rootfs.diff_ids).
"""
from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, NoReturn

import docker
import docker.errors
import requests

from ..engine import docker_env
from ..errors import EnvironmentProblem, PublishError
from .client import ZSTD_LAYER
from .retry import Transient

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
LEVEL = 3  # zstd's own default, as BuildKit's compression=zstd
REF_NAME = "zstd"  # the layout's name for the image it holds
CHUNK = 1 << 20
_JSON_MAX = 4 << 20  # a manifest or a config; a larger blob is a layer
_GZIP, _ZSTD = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


def check_engine(c: docker.DockerClient) -> None:
    """What zstd needs of this machine, asked before the registry is: the containerd image store
    (its export is an OCI layout of the image as built, its image ID the manifest's digest) and
    the zstd program."""
    if docker_env.image_store(c) != "containerd":
        raise EnvironmentProblem(
            f"--compression zstd needs Docker's containerd image store, and the engine at {docker_env.daemon_address()} uses "
            'the classic one: run `eval "$(python3 build.py engine)"` (Docker 26 with that store) and build there, '
            "or turn on features.containerd-snapshotter; nothing pushed")
    if not shutil.which("zstd"):
        raise EnvironmentProblem("--compression zstd compresses with the zstd program, which is not installed "
                                 "(Debian: apt-get install zstd); nothing pushed")


def config_digest(c: docker.DockerClient, image_id: str) -> str:
    """The config digest of a containerd-store image, from its manifest: Docker 26's inspect does
    not name it. The export is read only as far as the manifest's blob (the blobs come in digest
    order), and nothing is written."""
    want = _blob_name(image_id)
    with _export(c, image_id) as tar:
        for member in tar:
            if member.name == want and (blob := tar.extractfile(member)) is not None:  # a blob is a regular file
                return _manifest(blob.read(), image_id)["config"]["digest"]
    raise PublishError(f"the engine's export of {image_id[:19]} holds no {want}: not a containerd-store image ID")


@dataclass(frozen=True)
class Layout:
    """A scratch OCI layout holding one image's zstd form, named REF_NAME."""

    path: Path
    digest: str  # the zstd manifest's: what the registry must serve once it is pushed
    config: str  # the tested image's config digest, kept


def write_layout(c: docker.DockerClient, image_id: str, dest: Path) -> Layout:
    """The image's zstd form in dest (new or empty), from one pass over the engine's export: each
    layer recompressed as it streams by; the config and the other small blobs kept in memory."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    small: dict[str, bytes] = {}
    layers: dict[str, tuple[str, int, str | None]] = {}  # the export's layer digest: (zstd digest, size, diff ID)
    try:
        with _export(c, image_id) as tar:
            for member in tar:
                if member.isfile() and member.name.startswith("blobs/sha256/"):
                    _take(tar.extractfile(member), "sha256:" + member.name.rsplit("/", 1)[1], member.size, blobs, small, layers)
    except OSError as e:  # the scratch layout's disk, most likely full: about the image's compressed size is needed
        raise PublishError(f"writing {image_id[:19]}'s zstd form under {dest}: {e.strerror or e}; nothing pushed") from None
    manifest = _manifest(small.get(image_id) or _absent(image_id, image_id), image_id)
    config = manifest["config"]
    config_bytes = small.get(config["digest"]) or _absent(image_id, config["digest"])
    diff_ids = (json.loads(config_bytes).get("rootfs") or {}).get("diff_ids") or []
    out = []
    for i, layer in enumerate(manifest.get("layers") or []):
        digest, size, diff_id = layers.get(layer["digest"]) or _absent(image_id, layer["digest"])
        if diff_id is not None and (i >= len(diff_ids) or diff_ids[i] != diff_id):
            raise PublishError(f"layer {i} of {image_id[:19]} ({layer['digest'][:19]}) holds {diff_id[:19]}, "
                               f"not the diff its config names; nothing pushed")
        out.append({"mediaType": ZSTD_LAYER, "digest": digest, "size": size})
    zstd_form = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                 "config": {"mediaType": OCI_CONFIG if config.get("mediaType") == DOCKER_CONFIG else config["mediaType"],
                            "digest": config["digest"], "size": config["size"]},
                 "layers": out, **({"annotations": manifest["annotations"]} if manifest.get("annotations") else {})}
    raw = json.dumps(zstd_form, separators=(",", ":")).encode()
    digest = _digest(raw)
    (blobs / digest.removeprefix("sha256:")).write_bytes(raw)
    (dest / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(raw), "annotations": {"org.opencontainers.image.ref.name": REF_NAME}}]}))
    return Layout(dest, digest, config["digest"])


def _take(src: Any, digest: str, size: int, blobs: Path, small: dict[str, bytes], layers: dict) -> None:
    """One blob of the export, checked against its name: a small JSON document kept, a layer
    compressed with zstd (one in zstd already copied as it is)."""
    head = src.peek(4)[:4]
    seen = _Hashing(src)
    if head[:1] == b"{" and size <= _JSON_MAX:
        data = seen.read()
        small[digest] = data
        (blobs / digest.removeprefix("sha256:")).write_bytes(data)
    elif head == _ZSTD:
        with open(blobs / "partial", "wb") as f:
            shutil.copyfileobj(seen, f, CHUNK)
        (blobs / "partial").rename(blobs / digest.removeprefix("sha256:"))
        layers[digest] = (digest, size, None)
    else:
        diff = _compress(gzip.GzipFile(fileobj=seen) if head[:2] == _GZIP else seen, blobs)
        layers[digest] = diff
    while seen.read(CHUNK):  # what the decompressor left (a gzip trailer), so that the hash is the blob's
        pass
    if seen.digest != digest:
        raise PublishError(f"the engine's export holds {digest[:19]} with other bytes ({seen.digest[:19]}); nothing pushed")


def _compress(tar_stream: Any, blobs: Path) -> tuple[str, int, str]:
    """The uncompressed layer as a zstd blob in blobs: (its digest, its size, the diff ID it holds)."""
    partial = blobs / "partial.zst"
    diff = hashlib.sha256()
    with open(partial, "wb") as out:
        proc = subprocess.Popen([shutil.which("zstd") or "zstd", "-q", f"-{LEVEL}", "-T0", "-c"], stdin=subprocess.PIPE,
                                stdout=out, stderr=subprocess.PIPE)
        assert proc.stdin is not None and proc.stderr is not None  # both PIPE
        try:
            while chunk := tar_stream.read(CHUNK):
                diff.update(chunk)
                proc.stdin.write(chunk)
        except BrokenPipeError:
            pass  # zstd died: its own message, below
        finally:
            proc.stdin.close()
            err = proc.stderr.read().decode(errors="replace").strip()
            code = proc.wait()
    if code != 0:
        raise PublishError(f"zstd exited {code}: {err or 'no message'}; nothing pushed")
    sha = hashlib.sha256()
    with open(partial, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    digest = "sha256:" + sha.hexdigest()
    size = partial.stat().st_size
    partial.rename(blobs / digest.removeprefix("sha256:"))
    return digest, size, "sha256:" + diff.hexdigest()


def _manifest(raw: bytes, image_id: str) -> dict:
    """The image's manifest, proven its own: its bytes hash to the image ID."""
    if _digest(raw) != image_id:
        raise PublishError(f"the engine's export of {image_id[:19]} holds a manifest of another digest ({_digest(raw)[:19]})")
    doc = json.loads(raw)
    if "manifests" in doc:
        raise PublishError(f"{image_id[:19]} is an image index, not one image (built with attestations?): --compression zstd "
                           "takes one platform's image, as build.py builds it (--provenance=false)")
    return doc


def _absent(image_id: str, digest: str) -> NoReturn:
    raise PublishError(f"the engine's export of {image_id[:19]} lacks {digest[:19]} (the store no longer holds it); "
                       "nothing pushed")


def _blob_name(digest: str) -> str:
    return "blobs/sha256/" + digest.removeprefix("sha256:")


def _digest(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


@contextlib.contextmanager
def _export(c: docker.DockerClient, image_id: str) -> Iterator[tarfile.TarFile]:
    """The engine's export of the image as a tar stream; the daemon's failures sorted: one that
    stopped answering is worth another attempt, a refusal is not."""
    chunks = None
    try:
        chunks = c.api.get_image(image_id, chunk_size=CHUNK)
        with tarfile.open(fileobj=io.BufferedReader(_Chunks(chunks), CHUNK), mode="r|", bufsize=CHUNK) as tar:
            yield tar
    except (docker.errors.DockerException, requests.RequestException) as e:
        err = docker_env.failure(f"the export of {image_id[:19]}", e)
        raise (PublishError if docker_env.api_error(e) is not None else Transient)(str(err)) from None
    except tarfile.TarError as e:
        raise Transient(f"the engine's export of {image_id[:19]} broke off: {e}") from None
    finally:
        if chunks is not None and hasattr(chunks, "close"):
            chunks.close()  # a partial read: the daemon stops sending


class _Chunks(io.RawIOBase):
    """A file over an iterator of byte chunks, without copying them."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self.chunks, self.rest = iter(chunks), memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self.rest:
            chunk = next(self.chunks, None)
            if chunk is None:
                return 0
            self.rest = memoryview(chunk)
        n = min(len(b), len(self.rest))
        b[:n] = self.rest[:n]
        self.rest = self.rest[n:]
        return n


class _Hashing(io.RawIOBase):
    """A reader that hashes what passes through it."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self.f.readinto(b)
        self.sha.update(memoryview(b)[:n])
        return n

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()
