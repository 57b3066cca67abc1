"""verify --image: check a published image against its source, from any machine with a checkout.

    build.py verify --image HOST/NS/pytorch-cuda@sha256:<digest> [--against LOCAL]

1. Read the published image: its manifest (the platform's, from an index), config and labels.
2. Its labels name the commit and the row; a checkout at another commit is refused (exit 2).
3. Rebuild the row from this checkout, without the layer cache and with the DeepSpeed ops
   compiled, on the base the image names: this machine's if it is that one (the base is
   reproducible from its recipe and mirror state, stages/base.py), else the registry's copy
   that `publish` pushed beside it. `--against LOCAL` compares with an image built already.
4. Compare what a rebuild can promise: the config's digest and the layers' diff_ids
   (uncompressed). Compressed digests also depend on the compressor (gzip or zstd, and its
   version), so the published manifest's digest is not compared.
5. On a mismatch, name the config fields and, layer by layer, the files that differ.

Exit 0: the same image; 1: another; 2: bad input; 3: it could not be rebuilt here (an input
gone from a mirror, the base neither rebuildable nor in the registry, a failed build).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import docker

from pytorch_cuda_runtime.lockfile import Input

from .. import files
from ..engine import docker_env
from ..errors import BadValue, EngineLost, ImageUnfit, NotReady, PipelineError, RegistryMismatch
from ..jobs import ImageRef
from ..matrix import Image, Matrix
from ..registry import attach
from ..registry.client import Registry, RegistryAPI, credentials
from ..stages import base, build, fetch, lock, publish, render
from . import record

REVISION_LABEL = "org.opencontainers.image.revision"
ROW_LABEL = "io.pytorch-cuda.image"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


class NotRebuilt(PipelineError):
    """The row could not be rebuilt here, so nothing was compared."""

    exit_code = 3


@dataclass
class Published:
    ref: ImageRef
    manifest: str  # the platform's manifest digest
    config_digest: str
    config: dict
    platform: str

    @property
    def labels(self) -> dict[str, str]:
        return (self.config.get("config") or {}).get("Labels") or {}

    @property
    def diff_ids(self) -> list[str]:
        return list((self.config.get("rootfs") or {}).get("diff_ids") or [])


def api_for(ref: ImageRef, ca: str | None) -> tuple[RegistryAPI, str]:
    """A reader of ref's registry, and the repository's path under its namespace."""
    host, path = ref.split()
    if host is None or "/" not in path:
        raise BadValue(f"--image {ref}: expected HOST[:PORT]/NAMESPACE/NAME@sha256:<64 hex>, a registry's image", name="--image")
    namespace, name = path.rsplit("/", 1)
    reg = Registry(host, namespace)
    return RegistryAPI(reg, credentials(reg), ca), name


def read_published(api: RegistryAPI, name: str, ref: ImageRef, platform: str) -> Published:
    raw = api.raw(name, ref.digest)
    if raw is None:
        raise RegistryMismatch(f"{ref} is not in the registry (manifest unknown)", ref=ref)
    if "sha256:" + hashlib.sha256(raw).hexdigest() != ref.digest:
        raise RegistryMismatch(f"the registry served {ref} as bytes of another digest", ref=ref)
    doc = json.loads(raw)
    manifest = ref.digest
    if doc.get("mediaType") in INDEX_TYPES or "manifests" in doc:
        want = dict(zip(("os", "architecture"), platform.split("/")))
        found = [m for m in doc.get("manifests") or []
                 if {k: (m.get("platform") or {}).get(k) for k in want} == want]
        if not found:
            have = sorted({"/".join(str((m.get("platform") or {}).get(k)) for k in ("os", "architecture")) for m in doc["manifests"]})
            raise RegistryMismatch(f"{ref} is an index without {platform} (it has {', '.join(have)}); give --platform", ref=ref)
        manifest = found[0]["digest"]
        doc = json.loads(api.raw(name, manifest) or b"{}")
    config_digest = (doc.get("config") or {}).get("digest")
    if not config_digest:
        raise RegistryMismatch(f"{ref} is not an image manifest", ref=ref)
    config_raw = api.config(name, manifest)
    if "sha256:" + hashlib.sha256(config_raw).hexdigest() != config_digest:
        raise RegistryMismatch(f"the registry served {ref}'s config as bytes of another digest", ref=ref)
    config = json.loads(config_raw)
    return Published(ref, manifest, config_digest, config, f"{config.get('os')}/{config.get('architecture')}")


def row_of(matrix: Matrix, published: Published, revision: str) -> Image:
    """The row the labels name, on the image's platform; the checkout must be the labels' commit."""
    labels = published.labels
    want, name = labels.get(REVISION_LABEL, ""), labels.get(ROW_LABEL, "")
    if not want or not name:
        raise ImageUnfit(f"{published.ref} has no {REVISION_LABEL} and {ROW_LABEL} labels: not an image build.py made", ref=published.ref)
    if revision != want:
        said = "has uncommitted changes" if revision == f"{want}-dirty" else f"is at {revision}"
        raise ImageUnfit(f"this checkout {said}, but {published.ref} was built from {want}: git checkout {want}", ref=published.ref)
    row = next((i for i in matrix.images if i.name == name), None)
    if row is None:
        raise ImageUnfit(f"{published.ref} names row {name}, which this checkout's matrix.yaml does not have", ref=published.ref)
    if published.platform not in row.platforms:
        raise ImageUnfit(f"{published.ref} is for {published.platform}, which row {name} is not built for", ref=published.ref)
    return row.on(published.platform)


config_differences = record.config_differences  # the config fields that differ: `field: published -> local`


@dataclass
class Local:
    ref: str
    config_digest: str
    config: dict
    diff_ids: list[str]


def read_local(ref: str, docker_cli: str) -> Local:
    """The local image's config (as `docker save` writes it: its bytes decide the digest) and diff_ids."""
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-verify-") as tmp:
        archive = Path(tmp) / "image.tar"
        proc = subprocess.run([docker_cli, "save", "--output", str(archive), ref], capture_output=True, text=True)
        if proc.returncode != 0:
            raise NotReady(f"cannot read the local image {ref}: {(proc.stderr.strip().splitlines() or [''])[-1]}", ref=ref)
        with tarfile.open(archive) as tar:
            manifest_file = tar.extractfile("manifest.json")
            assert manifest_file is not None  # docker save writes regular files
            manifest = json.load(manifest_file)
            config_file = tar.extractfile(manifest[0]["Config"])
            assert config_file is not None
            raw = config_file.read()
    config = json.loads(raw)
    return Local(ref, "sha256:" + hashlib.sha256(raw).hexdigest(), config, list(config["rootfs"]["diff_ids"]))


def published_layers(api: RegistryAPI, name: str, published: Published, wanted: set[int]) -> list[dict]:
    """Index (path -> entry) of the published image's layers numbered in wanted; {} for the others."""
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-verify-") as tmp:
        layout = Path(tmp) / "layout"
        api.copy_to_layout(name, published.manifest, layout)
        manifest = json.loads((layout / "blobs" / "sha256" / published.manifest.split(":")[1]).read_text())
        out: list[dict] = []
        for i, layer in enumerate(manifest["layers"]):
            if i not in wanted:
                out.append({})
                continue
            blob = layout / "blobs" / "sha256" / layer["digest"].split(":")[1]
            out.append(_index_blob(blob, layer.get("mediaType", "")))
        return out


def _index_blob(blob: Path, media_type: str) -> dict[str, record.Entry]:
    if media_type.endswith("+zstd"):
        zstd = subprocess.Popen(["zstd", "-dc", str(blob)], stdout=subprocess.PIPE)
        with tarfile.open(fileobj=zstd.stdout, mode="r|") as tar:
            index = record.index_layer(tar)
        zstd.wait()
        return index
    with tarfile.open(blob, mode="r:*") as tar:
        return record.index_layer(tar)


@dataclass
class Verdict:
    same: bool
    lines: list[str]


def compare(api: RegistryAPI, name: str, published: Published, local: Local, docker_cli: str) -> Verdict:
    lines = [f"published: {published.ref} ({published.platform}), manifest {published.manifest}",
             f"config digest: published {published.config_digest}, here {local.config_digest} ({local.ref})",
             f"layers (diff_ids): published {len(published.diff_ids)}, here {len(local.diff_ids)}"]
    if published.config_digest == local.config_digest:
        return Verdict(True, [*lines, "verdict: THE SAME IMAGE: one config digest, so the same diff_ids"])
    differing = {i for i in range(max(len(published.diff_ids), len(local.diff_ids)))
                 if i >= len(published.diff_ids) or i >= len(local.diff_ids) or published.diff_ids[i] != local.diff_ids[i]}
    # Only the differing layers are read from the registry, so only those are compared: the
    # others are the same diff_id on both sides, and compare() skips them.
    theirs = published_layers(api, name, published, differing) if differing else [{} for _ in published.diff_ids]
    ours = record.from_image(local.ref, "", docker_cli, local.ref)
    mine = record.Record(published.manifest, published.config_digest, published.config,
                         [record.Layer(d, "", theirs[i] if i in differing else None) for i, d in enumerate(published.diff_ids)])
    diff = record.compare(mine, ours, ("the published image", "the image here"))
    return Verdict(False, [*lines, *record.lines(diff)[1:],
                           "verdict: DIFFERENT: " + ("the files above differ" if differing else "the config differs, the layers are the same")])


def fill_store(ref: ImageRef, items: list[Input], ca: str | None, log: Callable[[str], None]) -> int:
    """The store's missing items from the files `publish` attached beside ref (none: say so); how many."""
    store = fetch.store()
    if not store.missing(items):
        return 0
    api, name = api_for(ref, ca)
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-inputs-", dir=store.root.parent if store.root.parent.exists() else None) as tmp:
        blobs = attach.read_inputs(api, name, ref.digest, Path(tmp) / "layout")
        if blobs is None:
            log(f"fetch: {ref} has no inputs attached (published with --attach-inputs none, or before they were)")
            return 0
        log(f"fetch: the files attached beside {ref}")
        return fetch.fill_from(items, blobs, log, store)


def base_for(c: docker.DockerClient, api: RegistryAPI, image: Image, published: Published, results: Path, docker_cli: str, root: Path, log: Callable[[str], None]) -> str:
    """The base the image names, here: this machine's (built from the recipe if absent), else the
    registry's copy publish pushed; NotRebuilt where neither is that base."""
    want = published.labels.get(publish.BASE_LABEL, "")
    if image.os.kind == "registry":
        return base.ensure(c, image, results, log, docker_cli=docker_cli, root=root)
    have = base.ensure(c, image, results, log, docker_cli=docker_cli, root=root)
    if have == want:
        log(f"verify: the base here is the image's ({want[:19]})")
        return have
    layers = c.images.get(have).attrs.get("RootFS", {}).get("Layers") or []
    if layers[:1] == published.diff_ids[:1]:  # the same rootfs, under another store's kind of ID
        raise NotRebuilt(f"the base here is the image's rootfs ({layers[0][:19]}) but has the ID {have[:19]} on this engine's "
                         f"store, and the image's label names {want[:19]}: the label is part of the config, so rebuild on "
                         "an engine with the store the image was built on (containerd: build.py engine)")
    repository, tag = render.base_ref(image).split(":", 1)
    remote = f"{api.reg.host}/{api.reg.namespace}/{repository}:{tag}-{want.removeprefix('sha256:')[:12]}"
    log(f"verify: the base here ({have[:19]}) is not the image's ({want[:19]}); pulling {remote}")
    pulled = subprocess.run([docker_cli, "pull", remote], capture_output=True, text=True)
    if pulled.returncode != 0:
        raise NotRebuilt(f"the image's base {want[:19]} is neither the one rebuilt here from the recipe ({have[:19]}: the mirror "
                         f"may have moved, see build-results) nor in the registry ({remote}: "
                         f"{(pulled.stderr.strip().splitlines() or ['not found'])[-1]})")
    got = str(c.images.get(remote).id)
    if got != want:
        raise NotRebuilt(f"{remote} is {got[:19]}, not the image's base {want[:19]} (a base pulled onto another image store "
                         "has another ID: rebuild on the store the image was built on)")
    subprocess.run([docker_cli, "tag", remote, render.base_ref(image)], check=True, capture_output=True)
    return got


def rebuild(c: docker.DockerClient, bc: docker_env.BuildClient, api: RegistryAPI, image: Image, published: Published, root: Path, results: Path, ca: str | None, log: Callable[[str], None]) -> str:
    """The row rebuilt without cache, ops compiled, on the image's base; its local reference. A
    daemon lost meanwhile is no failed rebuild: its own error goes up (exit 2, not 3)."""
    try:
        with docker_env.calls("the rebuild of `verify --image`", c=c):
            return _rebuild(c, bc, api, image, published, root, results, ca, log)
    except (NotRebuilt, EngineLost):
        raise
    except PipelineError as e:
        raise NotRebuilt(f"could not rebuild {image.name}: {e}") from None


def _rebuild(c: docker.DockerClient, bc: docker_env.BuildClient, api: RegistryAPI, image: Image, published: Published, root: Path,
             results: Path, ca: str | None, log: Callable[[str], None]) -> str:
    base_id = base_for(c, api, image, published, results, bc.argv[0], root, log)
    ref = f"{image.repository}-verify:{image.local_name}-published"
    log(f"verify: rebuilding {image.name} for {image.platform} without the layer cache, ops compiled "
        f"(log: {results / 'rebuild.log'})")
    build.run(bc, root, image, results / "rebuild.log", ca, no_cache=True, echo=False, tag=ref, base_id=base_id,
              ops_seed=False, src=build.source(root))
    return ref


def run(root: Path, matrix: Matrix, ref: ImageRef, platform: str, against: str | None, docker: str | None, ca: str | None,
        log: Callable[[str], None], check_inputs: Callable[[Image], None], results_of: Callable[[Image], Path]) -> Verdict:
    """The whole check: read the published image, take its row from this checkout (its inputs
    checked by check_inputs), rebuild it (or take `against`), compare, and write the lines to
    results_of(image)/verify-image/verdict.txt."""
    api, name = api_for(ref, ca)
    published = read_published(api, name, ref, platform)
    image = row_of(matrix, published, build.source(root).revision)
    check_inputs(image)
    c, bc = docker_env.ensure_engine(log), docker_env.build_client(docker)
    results = results_of(image) / "verify-image"
    results.mkdir(parents=True, exist_ok=True)
    with docker_env.calls("`verify --image`", c=c):
        if against is not None:
            verdict = compare(api, name, published, read_local(against, bc.argv[0]), bc.argv[0])
        else:
            docker_env.ensure_emulation(image.platform, log)
            build.check_disk(docker_env.root_dir(c))
            fill_store(ref, lock.build_inputs(root, image).all(), ca, log)  # what a mirror dropped, from the registry
            rebuilt = rebuild(c, bc, api, image, published, root, results, ca, log)
            try:
                verdict = compare(api, name, published, read_local(rebuilt, bc.argv[0]), bc.argv[0])
            except PipelineError:
                log(f"verify: the rebuild stays as {rebuilt}: `--against {rebuilt}` compares it again without rebuilding")
                raise
            verdict = kept_unless_same(c, rebuilt, verdict)
    files.write_atomic(results / "verdict.txt", "\n".join(verdict.lines) + "\n")
    return verdict


def kept_unless_same(c: docker.DockerClient, rebuilt: str, verdict: Verdict) -> Verdict:
    """The rebuild (the row's size: 10 GB for the default) is removed when it is the published
    image. When it differs it is what a user inspects (diffoscope, `docker run`), so it stays,
    named in the last line."""
    if verdict.same:
        try:
            c.images.remove(rebuilt, force=True)
        except docker.errors.NotFound:
            pass
        return verdict
    return Verdict(False, [*verdict.lines, f"the rebuild is kept as {rebuilt} (remove it with `docker image rm {rebuilt}`)"])
