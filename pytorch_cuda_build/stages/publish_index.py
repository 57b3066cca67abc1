"""Stage 10, for a row built on several platforms: each platform's tested image to its part tag
`<dated>-<arch>`, then one OCI index of the parts under the row's dated and moving tags
(registry/index.py writes and reads the index). publish.py is the same stage for a row of one
platform, and holds the tag rules both follow (the dated tag, immutable tags, read-back)."""
from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import docker
import docker.errors

from ..engine import docker_env
from ..errors import EnvironmentProblem, ImageUnfit, ImmutableTagTaken, NotReady, PublishError, TagTaken
from ..matrix import Image
from ..registry import index
from ..registry.client import Registry, RegistryAPI, credentials
from ..registry.retry import Transient, retrying
from . import tag as tags
from .build import source
from .publish import CREATED_LABEL, Move, action, dated_tag, execute, learn_configs, lock_files_sha256, tested_id
from .render import LOCK_LABEL


@dataclass(frozen=True)
class PlatformImage:
    image: Image  # the row on one platform (Image.on)
    image_id: str


def tested(c: docker.DockerClient, row: Image) -> list[PlatformImage]:
    """Each platform's image of the row (tag.own_ref), refusing a platform never built, one whose tag now names another
    architecture, and one never tested."""
    out = []
    for platform in row.platforms:
        image = row.on(platform)
        ref = tags.own_ref(image)
        build_cmd = f"python build.py --torch {row.torch} --cuda {row.cuda} --platform all"
        try:
            img = c.images.get(ref)
        except docker.errors.ImageNotFound:
            raise NotReady(f"{row.name} has no {platform} image here (no {ref}); build and test every platform first: {build_cmd}", ref=ref) from None
        arch = img.attrs.get("Architecture")
        if arch != image.arch:
            raise ImageUnfit(f"{ref} is a {arch} image, not {platform} (a build for one platform moved the row's tags); {build_cmd}", ref=ref)
        assert img.id is not None  # docker-py types Model.id optional; an image the engine lists has one
        if tags.passed(img.id) is None:
            raise NotReady(f"{ref} ({img.id[:19]}) never passed its tests here; nothing pushed ({build_cmd})", ref=ref)
        out.append(PlatformImage(image, img.id))
    return out


def _parts(c: docker.DockerClient, images: list[PlatformImage], compression: str = "gzip") -> tuple[str, list[Move]]:
    """The dated tag the platform images share (commit day and lock), and a move of each to its
    part tag `<dated>-<arch>`, immutable like the dated tag."""
    dated = {dated_tag(p.image, c.images.get(p.image_id).labels, tags.own_ref(p.image)) for p in images}
    if len(dated) != 1:
        row = images[0].image
        raise ImageUnfit(f"{row.name}'s platform images come from other commits or locks ({', '.join(sorted(dated))}); "
                         f"build them together: python build.py --torch {row.torch} --cuda {row.cuda} --platform all", ref=row.name)
    day = dated.pop()
    by_manifest = docker_env.image_store(c) == "containerd"
    return day, [Move(p.image, p.image_id, f"{day}-{p.image.arch}", True, by_manifest=by_manifest, compression=compression)
                 for p in images]


def _push_parts(c: docker.DockerClient, api: RegistryAPI, parts: list[Move], creds: dict | None, push: bool,
                retry: Callable, log: Callable[[str], None]) -> list[tuple[str, str, str]]:
    """Each platform's image to its part tag (read first: one holding another image is refused,
    nothing pushed), then read back; a table row each."""
    reg = api.reg
    try:
        for mv in parts:
            mv.before = retry(lambda: mv.read(api), f"reading {mv.target(reg)}")
        learn_configs(c, parts, retry)
    except Transient as e:
        raise EnvironmentProblem(f"{e}; nothing pushed") from None
    taken = [TagTaken(mv.target(reg), mv.before.digest, mv.before.config, mv.image_id) for mv in parts if mv.before and not mv.in_place]
    if taken:
        raise ImmutableTagTaken(taken)
    if push:
        try:
            execute(c, api, parts, creds, retry, log)
        except (Transient, PublishError) as e:
            raise PublishError(f"publish stopped at {e}; no index was pushed, and no tag of the row moved") from None
    now = (lambda mv: mv.after) if push else (lambda mv: mv.before)
    return [(mv.target(reg), now(mv).digest if now(mv) else "absent", action(mv, push)) for mv in parts]


def publish_part(c: docker.DockerClient, image: Image, reg: Registry, *, push: bool, ca_bundle: str | None, attempts: int,
                 backoff: float, log: Callable[[str], None], compression: str = "gzip") -> list[str]:
    """This host's platform of a row built on several: its image to `<dated>-<arch>` only. The
    row's tags are left to the index (publish --merge, once every platform's part is there)."""
    creds = credentials(reg)
    api = RegistryAPI(reg, creds, ca_bundle)
    retry = retrying(attempts, backoff, log)
    _, parts = _parts(c, [PlatformImage(image, tested_id(c, image))], compression)
    rows = _push_parts(c, api, parts, creds, push, retry, log)
    return _index_table(rows, push) + [f"{image.name} is built for {', '.join(image.platforms)}: its tags name an index of "
                                       "every platform's part (publish --merge, or --platform all on a machine with every one)"]


def publish_index(c: docker.DockerClient, row: Image, reg: Registry, *, push: bool, ca_bundle: str | None, attempts: int,
                  backoff: float, log: Callable[[str], None], compression: str = "gzip") -> list[str]:
    """Every platform of the row, built and tested here, as its parts and then one index under
    its dated and moving tags (index.py); the table's lines. With zstd, each part is its
    platform image's zstd form; the index names the parts as the registry holds them."""
    creds = credentials(reg)
    api = RegistryAPI(reg, creds, ca_bundle)
    retry = retrying(attempts, backoff, log)
    dated, parts = _parts(c, tested(c, row), compression)
    try:
        retry(lambda: api.ping(row), "contacting the registry")
    except Transient as e:
        raise EnvironmentProblem(f"{e}; nothing pushed") from None
    rows = _push_parts(c, api, parts, creds, push, retry, log)
    if not push:
        return _index_table(rows + [(f"{reg}/{row.repository}:{t}", "", "would push") for t in [dated, *row.tags]], push)
    return _push_index(api, row, dated, [(mv.image.platform, mv.tag) for mv in parts], rows, retry, log)


def merge_index(root: Path, row: Image, reg: Registry, *, push: bool, ca_bundle: str | None, attempts: int,
                backoff: float, log: Callable[[str], None]) -> list[str]:
    """CI's merge job: the index of the parts each platform's build published for this commit
    (their dated tag is the checkout's: its commit day and the row's lock). A part that is
    missing stops it before anything is pushed: only rows whose every platform passed merge."""
    api = RegistryAPI(reg, credentials(reg), ca_bundle)
    retry = retrying(attempts, backoff, log)
    src = source(root)
    labels = {CREATED_LABEL: src.created, LOCK_LABEL: lock_files_sha256(root, row)}
    dated = dated_tag(row, labels, f"the checkout ({src.revision[:12]})")
    parts = [(p, f"{dated}-{p.split('/')[1]}") for p in row.platforms]
    try:
        found = {t: retry(lambda: api.raw(row.repository, t), f"reading {reg}/{row.repository}:{t}") for _, t in parts}
    except Transient as e:
        raise EnvironmentProblem(f"{e}; nothing pushed") from None
    present = {t: raw for t, raw in found.items() if raw is not None}
    missing = [f"{reg}/{row.repository}:{t}" for t in found if t not in present]
    if missing:
        raise PublishError(f"{row.name}: no part {', '.join(missing)} in the registry (its platform's build failed or did not "
                           "publish); nothing pushed, no tag moved")
    rows = [(f"{reg}/{row.repository}:{t}", "sha256:" + hashlib.sha256(present[t]).hexdigest(), "part, in place") for _, t in parts]
    if not push:
        return _index_table(rows + [(f"{reg}/{row.repository}:{t}", "", "would push") for t in [dated, *row.tags]], push)
    return _push_index(api, row, dated, parts, rows, retry, log)


def _push_index(api: RegistryAPI, row: Image, dated: str, parts: list[tuple[str, str]], rows: list[tuple[str, str, str]],
                retry: Callable, log: Callable[[str], None]) -> list[str]:
    """The index of the parts (platform, part tag) to the dated tag, read back, then to each moving
    tag; a dated tag that holds another index is refused before the index is pushed anywhere."""
    reg = api.reg
    targets = [dated, *row.tags]
    try:
        manifests = [(platform, retry(lambda: api.raw(row.repository, t), f"reading {reg}/{row.repository}:{t}")) for platform, t in parts]
        before = {t: retry(lambda: api.raw(row.repository, t), f"reading {reg}/{row.repository}:{t}") for t in targets}
    except Transient as e:
        raise EnvironmentProblem(f"{e}; no index pushed, no tag of the row moved") from None
    document = index.list_document(manifests)
    digest = index.digest_of(document)
    if before[dated] is not None and index.digest_of(before[dated]) != digest:
        raise ImmutableTagTaken([TagTaken(f"{reg}/{row.repository}:{dated}", index.digest_of(before[dated]), None, digest)])
    configs = {platform: json.loads(raw)["config"]["digest"] for platform, raw in manifests}
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-index-") as tmp:
        layout = Path(tmp) / "layout"
        index.write_layout(layout, document)
        for t in targets:
            target = f"{reg}/{row.repository}:{t}"
            if before[t] is not None and index.digest_of(before[t]) == digest:
                rows.append((target, digest, "already there"))
                continue
            log(f"pushing {target} (an index of {', '.join(configs)})")
            try:
                retry(lambda: api.push_index(layout, index.INDEX_REF, row.repository, t), f"pushing {target}")
                got = retry(lambda: index.check_index(api, row.repository, t, configs), f"reading back {target}")
            except (Transient, PublishError) as e:
                raise PublishError(f"publish of {row.name} stopped at {target}: {e}; the tags before it hold the index, "
                                   "the ones after it are as they were") from None
            if got != digest:
                raise PublishError(f"read-back of {target} is {got}, not the index pushed ({digest})")
            rows.append((target, digest, "pushed, verified"))
    return _index_table(rows, True) + [f"pull by digest (every platform): {reg.repository(row)}@{digest}"]


def _index_table(rows: list[tuple[str, str, str]], push: bool) -> list[str]:
    rows = [("TAG", "DIGEST", "ACTION"), *rows]
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    return lines if push else lines + ["dry run: nothing pushed; add --push to publish"]
