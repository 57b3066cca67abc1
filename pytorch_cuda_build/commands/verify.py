"""Reproducibility: build one row twice without the layer cache and compare the images.

Layer by layer and file by file: path, type, mode, owner, size and content hash must be
equal; modification times are reported apart. Docker 20.10's BuildKit (< 0.13) cannot
rewrite them to SOURCE_DATE_EPOCH, and the classic image store ignores rewrite-timestamp;
on the containerd store with buildx >= 0.13 the build exports an OCI tarball with it
(build.py), and the two image digests must then be equal. The base rootfs and the
wheelhouse are reused (both are pinned: the base by its recipe, every wheel by its hash).
"""
from __future__ import annotations

import io
import json
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Iterator

import docker.errors

from .. import files
from ..engine import containers, docker_env
from ..errors import ArchiveLayoutError
from ..matrix import Image
from ..paths import results_dir
from ..stages import base, build
from . import record

Entry = tuple  # (type, mode, uid, gid, size, sha256, linkname)


@dataclass
class Comparison:
    layers: tuple[int, int]
    same_layer_ids: bool
    content: list[str] = field(default_factory=list)  # differing path: what differs
    differing_files: list[str] = field(default_factory=list)  # regular files in both builds, other bytes
    kept: str = ""  # where copies of the differing files went, or why there are none
    ops: str = ""  # where both builds took the compiled DeepSpeed ops from
    mtime_only: int = 0
    files: int = 0
    image_ids: tuple[str, str] = ("", "")  # equal: the two builds are one image, digest and all
    byte_identical: bool = False  # the promise where file times are rewritten: equal digests

    @property
    def reproducible(self) -> bool:
        same = self.layers[0] == self.layers[1] and not self.content
        return same and (not self.byte_identical or self.image_ids[0] == self.image_ids[1])


def layer_index(ref: str, *, docker_cli: str) -> list[dict[str, tuple[Entry, int]]]:
    """For each layer of the image in order: path -> (entry, mtime), read from `docker_cli save`."""
    order, by_name = record.read_saved(ref, docker_cli, lambda stream: read_save(stream, ref))
    missing = [name for name in order if name not in by_name]
    if missing:
        raise ArchiveLayoutError(ref, f"manifest.json lists layer {missing[0]}, which is not a tar archive in it")
    return [by_name[name] for name in order]


def read_save(stream: IO[bytes], ref: str) -> tuple[list[str], dict[str, dict]]:
    """The layer order (manifest.json) and every layer's index from a `docker save` stream.

    Docker before 25 names layers <id>/layer.tar; from 25 on the archive is an OCI layout
    whose layers are blobs/sha256/<hex> (gzip-compressed from the containerd store), next to
    config and manifest blobs that are JSON.
    The stream is read once, and manifest.json may come last, so every candidate is
    indexed and the manifest picks the layers.
    """
    by_name: dict[str, dict] = {}
    order: list[str] | None = None
    try:
        outer = tarfile.open(fileobj=stream, mode="r|")
        for member in outer:
            if member.name == "manifest.json":
                manifest_file = outer.extractfile(member)
                assert manifest_file is not None  # docker save writes regular files
                order = _layers(json.load(manifest_file), ref)
            elif member.isfile() and (member.name.endswith("layer.tar") or member.name.startswith("blobs/")):
                try:
                    by_name[member.name] = _index(tarfile.open(fileobj=outer.extractfile(member), mode="r|*"))
                except tarfile.TarError:
                    pass  # a JSON blob (config, manifest), not a layer
    except (tarfile.TarError, ValueError, UnicodeDecodeError) as e:
        raise ArchiveLayoutError(ref, f"not a readable archive ({type(e).__name__}: {e})") from None
    if order is None:
        raise ArchiveLayoutError(ref, "no manifest.json in it")
    return order, by_name


def _layers(manifest: object, ref: str) -> list[str]:
    if (not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0], dict)
            or not isinstance(manifest[0].get("Layers"), list)):
        raise ArchiveLayoutError(ref, "manifest.json is not one image with a Layers list")
    return [str(x) for x in manifest[0]["Layers"]]


def _index(layer: tarfile.TarFile) -> dict[str, tuple[Entry, int]]:
    return {f.name: ((f.type, f.mode, f.uid, f.gid, f.size, record.content_sha256(layer, f), f.linkname), int(f.mtime))
            for f in layer}


def compare(a: list[dict], b: list[dict], same_layer_ids: bool) -> Comparison:
    result = Comparison(layers=(len(a), len(b)), same_layer_ids=same_layer_ids)
    for i, (la, lb) in enumerate(zip(a, b)):
        for path in sorted(set(la) | set(lb)):
            result.files += 1
            if path not in la or path not in lb:
                result.content.append(f"layer {i}: {path}: only in build {'2' if path not in la else '1'}")
            elif la[path][0] != lb[path][0]:
                result.content.append(f"layer {i}: {path}: {_what(la[path][0], lb[path][0])}")
                da, db = la[path][0][5], lb[path][0][5]  # content hashes; "" where not a regular file
                if da and db and da != db and path not in result.differing_files:
                    result.differing_files.append(path)
            elif la[path][1] != lb[path][1]:
                result.mtime_only += 1
    return result


def _what(x: Entry, y: Entry) -> str:
    names = ("type", "mode", "uid", "gid", "size", "content", "link")
    return ", ".join(n for n, u, v in zip(names, x, y) if u != v)


def verdict(c: Comparison, buildkit_note: str, show: int = 200) -> str:
    lines = [f"layers: {c.layers[0]} vs {c.layers[1]}; files compared: {c.files}"] + ([c.ops] if c.ops else [])
    if c.image_ids[0]:
        same = c.image_ids[0] == c.image_ids[1]
        lines.append(f"image digests: {'identical, ' + c.image_ids[0] if same else 'differ, ' + ' vs '.join(c.image_ids)}")
    if c.same_layer_ids:
        lines.append("layer digests: identical (bit-for-bit)")
    else:
        lines.append(f"layer digests: differ ({buildkit_note})")
    lines += record.content_lines(c.mtime_only, c.content, show, " in verdict.txt")
    if c.kept:
        lines.append(c.kept)
    if c.reproducible:
        lines.append("verdict: REPRODUCIBLE: " + ("byte-identical images" if c.byte_identical else "same content in every layer"))
    else:
        lines.append("verdict: NOT REPRODUCIBLE" + (": the digests differ" if c.byte_identical and not c.content else ""))
    return "\n".join(lines)


# What `verify` keeps of files whose bytes differ, so the two versions can be compared
# (diffoscope, objdump): the first few, each up to a size; a build's own record, not a backup.
KEEP_FILES, KEEP_FILE_BYTES = 50, 256 * 1024**2


def keep_differing(c: docker.DockerClient, refs: tuple[str, ...], paths: list[str], dest: Path) -> int:
    """Copy each differing file out of both images, as the finished images have them, to
    dest/build1/<path> and dest/build2/<path>; how many files were kept from both."""
    shutil.rmtree(dest, ignore_errors=True)
    kept = 0
    for path in paths[:KEEP_FILES]:
        got = [_copy_out(c, ref, path, dest / f"build{n}") for n, ref in enumerate(refs, 1)]
        kept += all(got)
    return kept


def _copy_out(c: docker.DockerClient, ref: str, path: str, dest: Path) -> bool:
    container = c.containers.create(ref, command=["true"], entrypoint=[], labels=containers.labels("verify"))
    try:
        stream, stat = container.get_archive("/" + path)
        if (stat or {}).get("size", 0) > KEEP_FILE_BYTES:
            return False
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        raw = b"".join(stream)
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            member = tar.next()
            fh = tar.extractfile(member) if member is not None else None
            if fh is None:
                return False  # not a regular file in the finished image (a later layer replaced it)
            target.write_bytes(fh.read())
        return True
    finally:
        container.remove(force=True)


def run(root: Path, image: Image, results: Path, docker: str | None, ca: str | None, log: Callable[[str], None],
        compile_ops: bool = False) -> tuple[Comparison, str]:
    """Build the row twice without the layer cache (same base, same wheelhouse), compare,
    write verdict.txt beside the two build logs, and remove both builds; the comparison and
    what the verdict must say about this BuildKit. Each build is indexed (every file's hash);
    the first stays while the second is built only where the disk has room for both, so that
    files whose bytes differ can be copied out of each (differing/); otherwise it is removed
    first and verify needs the disk of one image, not two. Both builds take the DeepSpeed ops
    wheel from the host's ops seed where it has one, unless compile_ops: then each compiles them,
    as a rebuild on a machine without this one's state does."""
    c = docker_env.ensure_engine(log)
    with docker_env.calls("the verify", c=c):
        return _twice(c, root, image, results, docker, ca, log, compile_ops)


def _twice(c: docker.DockerClient, root: Path, image: Image, results: Path, docker: str | None, ca: str | None,
           log: Callable[[str], None], compile_ops: bool) -> tuple[Comparison, str]:
    bc = docker_env.build_client(docker)
    build.check_disk(docker_env.root_dir(c))
    results.mkdir(parents=True, exist_ok=True)
    base_id = base.ensure(c, image, results, log, docker_cli=bc.argv[0], root=root)
    # Read once: both builds' labels name this commit, even if the checkout is edited or
    # committed to while they run (a second reading would make the configs, so the digests, differ).
    src = build.source(root)
    ids, diff_ids, indexes, kept_refs = [], [], [], []
    refs = tuple(f"{image.repository}-verify:{image.local_name}-{n}" for n in (1, 2))
    try:
        for n, ref in enumerate(refs, 1):
            log(f"verify: build {n} of 2 without the layer cache (log: {results / f'build{n}.log'})")
            kept_refs.append(ref)  # removed below whatever happens
            ids.append(build.run(bc, root, image, results / f"build{n}.log", ca, no_cache=True, echo=False, tag=ref, base_id=base_id,
                                 ops_seed=not compile_ops, src=src))
            log(f"verify: reading build {n}'s layers")
            attrs = c.images.get(ids[-1]).attrs
            diff_ids.append(attrs["RootFS"]["Layers"])
            indexes.append(layer_index(ref, docker_cli=bc.argv[0]))
            if n == 1 and not _room_for_two(docker_env.root_dir(c), attrs.get("Size") or 0):
                _remove(c, kept_refs.pop())
        log("verify: comparing the two images layer by layer")
        comparison = compare(indexes[0], indexes[1], diff_ids[0] == diff_ids[1])
        comparison.image_ids, comparison.byte_identical = (ids[0], ids[1]), bc.export == "oci"
        if bc.export == "oci":
            note = f"{bc.description}: with rewrite-timestamp, so a difference here is one in the build itself"
        else:
            note = f"{bc.description}: this engine cannot rewrite file times to SOURCE_DATE_EPOCH (its BuildKit predates " \
                   "rewrite-timestamp, or its classic image store ignores it), so layer tars carry build-time mtimes"
        comparison.ops = "DeepSpeed ops compiled in each build" if compile_ops else \
            "DeepSpeed ops from the host's ops seed where it had this image's (--compile-ops compiles them in each build)"
        if comparison.differing_files:
            comparison.kept = _keep(c, refs, comparison.differing_files, results / "differing", log)
        files.write_atomic(results / "verdict.txt", verdict(comparison, note, show=len(comparison.content)) + "\n")
        return comparison, note
    finally:
        for ref in kept_refs:
            _remove_leaving(c, ref, log)


SECOND_BUILD_MARGIN = 4 * 1024**3


def _room_for_two(docker_root: str, image_size: int) -> bool:
    """With the first build on disk, room for a second: its layers and the stages' layers beside
    them (about the image's size twice; on the containerd store the compressed blobs and the
    OCI tarball take that), and a margin. Not build.check_disk's 25 GiB, which a cold build
    needs for caches a --no-cache build never fills: with that, a host with 35 GiB free kept
    nothing to compare when the two builds differed."""
    return build.free_bytes(docker_root)[0] >= 2 * image_size + SECOND_BUILD_MARGIN


def _keep(c: docker.DockerClient, refs: tuple[str, ...], paths: list[str], dest: Path, log: Callable[[str], None]) -> str:
    """Copy the differing files out of both builds where both are still there; what was done, for the verdict."""
    try:
        for ref in refs:
            c.images.get(ref)
    except docker.errors.ImageNotFound:
        return "differing files not kept (no disk for both builds at once)"
    try:
        kept = keep_differing(c, refs, paths, dest)
    except (docker.errors.DockerException, OSError, tarfile.TarError) as e:
        log(f"verify: could not copy the differing files out: {e}")
        return "differing files not kept (copying them out failed, see above)"
    return f"{kept} differing file(s) kept from both builds under {dest}"


def _remove(c: docker.DockerClient, ref: str) -> None:
    try:
        c.images.remove(ref, force=True)
    except docker.errors.ImageNotFound:
        pass  # never built, or already gone


def _remove_leaving(c: docker.DockerClient, ref: str, log: Callable[[str], None]) -> None:
    """_remove on the way out: a daemon that cannot remove it is said, never masking why we leave."""
    try:
        _remove(c, ref)
    except docker_env.TRANSPORT as e:
        log(f"warning: could not remove {ref} ({docker_env._short(e)}); remove it with `docker image rm {ref}`")


def each_platform(root: Path, images: list[Image], docker: str | None, ca: str | None, log: Callable[[str], None],
                  compile_ops: bool) -> Iterator[tuple[str, bool]]:
    """`build.py verify`: each platform in turn, its own two builds and its own verdict; the lines to
    print and whether its two builds were one image."""
    for image in images:
        docker_env.ensure_emulation(image.platform, log)
        comparison, note = run(root, image, results_dir(root, image) / "verify", docker, ca, log, compile_ops=compile_ops)
        yield f"{image.name} on {image.platform}:\n{verdict(comparison, note)}", comparison.reproducible
