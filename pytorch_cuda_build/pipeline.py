"""The pipeline of the README's diagram, for one row.

`build_row`, after the engine check, with the stages numbered as in stages/__init__.py's STAGES
(1 lock and 2 render write committed files; check_inputs refuses a row whose files are stale):

    3 fetch (every locked file into the store) -> 4 base -> 5 build (BuildKit, no network)
    -> 6 gate (smoke + structure tests, the pass recorded) -> 7 sbom -> 8 security -> 9 tag
    -> 10 publish (with --push)

Each stage is a call into the module named after it; this module only orders them, times them
and tells the console.

Many rows: scheduler.py, which runs this pipeline once per row, each in its own process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import docker
import docker.errors
from filelock import FileLock, Timeout

from pytorch_cuda_runtime.lockfile import Input

from . import ca, files, paths, rules, spec
from .buildkit import provenance
from .console import Quiet
from .engine import docker_env
from .errors import BadValue, NoSuchRow, NotReady, PipelineError
from .matrix import Image, Matrix
from .registry import attach, retry, sign, zstd
from .registry import client as registry
from .registry.client import Registry
from .stages import base, build, fetch, gate, lock, publish, publish_index, render, sbom, security, tag

results_dir = paths.results_dir

# Each stage of a row as a line names it when the daemon is lost in it, and what it leaves as it
# was then (docker_env.calls): before the tag stage no tag has moved; the tag stage moves local
# tags to the tested image only; publish pushes tested images only, immutable tags first.
STAGE_WORDS = {"engine": "the engine check", "base": "the base", "build": "the build", "test": "the gate",
               "sbom": "the SBOM", "tag": "the tag", "publish": "the publish"}
TAGS_TESTED = "the tags moved so far name the tested image, none an untested one"
PUSHED_TESTED = "every tag the registry holds names a tested image; the same command finishes the push"
LEFT = {"tag": TAGS_TESTED, "publish": PUSHED_TESTED}



# The options a row's run takes, declared once (spec.py): build's and publish's options classes
# (arguments.py) derive from them, so the pipeline gets the command's own options object, with what
# its handler found added (`found`): the CA bundle's path and, to publish, the parsed registry.

COMPRESSIONS = ("gzip", "zstd")  # publish's layer compression (registry/zstd.py)
ATTACHED_INPUTS = ("debian", "all", "none")  # the locked files publish attaches beside an image (registry/attach.py)
P = TypeVar("P", bound="Publishing")


def _registry() -> Any:
    return spec.opt(None, "HOST[:PORT]/NAMESPACE (default: $PYTORCH_CUDA_REGISTRY)", env="PYTORCH_CUDA_REGISTRY")


@dataclass(frozen=True)
class Publishing(spec.Rows):
    """What publishing rows takes: the registry, its calls' attempts, the advisories let past, the
    layers' compression, the CA."""

    registry: str | None = _registry()
    push: bool = spec.flag("push for real; without it, print what would move")
    retries: int = spec.opt(4, "attempts per registry call (default 4, exponential backoff)", type=spec.positive_int, later=True)
    allow_vulnerable: tuple[str, ...] = spec.many(
        "publish despite this critical advisory of vulnerabilities.json (its ID or an alias); repeatable", metavar="ID",
        check=rules.form(r"[A-Za-z0-9][\w.:-]*", "an advisory ID (e.g. GHSA-xxxx-xxxx-xxxx, PYSEC-2024-1)"))
    compression: str = spec.opt("gzip", "the pushed layers: gzip (default: as the engine holds them; every Docker pulls them) or zstd "
                                        "(the containerd image store; Docker >= 23 and containerd >= 1.5 pull them, Docker 20.10 cannot)",
                                choices=COMPRESSIONS, later=True)
    attach_inputs: str = spec.opt("debian", "the locked files attached beside each pushed image, for a rebuild whose sources are gone: "
                                            "debian (default: the .debs and indexes, which Debian's mirror drops), all (the wheels and "
                                            "sdists too), none", choices=ATTACHED_INPUTS, later=True)
    ca_bundle: str | None = spec.ca_bundle("CA bundle for an HTTPS registry (default: pip's configured cert)")
    # What the handler found (`found`), never options: the CA bundle's path, the registry to publish to.
    ca_path: str | None = None
    push_to: Registry | None = None

    def found(self: P, publish_to: bool) -> P:
        """These options with the CA bundle found and, where publish_to, the registry parsed (its form validated)."""
        return dataclasses.replace(self, ca_path=ca.ca_bundle(self.ca_bundle),
                                   push_to=publish.registry(self.registry, self.retries) if publish_to else None)

    def check_registry(self, c: rules.Checks) -> None:
        """The registry's address of the right form, and the retries' wait readable: no network. Its form
        does not depend on --retries: checked even where --retries was refused."""
        retries = (self.retries if c.ok("retries") else None) or Publishing.retries
        c.run(("registry", "push"), lambda: publish.registry(self.registry, retries))
        c.run(("push",), retry.retry_backoff)


CACHE_SPEC = r"type=[a-z]+(,.*)?"  # buildx's --cache-from/--cache-to: type=...,key=value


def _cache_spec(name: str, text: str) -> None:
    if not re.fullmatch(CACHE_SPEC, text):
        raise BadValue(f"{name} {text!r} is not buildx's type=...,key=value form (e.g. type=registry,ref=HOST/NS/pytorch-cuda-cache:{{image}})",
                       name=name)


def _cache(help: str) -> Any:
    return spec.many(help, metavar="SPEC", check=_cache_spec)


@dataclass(frozen=True)
class Options(Publishing):
    """What a row's run takes: publishing's options, and the build's and the gate's."""

    docker: str | None = spec.docker()
    no_test: bool = spec.flag("build only; sets no public tag")
    retest: bool = spec.flag("test even if this image ID already passed")
    no_cache: bool = spec.flag("build without the layer cache")
    require_gpu: bool = spec.flag("fail instead of testing on the CPU when no GPU runtime exists")
    # BuildKit cache imports and exports (buildx syntax; {image} is the row's name), for CI
    # runners that start cold: type=registry,ref=HOST/NS/pytorch-cuda-cache:{image}
    cache_from: tuple[str, ...] = _cache("import BuildKit's cache (buildx; e.g. type=registry,ref=HOST/NS/pytorch-cuda-cache:{image}); "
                                         "repeatable")
    cache_to: tuple[str, ...] = _cache("export BuildKit's cache (buildx on the containerd store; add mode=max for every stage); repeatable")

    def cache_args(self, image: Image) -> list[str]:
        return [a for flag, specs in (("--cache-from", self.cache_from), ("--cache-to", self.cache_to))
                for spec in specs for a in (flag, spec.replace("{image}", image.local_name))]


@dataclass
class RowResult:
    """What one row's run came to: the scheduler's typed answer from each worker."""

    image: str
    ok: bool
    exit_code: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    size_bytes: int = 0
    image_id: str = ""
    base_id: str = ""
    error: list[str] = field(default_factory=list)
    moves: list = field(default_factory=list, repr=False)  # publish.Move, in this process only

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def to_json(self) -> str:
        d = asdict(self)
        del d["moves"]
        return json.dumps(d, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RowResult:
        d = json.loads(text)
        return cls(**{k: d[k] for k in ("image", "ok", "exit_code", "seconds", "tags", "size_bytes", "image_id", "base_id", "error") if k in d})


def preflight(opts: Options, log: Callable[[str], None]) -> None:
    """What the engine must offer for these options, checked before an hour of building: buildx
    for a cache import or export, and the containerd store for zstd layers."""
    if opts.cache_from or opts.cache_to:
        build.check_cache_options(docker_env.build_client(opts.docker), opts.cache_from, opts.cache_to)
    if opts.push_to and opts.compression == "zstd":
        zstd.check_engine(docker_env.ensure_engine(log))


def check_inputs(root: Path, m: Matrix, images: list[Image]) -> None:
    """Locks and rendered files current: a stale row is refused before anything is built."""
    lock.check(root, images)
    render.check(root, m, images)


# ---- one row -------------------------------------------------------------------


def platforms(image: Image, wanted: str | None) -> list[Image]:
    """The row on each platform `--platform` names: this host's by default; `all`: every platform
    the row lists, this host's first (its build is the quick one, and a failure shows soonest)."""
    host = docker_env.host_platform()
    names = sorted(image.platforms, key=lambda p: p != host) if wanted == "all" else [wanted or host]
    for p in names:
        if p not in image.platforms:
            why = (" (linux/arm64 needs torch's aarch64 CUDA wheels: on PyPI from 2.11 on)" if p == "linux/arm64" else "")
            raise NoSuchRow(f"{image.name} is locked for {', '.join(image.platforms)} only, not {p}{why}; "
                             f"matrix.yaml's `platforms:` lists a row's platforms", name="--platform")
    return [image.on(p) for p in names]


def build_platforms(root: Path, images: list[Image], opts: Options, console: Quiet) -> list[RowResult]:
    """One row on one or more platforms. With several, each is built and tested first and no
    tag moves until every one has passed; then the others' tags move, this host's last, so
    that on a store that keeps one platform per tag, the tag names what this host runs."""
    proven = [build_row(root, image, opts, console, hold_tags=True) for image in images]
    c = docker_env.ensure_engine(console.log)
    for image, result in reversed(list(zip(images, proven))):
        _Row(root, image, opts, console, result).promote(c, publish=False)
    if opts.push_to:  # one index of every platform, not one push each
        backoff = retry.retry_backoff()
        with docker_env.calls(STAGE_WORDS["publish"], PUSHED_TESTED):
            for line in publish_index.publish_index(c, images[0].on("linux/amd64"), opts.push_to, push=True, ca_bundle=opts.ca_path,
                                                    attempts=opts.retries, backoff=backoff, log=console.log, compression=opts.compression):
                console.log(line)
    return proven


def build_row(root: Path, image: Image, opts: Options, console: Quiet, hold_tags: bool = False) -> RowResult:
    """The row's pipeline: its engine first, so a daemon that does not answer fails at once with
    its own error rather than after waiting on another build; then the rest under two locks. Two
    runs of one row from this checkout would write one build-results/<row>; two on one daemon
    would race on its candidate tag. Runs on other daemons from other checkouts never wait."""
    row = _Row(root, image, opts, console)
    c, bc = row.engine()
    results = f"another build of {image.name} from this checkout is running (it writes {row.results}); waiting for it"
    tag = f"another build of {image.name} on the daemon at {docker_env.daemon_address()} is running; waiting for it"
    with _held(results_lock_path(root, image), results, console), \
            _held(row_lock_path(image, docker_env.daemon_key(c)), tag, console):
        return row.run(c, bc, hold_tags)


def row_lock_path(image: Image, daemon: str) -> Path:
    """The lock of a row's candidate tag on one daemon (docker_env.daemon_key)."""
    return paths.STATE_DIR / f"build-{image.local_name}-{daemon}.lock"


def results_lock_path(root: Path, image: Image) -> Path:
    """The lock of a row's results folder in one checkout."""
    where = hashlib.sha256(str(results_dir(root, image).resolve()).encode()).hexdigest()[:12]
    return paths.STATE_DIR / f"results-{image.local_name}-{where}.lock"


@contextlib.contextmanager
def _held(path: Path, waiting: str, console: Quiet) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    held = FileLock(str(path))
    try:
        held.acquire(timeout=1)
    except Timeout:
        console.log(waiting)
        held.acquire()
    try:
        yield
    finally:
        held.release()


class _Row:
    def __init__(self, root: Path, image: Image, opts: Options, console: Quiet, result: RowResult | None = None) -> None:
        self.root, self.image, self.opts, self.console = root, image, opts, console
        self.results = results_dir(root, image)
        self.result = result or RowResult(image.local_name, ok=False)

    @contextlib.contextmanager
    def stage(self, name: str, c: docker.DockerClient | None = None, docker: bool = True) -> Iterator[None]:
        """A stage, timed and shown. Where it calls Docker (docker), a daemon lost in it is one
        error naming it (docker_env.calls; c: the daemon to ask after a failed step)."""
        self.console.stage_start(name)
        t0 = time.monotonic()
        engine = docker_env.calls(STAGE_WORDS.get(name, name), LEFT.get(name, docker_env.NO_TAG_MOVED), c) if docker \
            else contextlib.nullcontext()
        try:
            with engine:
                yield
        finally:
            secs = time.monotonic() - t0
            self.result.seconds[name] = round(self.result.seconds.get(name, 0.0) + secs, 1)
            self.console.stage_end(name, secs)

    def engine(self) -> tuple[docker.DockerClient, docker_env.BuildClient]:
        """The daemon (it answers) and the client to build with; before any lock is waited on."""
        with self.stage("engine"):
            c = docker_env.ensure_engine(self.console.log)
            docker_env.ensure_emulation(self.image.platform, self.console.log)
            bc = docker_env.build_client(self.opts.docker)
            build.check_disk(docker_env.root_dir(c))
        return c, bc

    def run(self, c: docker.DockerClient, bc: docker_env.BuildClient, hold_tags: bool = False) -> RowResult:
        """Build, test, SBOM and vulnerabilities; then tags and publish, unless hold_tags (the
        caller moves them once every platform of the row has passed: promote)."""
        image, opts, log = self.image, self.opts, self.console.log
        self.results.mkdir(parents=True, exist_ok=True)
        with self.stage("fetch", docker=False):  # the network and the store, no daemon
            inputs = lock.build_inputs(self.root, image)
            fetch.fetch(inputs.all(), opts.ca_path, log, f"{image.name} ({image.platform})")
        with self.stage("base", c):
            base_id = base.ensure(c, image, self.results, log, docker_cli=bc.argv[0], root=self.root, inputs=inputs.base)
        image_id = self.build(c, bc, base_id)
        self.result.image_id = image_id
        if opts.no_test:
            log(f"built candidate {build.candidate_ref(image)} ({image_id[:19]}); --no-test: no public tag set")
            self.result.ok = True
            return self.result
        self.test(c, image_id)
        with self.stage("sbom", c):
            doc = sbom.generate(c, image_id)
            files.write_atomic(self.results / sbom.FILE, sbom.text(doc))
        with self.stage("vulnerabilities", docker=False):  # PyPI and Debian's index: their own errors
            report = security.record(self.root, image, security.sbom_debian(doc), opts.ca_path, log)
        if opts.push_to:  # before any tag moves: a refused image keeps its old tags everywhere
            security.refuse_critical(report, opts.allow_vulnerable)
        self.result.base_id = base_id
        self.result.ok = True
        return self.result if hold_tags else self.promote(c)

    def promote(self, c: docker.DockerClient, publish: bool = True) -> RowResult:
        image, opts, log = self.image, self.opts, self.console.log
        image_id = self.result.image_id
        with self.stage("tag", c):
            self.result.tags = tag.promote(c, image, image_id)
            c.images.remove(build.candidate_ref(image), noprune=True)
            self.result.size_bytes = c.images.get(image_id).attrs.get("Size", 0)
        self.write_summary(self.result.base_id)
        if opts.push_to and publish:
            with self.stage("publish", c):
                self.result.moves = publish_rows(c, [image], opts.push_to, True, opts.ca_path, opts.retries,
                                                 log, lambda i: results_dir(self.root, i), opts.compression)
                for line in after_push(self.result.moves, opts.push_to, opts.ca_path, lambda i: results_dir(self.root, i),
                                       inputs=attached_inputs(self.root, opts.attach_inputs)):
                    log(line)
        return self.result

    def build(self, c: docker.DockerClient, bc: docker_env.BuildClient, base_id: str) -> str:
        log_path = self.results / "build.log"
        self.console.log(f"building {self.image.name} for {self.image.platform}{' (emulated)' if docker_env.emulated(self.image.platform) else ''} "
                         f"with {bc.description} (log: {log_path})")
        if docker_env.emulated(self.image.platform) and self.image.extras_built:
            # Measured: its compiles alone ran past two hours under QEMU on 2 cores (docs/train.md).
            self.console.log("note: this flavor compiles Transformer Engine and the DeepSpeed ops under QEMU: more than three hours "
                             "on 2 cores; the GitHub workflow builds it on a native arm64 runner (docs/train.md)")
        with self.stage("build", c):  # a failed step after which the daemon is gone: the daemon went away
            return build.run(bc, self.root, self.image, log_path, self.opts.ca_path, self.opts.no_cache,
                             cache_args=self.opts.cache_args(self.image),
                             echo=self.console.build_sink(getattr(bc, "progress", "plain")), base_id=base_id,
                             results=self.results)

    def test(self, c: docker.DockerClient, image_id: str) -> None:
        code = gate.code_hash(self.root)  # hashed before the run: the record names the code that ran
        prior = None if self.opts.retest else tag.reusable_pass(image_id, self.opts.require_gpu, code)
        if prior:
            self.console.log(f"image {image_id[:19]} already passed its tests ({prior['mode']}) and the test code is "
                             "unchanged; not re-testing (--retest to force)")
            return
        with self.stage("test", c), following_smoke(c, image_id, self.console):
            report = gate.run(c, self.root, self.image, image_id, self.results, self.opts.require_gpu, self.console.log,
                              matrix_path=self.opts.matrix)
        tag.record_pass(self.image, image_id, report, code)

    def write_summary(self, base_id: str) -> None:
        r = self.result
        summary = {"image_id": r.image_id, "base_id": base_id, "tags": r.tags, "size_bytes": r.size_bytes, "seconds": dict(r.seconds)}
        (self.results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


@contextlib.contextmanager
def following_smoke(c: docker.DockerClient, image_id: str, console: Quiet) -> Iterator[None]:
    """Show the smoke container's steps as they finish. Display only: gate.run is the gate, and
    the daemon's errors here (the container gone before its logs were read, the daemon busy or
    lost: the gate's own calls say so) only end or skip a poll. Any other error is a bug of ours:
    it is raised in the caller's thread once the gate is over, never swallowed."""
    if not console.follows_smoke:
        yield
        return
    stop = threading.Event()
    broke: list[BaseException] = []

    def follow() -> None:
        filters: dict[str, str | list[str] | bool] = {"label": [f"{gate.RUN_LABEL}={gate.RUN_ID}", "pytorch-cuda.test=smoke"]}
        seen: set[str] = set()
        while not stop.is_set():
            try:
                for container in c.containers.list(filters=filters):
                    # list() inspects each container: the image ID is "Image" there ("ImageID" only in a sparse list)
                    if container.id not in seen and image_id in (container.attrs.get("Image"), container.attrs.get("ImageID")):
                        seen.add(str(container.id))
                        _stream_lines(container.logs(stream=True, follow=True), console.smoke, stop)
            except docker_env.TRANSPORT:
                pass  # display only: the gate's own calls meet the daemon's errors and name them
            except Exception as e:  # a bug of ours: handed to the caller's thread
                broke.append(e)
                return
            stop.wait(1.0)

    follower = threading.Thread(target=follow, name="smoke-follower", daemon=True)
    follower.start()
    try:
        yield
    finally:
        stop.set()
    follower.join(timeout=5)  # the gate passed: its container is gone, so the follower ends at once
    if broke:  # (an error of the gate's own went up instead, unmasked)
        raise broke[0]


def _stream_lines(chunks: Iterable[bytes | str], sink: Callable[[str], None], stop: threading.Event) -> None:
    pending = ""
    for chunk in chunks:
        pending += chunk.decode(errors="replace") if isinstance(chunk, bytes) else chunk
        *lines, pending = pending.split("\n")
        for line in lines:
            sink(line)
        if stop.is_set():
            return


def publish_rows(c: docker.DockerClient, images: list[Image], reg: registry.Registry, push: bool, ca_path: str | None, retries: int,
                 log: Callable[[str], None], results: Callable[[Image], Path], compression: str = "gzip") -> list[publish.Move]:
    """Publish tested rows; with push, record where each went in build-results/<image>/published.json."""
    backoff = retry.retry_backoff()
    moves = publish.publish(c, images, reg, push=push, ca_bundle=ca_path, attempts=retries, backoff=backoff, log=log,
                            compression=compression)
    if push:
        for image in images:
            publish.write_record(results(image), reg, image, moves)
    return moves


def attached_inputs(root: Path, which: str) -> Callable[[Image], list[Input]]:
    """The locked files `publish --attach-inputs` puts beside a row's image: debian (the .debs and
    the release index, which Debian's mirror drops), all (the wheels and sdists too), none."""
    def of(image: Image) -> list[Input]:
        if which == "none":
            return []
        files = lock.build_inputs(root, image).all()
        return files if which == "all" else [i for i in files if i.file.endswith(".deb") or "/dists/" in i.url]
    return of


def after_push(moves: list[publish.Move], reg: registry.Registry, ca_path: str | None, results: Callable[[Image], Path],
               sign_key: Path | None = None, signatures: Path | None = None,
               inputs: Callable[[Image], list[Input]] = lambda image: []) -> list[str]:
    """Beside each pushed row image (its dated tag): its SBOM, where the build kept it for that
    image BuildKit's provenance, and its locked files (inputs), as artifacts; and with sign_key its
    signature in the signatures lookaside directory. One line each, for the caller to show."""
    api = registry.RegistryAPI(reg, registry.credentials(reg), ca_path)
    where, lines = f"{reg.host}/{reg.namespace}", []
    for mv in (m for m in moves if m.immutable and not m.base and m.after):
        assert mv.after is not None  # the filter above
        files = inputs(mv.image)
        if files:
            store = fetch.store()
            lacking = store.missing(files)
            if lacking:  # published from another checkout's store, or a store cleaned since the build
                fetch.fetch(lacking, ca_path, lambda line: None, f"{mv.image.name}'s inputs", store)
            found = attach.attach_inputs(api, mv.image.repository, mv.after.digest, files, lambda i: store.blob(i.sha256))
            lines.append(f"inputs {found} attached to {where}/{mv.image.repository}@{mv.after.digest}: {len(files)} files, "
                         f"{fetch.size_text(sum(i.size for i in files))} (:{attach.fallback_tag(mv.after.digest)}{attach.INPUTS.tag_suffix})")
        found = attach.attach_sbom(api, mv.image.repository, mv.after.digest, results(mv.image) / sbom.FILE)
        lines.append(f"SBOM {found} attached to {where}/{mv.image.repository}@{mv.after.digest} "
                     f"(referrers fallback :{attach.fallback_tag(mv.after.digest)})")
        statement = provenance.kept(results(mv.image), mv.after.digest)
        if statement is None:
            lines.append(f"no provenance for {where}/{mv.image.repository}@{mv.after.digest}: its build wrote none for this "
                         "manifest (Docker 20.10's BuildKit writes none; build on a current engine: build.py engine)")
        else:
            kind = attach.provenance_kind(json.loads(statement)["predicateType"])
            found = attach.attach(api, mv.image.repository, mv.after.digest, statement, kind)
            lines.append(f"provenance {found} attached to {where}/{mv.image.repository}@{mv.after.digest} "
                         f"(:{attach.fallback_tag(mv.after.digest)}{kind.tag_suffix})")
        if sign_key is not None:
            assert signatures is not None  # given with sign_key (cli: build-results/signatures by default)
            path = sign.sign(api, mv.image.repository, mv.after.digest, mv.tag, sign_key, signatures)
            lines.append(f"signed {where}/{mv.image.repository}@{mv.after.digest} as :{mv.tag}: {path} "
                         f"(serve {signatures} as the registry's lookaside)")
    return lines


def publish_command(root: Path, images: list[Image], opts: Publishing, push: bool, platform: str | None, merge: bool,
                    sign_key: Path | None, signatures: Path, log: Callable[[str], None]) -> Iterator[str]:
    """`build.py publish`, its lines as they come. A row on one platform: its image under its
    tags. A row on several: one index under its tags, of the images here (platform `all`) or of
    the parts in the registry (merge); or, by default, this host's part only (CI's per-platform builds)."""
    assert opts.push_to is not None  # publish always has one: validated
    reg = opts.push_to
    several = [i for i in images if len(i.platforms) > 1]
    images = [i for i in images if len(i.platforms) == 1]
    backoff = retry.retry_backoff()
    common: dict[str, Any] = {"push": push, "ca_bundle": opts.ca_path, "attempts": opts.retries, "backoff": backoff, "log": log}
    if merge:  # the registry's parts alone: no daemon
        for row in several:
            yield "\n".join(publish_index.merge_index(root, row, reg, **common))
        return
    c = docker_env.ensure_engine(log)
    with docker_env.calls(STAGE_WORDS["publish"], PUSHED_TESTED, c):
        if opts.compression == "zstd":  # before the registry is contacted, or a row screened
            zstd.check_engine(c)
        common["compression"] = opts.compression
        allowed = set(opts.allow_vulnerable)
        for row in several:
            parts = [row.on(p) for p in row.platforms] if platform == "all" else platforms(row, None)
            publish.screen(c, parts, lambda i: results_dir(root, i), allowed)
            lines = (publish_index.publish_index(c, row, reg, **common) if platform == "all"
                     else publish_index.publish_part(c, parts[0], reg, **common))
            yield "\n".join(lines)
        if not images:
            return
        publish.screen(c, images, lambda i: results_dir(root, i), allowed)
        moves = publish_rows(c, images, reg, push, opts.ca_path, opts.retries, log, lambda i: results_dir(root, i), opts.compression)
    yield "\n".join(publish.table(moves, reg, push))
    if push:
        yield from after_push(moves, reg, opts.ca_path, lambda i: results_dir(root, i), sign_key, signatures,
                              attached_inputs(root, opts.attach_inputs))


def base_command(root: Path, m: Matrix, images: list[Image], docker: str | None, rebuild: bool, record: bool,
                 log: Callable[[str], None]) -> Iterator[str]:
    """`build.py base`: each platform's base built (or found, or built anew), described as it stands;
    with record, its identity written to every row that shares it (each file logged)."""
    for image in images:
        docker_env.ensure_emulation(image.platform, log)
        c, bc = docker_env.ensure_engine(log), docker_env.build_client(docker)
        results = results_dir(root, image)
        results.mkdir(parents=True, exist_ok=True)
        with docker_env.calls(STAGE_WORDS["base"], c=c):
            base.ensure(c, image, results, log, docker_cli=bc.argv[0], root=root, rebuild=rebuild)
            found = {**base.identity(c, render.base_ref(image), results), "store": docker_env.image_store(c)}
        yield base.describe(render.base_ref(image), found)
        if record:
            for path in base.record(root, m, image, found, build.source(root).revision):
                log(f"recorded in {path.relative_to(root)}")


def test_image(root: Path, image: Image, ref: str, require_gpu: bool, log: Callable[[str], None], matrix_path: Path | None = None) -> tuple[str, str]:
    """`build.py test`: the smoke and structure tests against any local image of the row,
    the pass recorded; its image ID and the mode it passed in (cpu or gpu)."""
    c = docker_env.ensure_engine(log)
    with docker_env.calls(STAGE_WORDS["test"], c=c):
        try:
            image_id = c.images.get(ref).id
        except docker.errors.ImageNotFound:
            raise NotReady(f"no image {ref} on this daemon; build it first (python build.py --torch {image.torch_minor} --cuda {image.cuda})",
                           ref=ref) from None
        assert image_id is not None  # docker-py types Model.id optional; an image the engine lists has one
        code = gate.code_hash(root)
        report = gate.run(c, root, image, image_id, results_dir(root, image), require_gpu, log, matrix_path=matrix_path)
    return image_id, tag.record_pass(image, image_id, report, code)


# ---- a child's result ----------------------------------------------------------


def recorded(path: Path | None, image: Image, run: Callable[[], RowResult]) -> RowResult:
    """Run one row and write its RowResult to path (for the scheduler that started this
    process), whatever happens; errors go on up to be printed once, by the CLI."""
    if path is None:
        return run()
    try:
        result = run()
    except PipelineError as e:
        files.write_atomic(path, RowResult(image.name, False, e.exit_code, error=e.lines()).to_json())
        raise
    except KeyboardInterrupt:
        files.write_atomic(path, RowResult(image.name, False, 130, error=["interrupted; no tag was moved"]).to_json())
        raise
    except Exception as e:
        files.write_atomic(path, RowResult(image.name, False, 1, error=[f"{type(e).__name__}: {e}"]).to_json())
        raise
    files.write_atomic(path, result.to_json())
    return result


