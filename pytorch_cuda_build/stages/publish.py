"""Stage 10: publish tested images to a registry.

Only an image ID recorded as tested is pushed. Each row's immutable tag is dated:
`<row>-<YYYYMMDD>-<lock8>`, the source commit's day (UTC) and the lock's hash, both read
from the image's labels so the tag is a fact of the artefact. It never moves: one that
the registry holds at another image is refused before anything is pushed. Every
immutable tag of the run goes first and is read back from the registry (manifest digest
and config digest = the local image ID) before any moving tag (the row's name, the
aliases) moves, so a failure part-way leaves them where they were. A tag already
holding this image is skipped. Pushing happens only with push=True: the default is a
dry run that prints what would move. Before the registry is contacted, `screen` refuses
an image whose vulnerabilities.json (security.py) lists a critical advisory not allowed.

A locally built base rootfs goes first, under an immutable tag that names its image ID
(`pytorch-cuda-rootfs:bookworm-<recipe>-<id12>`): a rebuild from the commit has one digest with
the publisher's only on the same base, and a base rebuilt from a mirror that has moved since is
another one; the published base is what a rebuild can always take.

With compression="zstd" (containerd store only) a row's dated tag gets the image's zstd form
(zstd.py: the same config, zstd layers), read back as that config with every layer zstd, and its
moving tags get that very manifest, copied by digest in the registry. An immutable tag already
holding the image in the other compression is left as it is ("already there"), and the row's
moving tags follow it: every tag of a row names one manifest. The base is always pushed as the
engine holds it: its manifest digest is what a rebuild elsewhere must pull.
"""
from __future__ import annotations

import datetime as dt
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import docker
import docker.auth
import docker.errors

from ..engine import docker_env
from ..errors import BadValue, EnvironmentProblem, ImageUnfit, ImmutableTagTaken, NotReady, PublishError, RegistryRefused, TagTaken
from ..files import write_atomic
from ..matrix import Image
from ..registry import zstd
from ..registry.client import Registry, RegistryAPI, Remote, credentials
from ..registry.retry import Retry, Transient, retrying
from . import lock, render, sbom, security
from . import tag as tags
from .render import LOCK_LABEL

_PUSHED_DIGEST = re.compile(r"\bdigest: (sha256:[0-9a-f]{64})\b")
# Push errors worth retrying: the registry or the network hiccuped. Anything else
# (unauthorized, denied, a malformed name) fails the same way every time.
_PERMANENT = re.compile(r"unauthori[sz]ed|denied|authentication required|invalid reference|name unknown", re.I)
BASE_LABEL = "org.opencontainers.image.base.digest"  # the local image ID of the base the row was built on
CREATED_LABEL = "org.opencontainers.image.created"  # the source commit's time (not SOURCE_DATE_EPOCH: matrix.REPRODUCIBLE_EPOCH)
_LOCK_HASH = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class Move:
    image: Image
    image_id: str
    tag: str
    immutable: bool
    before: Remote | None = None
    after: Remote | None = None
    # Which registry digest the local ID is. The classic store's image ID is the config
    # digest; the containerd store's is the digest of the manifest (or index) that a push
    # sends unchanged.
    by_manifest: bool = False
    base: str = ""  # the base rootfs's repository (e.g. pytorch-cuda-rootfs) when this moves the row's base
    compression: str = "gzip"  # gzip: the image as the engine holds and pushes it; zstd: its zstd form (zstd.py)
    # The tested image's config digest: the image ID on the classic store; on the containerd store
    # "" until a decision needs it (zstd.config_digest reads it from the image's manifest).
    config: str = ""
    # A moving tag set to what its row's dated tag holds (zstd, or this image in zstd from an
    # earlier run), copied by digest in the registry rather than pushed from the engine.
    follows: Remote | None = None

    def __post_init__(self) -> None:
        if not self.by_manifest and not self.config:
            self.config = self.image_id

    @property
    def name(self) -> str:
        """The repository under the registry's namespace: the base's, or the row's."""
        return self.base or self.image.repository

    def repository(self, reg: Registry) -> str:
        return f"{reg}/{self.name}"

    def target(self, reg: Registry) -> str:
        return f"{self.repository(reg)}:{self.tag}"

    def read(self, api: "RegistryAPI") -> Remote | None:
        return api.manifest(self.image, self.tag, self.base or None)

    def engine_form(self, remote: Remote | None) -> bool:
        """Whether the registry holds this image there as the engine pushes it: its manifest on the
        containerd store; on the classic one its config, in layers not zstd."""
        if remote is None:
            return False
        if self.by_manifest:
            return remote.digest == self.image_id
        return remote.config == self.image_id and remote.form != "zstd"

    def same_image(self, remote: Remote | None) -> bool:
        """Whether the registry holds this image there, whatever its layers' compression."""
        return self.engine_form(remote) or bool(remote and self.config and remote.config == self.config)

    def holds(self, remote: Remote | None) -> bool:
        """Whether the registry holds there what this move puts there."""
        if remote is None:
            return False
        if self.follows is not None:
            return remote.digest == self.follows.digest
        if self.compression == "zstd":
            return bool(self.config) and remote.config == self.config and remote.form == "zstd"
        return self.engine_form(remote)

    @property
    def in_place(self) -> bool:
        """Nothing to push: an immutable tag holding this image in either compression (it never
        changes once pushed), or a moving tag holding what this move puts there."""
        return self.same_image(self.before) if self.immutable else self.holds(self.before)


def tested_id(c: docker.DockerClient, image: Image) -> str:
    """The local image ID of the row, refusing one never built or never tested."""
    ref = tags.own_ref(image)
    build_cmd = f"python build.py --torch {image.torch} --cuda {image.cuda}"
    try:
        image_id = c.images.get(ref).id
    except docker.errors.ImageNotFound:
        raise NotReady(f"{image.name} was never built here (no {ref}); build and test it first: {build_cmd}", ref=ref) from None
    assert image_id is not None  # docker-py types Model.id optional; an image the engine lists has one
    if tags.passed(image_id) is None:
        raise NotReady(f"{ref} ({image_id[:19]}) never passed its tests here; nothing pushed (run {build_cmd} or build.py test)", ref=ref)
    return image_id


def screen(c: docker.DockerClient, images: list[Image], results: Callable[[Image], Path], allowed: set[str]) -> None:
    """Refuse before the registry is contacted: a row never tested here, or one whose
    vulnerabilities.json lists a critical advisory that `allowed` does not name, or one without
    the SBOM a push attaches beside it (a push that stopped there would leave its tags moved)."""
    for image in images:
        tested_id(c, image)  # the first question: a row never built says so, not that its report is missing
    security.gate({i.local_name: results(i) / security.REPORT for i in images}, allowed)
    for image in images:
        if not (results(image) / sbom.FILE).is_file():
            raise NotReady(f"{image.name}: no {results(image) / sbom.FILE}, the SBOM a push attaches beside the image; "
                             f"nothing pushed (the build writes it: python build.py --torch {image.torch} --cuda {image.cuda})", ref=results(image) / sbom.FILE)


def dated_tag(image: Image, labels: dict[str, str] | None, ref: str) -> str:
    """The row's immutable tag, e.g. 2.7.1-cuda12.1-runtime-20261122-7904bf67.

    From the image's labels, not this checkout or the clock: the day (UTC) of the
    commit it was built from, and the first 8 hex of the hash of its lock files.
    """
    labels = labels or {}
    rebuild = f"rebuild it (python build.py --torch {image.torch} --cuda {image.cuda})"
    created, lock = labels.get(CREATED_LABEL, ""), labels.get(LOCK_LABEL, "")
    if not _LOCK_HASH.match(lock):
        raise ImageUnfit(f"{ref} has no valid label {LOCK_LABEL} ({lock!r}), so no immutable tag can name its lock; {rebuild}", ref=ref)
    try:
        when = dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        raise ImageUnfit(f"{ref} has no valid label {CREATED_LABEL} ({created!r}), so no immutable tag can date it; {rebuild}", ref=ref) from None
    when = when.replace(tzinfo=dt.timezone.utc) if when.tzinfo is None else when.astimezone(dt.timezone.utc)
    if when.timestamp() <= 0:  # the build found no commit time: the date would say nothing
        raise ImageUnfit(f"{ref} was built without a commit time ({CREATED_LABEL}={created}); {rebuild} from a git checkout", ref=ref)
    return f"{image.name}-{when:%Y%m%d}-{lock[:8]}"


def base_move(c: docker.DockerClient, image: Image, image_id: str, by_manifest: bool) -> Move | None:
    """The move that publishes the base a row was built on, None for a registry base (pinned by
    digest already). Its tag is the local rootfs tag and the first 12 hex of the base's ID,
    which the row's BASE_LABEL holds, so one published image names the base to pull."""
    if image.os.kind == "registry":
        return None
    base_id = (c.images.get(image_id).labels or {}).get(BASE_LABEL, "")
    ref = image.refs()[0]
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", base_id):
        raise ImageUnfit(f"{ref} has no valid label {BASE_LABEL} ({base_id!r}), so its base cannot be published; "
                         f"rebuild it (python build.py --torch {image.torch} --cuda {image.cuda})", ref=ref)
    try:
        c.images.get(base_id)
    except docker.errors.ImageNotFound:
        raise ImageUnfit(f"the base {ref} was built on ({base_id[:19]}) is no longer in this engine's store, and a "
                         f"rebuild elsewhere needs it; rebuild the row (python build.py --torch {image.torch} --cuda {image.cuda})", ref=ref) from None
    repository, tag = render.base_ref(image).split(":", 1)
    return Move(image, base_id, f"{tag}-{base_id.removeprefix('sha256:')[:12]}", True, by_manifest=by_manifest, base=repository)


def plan(c: docker.DockerClient, api: RegistryAPI, images: list[Image], retry: Retry,
         compression: str = "gzip") -> list[Move]:
    """The bases first, then immutable tags of every row, then the moving ones; each with where it is now.

    An immutable tag that the registry holds at another image is refused here, for every
    row at once, before anything is pushed. (A registry has no compare-and-set: a push
    by someone else between this read and ours is caught by execute's read-back.)
    """
    ids = {i.name: tested_id(c, i) for i in images}
    dated = {i.name: dated_tag(i, c.images.get(ids[i.name]).labels, i.refs()[0]) for i in images}
    for first in {i.repository: i for i in images}.values():  # one read per repository published to
        retry(lambda: api.ping(first), "contacting the registry")
    by_manifest = docker_env.image_store(c) == "containerd"
    bases = {mv.target(api.reg): mv for i in images if (mv := base_move(c, i, ids[i.name], by_manifest))}
    moves = list(bases.values())  # rows that share a base push it once (as the engine holds it: see the module)
    moves += [Move(i, ids[i.name], dated[i.name], True, by_manifest=by_manifest, compression=compression) for i in images]
    moves += [Move(i, ids[i.name], t, False, by_manifest=by_manifest, compression=compression) for i in images for t in i.tags]
    for mv in moves:
        mv.before = retry(lambda: mv.read(api), f"reading {mv.target(api.reg)}")
    learn_configs(c, moves, retry)
    taken = [TagTaken(mv.target(api.reg), mv.before.digest, mv.before.config, mv.image_id)
             for mv in moves if mv.immutable and mv.before is not None and not mv.in_place]
    if taken:
        raise ImmutableTagTaken(taken)
    _follow(moves)
    return moves


def learn_configs(c: docker.DockerClient, moves: list[Move], retry: Retry) -> None:
    """The config digest of each image whose immutable tag holds a manifest other than the
    engine's: that image in the other compression, or another image. Read from the engine only
    then (zstd.config_digest streams part of the image's export)."""
    for mv in moves:
        if mv.immutable and mv.before is not None and not mv.config and not mv.engine_form(mv.before):
            config = retry(lambda: zstd.config_digest(c, mv.image_id), f"reading {mv.image_id[:19]}'s manifest from the engine")
            for other in moves:
                if other.image_id == mv.image_id:
                    other.config = config


def _follow(moves: list[Move]) -> None:
    """Each moving tag of a row whose dated tag holds the image in another form than the engine
    pushes (zstd), or will: it gets that manifest, so that every tag of the row names one."""
    dated = {mv.image.name: mv for mv in moves if mv.immutable and not mv.base}
    for mv in moves:
        first = dated.get(mv.image.name)
        if mv.immutable or first is None:
            continue
        now = first.after or (first.before if first.in_place else None)
        if now is not None and (mv.compression == "zstd" or not first.engine_form(now)):
            mv.follows = now


def describe(mv: Move, reg: Registry, now: Remote | None, unknown: str = "") -> str:
    if unknown:
        state = f"unknown ({unknown})"
    elif now is None:
        state = "absent"
    elif mv.same_image(now):
        state = f"at this image ({now.digest}{', zstd' if now.form == 'zstd' else ''})"
    else:
        state = f"at another image ({now.digest}, config {now.config})"
    return f"{mv.target(reg)}: {state}"


def where(api: RegistryAPI, moves: list[Move]) -> list[str]:
    """Where every tag of the run is now, read from the registry (one try each)."""
    out = []
    for mv in moves:
        try:
            out.append(describe(mv, api.reg, mv.read(api)))
        except (Transient, RegistryRefused, PublishError) as e:
            out.append(describe(mv, api.reg, None, unknown=str(e)))
    return out


# What a push the daemon dropped leaves: the tags pushed before it, each read back (the lines after).
PUSH_LEFT = "the tags pushed before it name tested images (below)"


def push_one(c: docker.DockerClient, mv: Move, reg: Registry, creds: dict | None) -> str:
    """Tag locally under the registry's name, push, untag; return the pushed digest."""
    repo = mv.repository(reg)
    c.images.get(mv.image_id).tag(repo, mv.tag)
    try:
        digest = None
        try:
            for ev in c.api.push(repo, tag=mv.tag, stream=True, decode=True, auth_config=creds):
                err = ev.get("error") or (ev.get("errorDetail") or {}).get("message")
                if err:
                    raise (PublishError if _PERMANENT.search(err) else Transient)(err)
                # Docker 20.10 sends it as aux; 26 on the containerd store only in the status line
                said = _PUSHED_DIGEST.search(ev.get("status") or "")
                digest = (ev.get("aux") or {}).get("Digest") or (said.group(1) if said else digest)
        except docker_env.TRANSPORT as e:  # a reply cut short (the daemon dying mid-push) included
            raise Transient(str(docker_env.failure(f"the push of {repo}:{mv.tag}", e, PUSH_LEFT))) from None
        if not digest and mv.by_manifest:
            digest = mv.image_id  # that store pushes the manifest it holds; the read-back checks it
        if not digest:
            raise Transient("the daemon reported no digest")
        return digest
    finally:
        try:
            c.images.remove(f"{repo}:{mv.tag}", noprune=True)
        except docker_env.TRANSPORT:
            pass  # a local name for the push only, given again by the next; never mask why we are leaving


def execute(c: docker.DockerClient, api: RegistryAPI, moves: list[Move], creds: dict | None,
            retry: Retry, log: Callable[[str], None]) -> None:
    reg = api.reg
    followed = False
    for mv in moves:
        if not mv.immutable and not followed:  # every immutable tag is in place and read back by now
            _follow(moves)
            followed = True
        if mv.in_place:
            assert mv.before is not None  # in place: the registry holds it
            mv.after = mv.before
            form = f", {mv.before.form}" if mv.before.form == "zstd" or mv.compression == "zstd" else ""
            log(f"{mv.target(reg)} already at this image ({mv.before.digest}{form}); skipped")
            continue
        if mv.follows:
            log(f"copying {mv.follows.digest} (the row's dated tag's manifest) to {mv.target(reg)}")
        else:
            log(f"pushing {mv.target(reg)} ({mv.image_id[:19]}{', zstd' if mv.compression == 'zstd' else ''})")
        try:
            pushed = _push(c, api, mv, creds, retry, log)
            mv.after = retry(lambda: mv.read(api), f"reading back {mv.target(reg)}")
        except (Transient, PublishError) as e:
            raise PublishError(f"{mv.target(reg)}: {e}") from None
        for other in moves:  # a zstd push read the config from the image's manifest
            other.config = other.config or (mv.config if other.image_id == mv.image_id else "")
        if mv.after is None or mv.after.digest != pushed or not mv.holds(mv.after):
            raise PublishError(f"read-back of {mv.target(reg)} does not match the push: pushed {pushed} of {mv.image_id}"
                               f"{' (zstd, config ' + mv.config + ')' if mv.compression == 'zstd' and not mv.follows else ''}, "
                               f"registry has {mv.after}")


def _push(c: docker.DockerClient, api: RegistryAPI, mv: Move, creds: dict | None, retry: Retry,
          log: Callable[[str], None]) -> str:
    """The move's manifest to its tag: copied from the dated tag, the image's zstd form from a
    scratch layout, or the engine's push; the digest the registry must now serve there."""
    target = mv.target(api.reg)
    follows = mv.follows
    if follows is not None:
        retry(lambda: api.retag(mv.name, follows.digest, mv.tag), f"copying {follows.digest} to {target}")
        return follows.digest
    if mv.compression == "zstd":
        # About the image's compressed size, in $TMPDIR, for as long as the push takes.
        with tempfile.TemporaryDirectory(prefix="pytorch-cuda-zstd-") as tmp:
            log(f"writing the zstd form of {mv.image_id[:19]} (level {zstd.LEVEL}) in {tmp}")
            layout = retry(lambda: zstd.write_layout(c, mv.image_id, Path(tmp)), f"reading {mv.image_id[:19]} from the engine")
            mv.config = layout.config
            retry(lambda: api.push_layout(layout.path, zstd.REF_NAME, mv.name, mv.tag), f"pushing {target}")
        return layout.digest
    return retry(lambda: push_one(c, mv, api.reg, creds), f"pushing {target}")


def publish(c: docker.DockerClient, images: list[Image], reg: Registry, *, push: bool, ca_bundle: str | None,
            attempts: int, backoff: float, log: Callable[[str], None], compression: str = "gzip") -> list[Move]:
    creds = credentials(reg)
    api = RegistryAPI(reg, creds, ca_bundle)
    retry = retrying(attempts, backoff, log)
    try:
        moves = plan(c, api, images, retry, compression)
    except Transient as e:
        raise EnvironmentProblem(f"{e}; nothing pushed") from None
    if not push:
        return moves
    try:
        execute(c, api, moves, creds, retry, log)
    except (Transient, PublishError) as e:
        raise PublishError(f"publish to {reg} stopped at {e}; nothing after it was pushed. Tags now:", where(api, moves)) from None
    except KeyboardInterrupt:
        log("interrupted; tags now: " + "; ".join(where(api, moves)))
        raise
    return moves


def registry(address: str | None, retries: int) -> Registry:
    """The --registry and --retries of a command, checked before anything is built or pushed."""
    if not address:
        raise BadValue("no registry: pass --registry HOST[:PORT]/NAMESPACE or set PYTORCH_CUDA_REGISTRY", name="--registry")
    if retries < 1:
        raise BadValue(f"--retries must be at least 1, not {retries}", name="--retries")
    return Registry.parse(address)


def table(moves: list[Move], reg: Registry, push: bool) -> list[str]:
    """Where each tag is now (pushed) or would go (dry run), one line per tag."""
    rows = [("TAG", "NOW", "ACTION")]
    for mv in moves:
        now = mv.after if push else mv.before
        rows.append((mv.target(reg), now.digest if now else "absent", action(mv, push)))
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    if not push:
        return lines + ["dry run: nothing pushed; add --push to publish"]
    bases = [f"base for rebuilds: {mv.repository(reg)}@{mv.after.digest}" for mv in moves if mv.base and mv.after]
    note = [ZSTD_NOTE] if any(mv.after and mv.after.form == "zstd" for mv in moves) else []
    return lines + [f"pull by digest: {reg.repository(image)}@{digest}" for image, digest in pushed(moves)] + bases + note


# What a tag in zstd asks of whoever pulls it (docs/publishing.md#zstd).
ZSTD_NOTE = "zstd layers: Docker >= 23 and containerd >= 1.5 pull them, Docker 20.10 cannot"


def action(mv: Move, push: bool) -> str:
    """What happened to the tag (or would), with its layers' compression where it is zstd or the run asked for zstd."""
    now = mv.after if push else mv.before
    if mv.in_place:
        assert now is not None  # in place: the registry holds it (before; after, once pushed)
        action, form = "already there", now.form
    elif push:
        action, form = "pushed, verified", now.form if now else mv.compression
    else:
        action, form = "would push", mv.follows.form if mv.follows else mv.compression
    return action if mv.compression == "gzip" and form != "zstd" else f"{action} ({form})"


def pushed(moves: list[Move]) -> list[tuple[Image, str]]:
    """Each published row with the digest to pull it by, in the order of the moves."""
    out: dict[str, tuple[Image, str]] = {}
    for mv in moves:
        if not mv.base:
            out.setdefault(mv.image.name, (mv.image, mv.after.digest if mv.after else ""))
    return list(out.values())


def write_record(results: Path, reg: Registry, image: Image, moves: list[Move]) -> None:
    """build-results/<image>/published.json: where the row went and the digest to pull it by,
    and where the base it was built on went (no "base" for a registry base)."""
    mine = [mv for mv in moves if mv.image is image and not mv.base]
    assert mine[0].after is not None  # a record is written after the push
    record: dict = {"registry": str(reg), "repository": reg.repository(image), "image_id": mine[0].image_id,
                    "digest": mine[0].after.digest, "tags": [mv.tag for mv in mine],
                    "compression": mine[0].after.form}
    # rows that share a base share one move, made for the first of them
    base = next((mv for mv in moves if mv.base and mv.after and render.base_ref(mv.image) == render.base_ref(image)), None)
    if base is not None:
        assert base.after is not None  # the filter above
        record["base"] = {"image_id": base.image_id, "repository": base.repository(reg), "tag": base.tag,
                          "digest": base.after.digest}
    write_atomic(results / "published.json", json.dumps(record, indent=2) + "\n")


def lock_files_sha256(root: Path, image: Image) -> str:
    """The row's lock hash, as its images' LOCK_LABEL carries it."""
    return lock.read(root, image)["files_sha256"]
