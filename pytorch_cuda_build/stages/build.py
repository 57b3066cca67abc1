"""Stage 5: build a candidate image with BuildKit, streaming the log.

The build context is staged from committed files only (the image's lock files and
manifest, and the in-image package), so nothing else in the checkout can leak into
an image or change a cache key, and from the host's store (inputs/: every file the lock
names, fetch.py), which is all the build reads: it runs with no network (`--network none`).
The context's folder is the same for every build of a row, so BuildKit sends only the files
that changed since the last one.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import docker
from filelock import FileLock

from .. import ca, paths, progress
from ..buildkit import layers, opsseed, provenance
from ..engine import docker_env
from ..engine.docker_env import BuildClient
from ..errors import BuildError, EnvironmentProblem
from ..matrix import Image
from ..paths import RUNTIME_PACKAGE
from . import fetch, lock, render

CONTEXT_FILES = ("requirements.lock", "deepspeed.lock", "toolkit.lock", "manifest.json")
PLATFORM_FILES = ("requirements.lock", "toolkit.lock", *lock.EXTRAS_FILES)  # a platform's own, from images/<image>/linux-arm64/
INPUTS = "inputs"  # the context's folder of locked files, which the Dockerfile's steps bind-mount
# Every row build runs its RUN steps with no network: all they read is in the context.
NETWORK = "none"
# A cold build of one row needs the torch layer twice over (layer + extraction) and
# its files in the store and in BuildKit's copy of the context; refuse early rather than fail half-way with a full disk.
MIN_FREE_BYTES = 25 * 1024**3


@dataclass(frozen=True)
class Source:
    """Which commit an image comes from, and its time (the created label)."""

    revision: str
    epoch: int

    @property
    def created(self) -> str:
        return dt.datetime.fromtimestamp(self.epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def source(root: Path) -> Source:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True).stdout.strip()

    rev = git("rev-parse", "HEAD") or "unknown"
    epoch = int(git("log", "-1", "--format=%ct") or 0)
    if rev != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        rev += "-dirty"
    return Source(rev, epoch)


def candidate_ref(image: Image) -> str:
    return f"{image.repository}-candidate:{image.local_name}"


def dockerfile(root: Path, image: Image) -> Path:
    return lock.build_dir(root, image) / "Dockerfile"


def stage_context(root: Path, image: Image, dest: Path, ca_bundle: str | None = None) -> None:
    """The lock files of image.platform (the platform's folder has its own wheels) and the row's
    DeepSpeed lock and manifest, under the names the Dockerfile copies."""
    for name in CONTEXT_FILES + (lock.EXTRAS_FILES if image.flavor == "train" else ()):
        src = lock.build_dir(root, image) if name in PLATFORM_FILES else lock.image_dir(root, image)
        if not (src / name).exists():
            where = src.relative_to(root) if src.is_relative_to(root) else src
            raise BuildError(f"staging the build context ({where}/{name} missing; run lock and render)", str(src))
        shutil.copy2(src / name, dest / name)
    shutil.copytree(
        root / RUNTIME_PACKAGE, dest / RUNTIME_PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "tests")
    )
    (dest / opsseed.CONTEXT_DIR).mkdir()  # empty unless a --no-cache build fills it (opsseed.stage)
    stage_inputs(root, image, dest / INPUTS, ca_bundle)


def input_folders(root: Path, image: Image) -> dict[str, list]:
    """Where each locked file goes under the context's inputs/, as the Dockerfile's steps mount
    them: one folder per step, and each wheel of a layer of its own alone (layers.py), so a
    step's cache key is the bytes of its own files."""
    ins = lock.build_inputs(root, image)
    d = lock.build_dir(root, image)
    layout = layers.plan(image, (d / "requirements.lock").read_text(), {n: w.as_json() for n, w in ins.wheels.items()})
    own = {layer.name for layer in layout.own}
    folders: dict[str, list] = {
        "apt": list(ins.apt), "build-debs": list(ins.build_debs), "toolkit": list(ins.toolkit), "sdists": list(ins.sdists),
        "wheels": [w for n, w in ins.wheels.items() if n in own], "rest": [w for n, w in ins.wheels.items() if n not in own]}
    if image.flavor == "train":
        extras = layers.plan(image, (d / "extras.lock").read_text(), {n: w.as_json() for n, w in ins.extras.items()})
        mine = {layer.name for layer in extras.own}
        folders.update({"extras": [w for n, w in ins.extras.items() if n in mine],
                        "extras-rest": [w for n, w in ins.extras.items() if n not in mine],
                        "extras-all": list(ins.extras.values()), "extras-build": list(ins.extras_sdists)})
    return folders


def stage_inputs(root: Path, image: Image, dest: Path, ca_bundle: str | None = None) -> None:
    """The row's locked files from the store into dest/<folder>/<file>, as hard links. The
    pipeline fetched them first; a caller that did not (verify, bench) gets them fetched here."""
    s = fetch.store()
    folders = input_folders(root, image)
    lacking = s.missing([i for items in folders.values() for i in items])
    if lacking:
        fetch.fetch(lacking, ca_bundle or ca.ca_bundle(None), lambda line: print(f"==> {line}", file=sys.stderr, flush=True),
                    f"{image.name} ({image.platform})", s)
    for folder, items in folders.items():
        (dest / folder).mkdir(parents=True, exist_ok=True)
        for item in items:
            s.stage(item, dest / folder / item.file)


def context_dir(image: Image, bc: BuildClient) -> Path:
    """The row's build context: one folder per daemon, row and platform, whichever checkout builds
    it, kept between builds. BuildKit keys its copy of a context by the folder's path and then
    sends only what changed; that copy holds every locked file (4.29 GB for the default row), so a
    folder per checkout would keep one such copy per checkout in the build cache. Builds of one
    row on one daemon take turns at it (context_lock). In the store's folder: its files are hard
    links to the store's, which only one filesystem allows; a store set apart on another disk
    ($PYTORCH_CUDA_STORE) beside contexts in the state directory would cost a copy of every file."""
    daemon = bc.env.get("DOCKER_HOST") or os.environ.get("DOCKER_HOST") or "default"
    where = hashlib.sha256(daemon.encode()).hexdigest()[:12]
    return paths.STORE_DIR / "contexts" / f"{image.local_name}-{where}"


def context_lock(context: Path) -> FileLock:
    """Held from staging the context to the end of the last build that reads it (the ops export):
    BuildKit reads a context when a step first needs it, not only at the start."""
    context.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(context) + ".lock")


def free_bytes(docker_root: str) -> tuple[int, Path]:
    """Free space where the engine keeps its data (the root filesystem if that is not visible here)."""
    probe = Path(docker_root) if Path(docker_root).exists() else Path("/")
    return shutil.disk_usage(probe).free, probe


def check_disk(docker_root: str) -> None:
    free, probe = free_bytes(docker_root)
    if free < MIN_FREE_BYTES:
        raise EnvironmentProblem(
            f"no disk space for a build: {free / 1024**3:.1f} GiB free under {probe}, need {MIN_FREE_BYTES // 1024**3} GiB; "
            # prune's default keeps 40GB of build cache, which alone can be what fills a small disk
            "free some (python build.py prune --keep-storage 5GB: the default keeps 40GB of build cache)"
        )


def command(bc: BuildClient, root: Path, image: Image, context: Path, iidfile: Path, src: Source,
            ca_bundle: str | None, no_cache: bool, tag: str | None = None, base_id: str | None = None,
            cache_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    cmd = [*bc.argv, f"--progress={getattr(bc, 'progress', progress.PLAIN)}", "--file", str(dockerfile(root, image)),
           *platform_args(image), "--target", image.flavor, "--iidfile", str(iidfile), "--tag", tag or candidate_ref(image),
           "--label", f"org.opencontainers.image.revision={src.revision}",
           "--label", f"org.opencontainers.image.created={src.created}"]
    if base_id:  # a locally built rootfs is identified by its recipe (in the lock) and this ID
        cmd += ["--label", f"org.opencontainers.image.base.digest={base_id}"]
    if no_cache:
        cmd += ["--no-cache"]
    cmd += list(cache_args)
    cmd += ["--network", NETWORK]
    if getattr(bc, "export", "load") == "oci":
        cmd += oci_export_args(lock.read(root, image)["files_sha256"], oci_tarball(iidfile))
    return cmd + [str(context)]


def oci_export_args(lock_sha256: str, tarball: Path) -> list[str]:
    """An OCI export with BuildKit's provenance, which load_oci takes apart from the image
    (provenance.py). The lock hash is given as a label here as well as in the Dockerfile (the same
    value: the config does not change) because provenance records the command line's labels only."""
    return [provenance.BUILD_FLAG, "--label", f"{render.LOCK_LABEL}={lock_sha256}",
            "--output", f"type=oci,dest={tarball},rewrite-timestamp=true"]


def platform_args(image: Image) -> list[str]:
    """--platform for another architecture than the host's; none for the host's own, whose
    builds stay as they were."""
    return ["--platform", image.platform] if docker_env.emulated(image.platform) else []


def export_command(bc: BuildClient, root: Path, image: Image, context: Path, dest: Path, ca_bundle: str | None,
                   cache_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The ops-dist stage to a host directory: every step is the build's, so all of them are cached."""
    cmd = [*bc.argv, "--progress=plain", "--file", str(dockerfile(root, image)), *platform_args(image),
           "--target", opsseed.TARGET, "--output", f"type=local,dest={dest}", "--network", NETWORK]
    args = list(cache_args)
    for i, a in enumerate(args[:-1]):
        if a == "--cache-from":  # never --cache-to: that would overwrite the row's exported cache
            cmd += [a, args[i + 1]]
    return cmd + [str(context)]


def export_ops(bc: BuildClient, root: Path, image: Image, context: Path, env: dict[str, str], ca_bundle: str | None,
               cache_args: list[str] | tuple[str, ...], log_path: Path) -> str:
    """Keep the image's compiled ops on the host (opsseed), for a later --no-cache build; the key."""
    dest = opsseed.export_dir()
    try:
        if _stream(export_command(bc, root, image, context, dest, ca_bundle, cache_args), env, log_path, False) != 0:
            # 20.10's BuildKit says so in the log; buildx on the containerd store only that its receiver
            # (this client, writing dest) gave up: then the disk under dest tells.
            if "no space left on device" in log_path.read_text(errors="replace").lower() or _no_room(dest):
                raise EnvironmentProblem(f"no space left on device exporting the compiled ops to {opsseed.store()} (log: {log_path}); "
                                         "free some there and run the same command again: no tag was moved")
            raise BuildError(f"exporting the compiled ops ({opsseed.TARGET}) to {opsseed.store()}", str(log_path), progress.log_tail(log_path))
        return opsseed.save(dest, image)
    finally:
        shutil.rmtree(dest, ignore_errors=True)


EXPORT_ROOM_BYTES = 64 * 1024**2


def _no_room(dest: Path) -> bool:
    where = dest if dest.exists() else opsseed.store()
    return where.exists() and shutil.disk_usage(where).free < EXPORT_ROOM_BYTES


def check_cache_options(bc: BuildClient, cache_from: tuple[str, ...], cache_to: tuple[str, ...]) -> None:
    """Cache import and export are buildx's; export also needs a builder that can write one: the
    containerd store, or a docker-container builder (the docker driver refuses it on the classic store)."""
    if (cache_from or cache_to) and bc.argv[1:2] != ("buildx",):
        raise EnvironmentProblem(f"--cache-from and --cache-to need buildx, and {bc.description} has none "
                         "(Docker 20.10's built-in BuildKit); use a current engine (python3 build.py engine)")
    if cache_to and getattr(bc, "export", "load") != "oci" and getattr(bc, "driver", None) in (None, "docker"):
        raise EnvironmentProblem(f"--cache-to needs the containerd image store or a docker-container builder ({bc.description} "
                         "uses the docker driver on the classic store, which cannot export a cache)")
    # Each spec's form was checked with the other arguments (validate.py), before this client was probed.


def oci_tarball(iidfile: Path) -> Path:
    """Where an "oci" export writes the image, beside the iidfile in the build's own temp dir."""
    return iidfile.with_name("image.oci.tar")


def run(bc: BuildClient, root: Path, image: Image, log_path: Path, ca_bundle: str | None,
        no_cache: bool = False, echo: bool | Callable[[str], None] = True, tag: str | None = None,
        base_id: str | None = None, cache_args: list[str] | tuple[str, ...] = (), ops_seed: bool = True,
        src: Source | None = None, results: Path | None = None) -> str:
    """Build the candidate; return its image ID. The log is kept in full; each line also goes
    to echo: a callable (a console), True (stderr, raw) or False (nowhere). A --no-cache build
    takes the host's ops seed unless ops_seed is False (then it compiles, as a fresh machine does).
    src: the commit the labels name (default: the checkout's now). results: where the row's
    provenance is kept (or an earlier build's removed, where this engine writes none)."""
    src = src or source(root)
    context = context_dir(image, bc)
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-build-") as tmp, context_lock(context):
        shutil.rmtree(context, ignore_errors=True)  # staged anew: nothing of another commit stays
        context.mkdir(parents=True)
        stage_context(root, image, context, ca_bundle)
        seeded = opsseed.stage(image, context, use=no_cache and ops_seed)
        iidfile = Path(tmp) / "iid"
        cmd = command(bc, root, image, context, iidfile, src, ca_bundle, no_cache, tag, base_id, cache_args)
        env = docker_env.build_env(bc)
        rc = _stream(cmd, env, log_path, echo)
        if rc != 0:
            raise BuildError(failed_step(log_path), str(log_path), progress.log_tail(log_path))
        if not seeded:  # a seeded build took the wheel the host has already
            export_ops(bc, root, image, context, env, ca_bundle, cache_args, log_path.with_name("ops-export.log"))
        if getattr(bc, "export", "load") == "oci":
            return load_oci(bc, oci_tarball(iidfile), tag or candidate_ref(image), log_path, results)
        if results is not None:
            provenance.forget(results)
        return iidfile.read_text().strip()


def load_oci(bc: BuildClient, tarball: Path, ref: str, log_path: Path, results: Path | None = None) -> str:
    """`docker load` an OCI export; the containerd store keeps its manifest, so the image ID
    is the digest the build wrote (and the one a push sends). An export with provenance is loaded
    as its image alone, and the provenance kept in results (provenance.py); none kept without results."""
    env = {**os.environ, **bc.env}
    parts = provenance.split(tarball)
    if parts is None:
        proc = subprocess.run([bc.argv[0], "load", "--input", str(tarball)], capture_output=True, text=True, env=env)
    else:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            loader = subprocess.Popen([bc.argv[0], "load"], stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)
            try:
                provenance.stream(tarball, parts.index_json, loader.stdin)  # type: ignore[arg-type]
            except BrokenPipeError:  # docker load stopped reading: its own error says why
                pass
            finally:
                loader.stdin.close()  # type: ignore[union-attr]
            loader.wait()
            out.seek(0), err.seek(0)
            proc = subprocess.CompletedProcess(loader.args, loader.returncode, out.read().decode(errors="replace"),
                                               err.read().decode(errors="replace"))
    with open(log_path, "a") as log:
        log.write(f"$ {bc.argv[0]} load --input {tarball.name}{' (its image alone, provenance kept apart)' if parts else ''}\n"
                  f"{proc.stdout}{proc.stderr}")
    if proc.returncode != 0:
        raise BuildError("loading the built image", str(log_path), (proc.stderr.strip().splitlines() or ["no output"])[-1])
    found = subprocess.run([bc.argv[0], "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True, env=env)
    if found.returncode != 0 or not found.stdout.strip():
        raise BuildError(f"loading the built image: {ref} is not in the daemon after `docker load`", str(log_path), found.stderr.strip())
    image_id = found.stdout.strip()
    if results is not None:
        provenance.keep(results, image_id, parts.statement if parts and parts.image == image_id else None)
    return image_id


def _stream(cmd: list[str], env: dict[str, str], log_path: Path, echo: bool | Callable[[str], None]) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    keep = log_path.with_name(log_path.stem + ".previous" + log_path.suffix)
    if log_path.exists() and built_something(log_path):  # a rebuild from the cache records no step times:
        log_path.replace(keep)                              # .previous keeps the last build that built
    with open(log_path, "w", buffering=1) as log:  # line-buffered: `tail -f build.log` follows the build
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, errors="replace")
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if callable(echo):
                    echo(line)
                elif echo:
                    sys.stderr.write(line)
            return proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def built_something(log_path: Path) -> bool:
    """Whether a saved build log ran a Dockerfile step (rather than taking every one from the cache)."""
    return any(not s["cached"] and s["cmd"].startswith(("RUN", "COPY", "ADD")) for s in progress.steps(log_path.read_text(errors="replace")))


def failed_step(log_path: Path) -> str:
    """The Dockerfile step BuildKit reported as failed, e.g. `[python-env 2/2] RUN ...`."""
    text = log_path.read_text(errors="replace")
    step = progress.failed_step(text)  # the vertex BuildKit marked ERROR
    if step:
        return f"step {step[:120]}"
    text = progress.readable(text)
    m = re.search(r"^\s*>\s*\[([^\]]+)\]\s*(.+?):?\s*$", text, re.M)  # BuildKit's error summary
    if m:
        return f"step [{m.group(1)}] {m.group(2)[:100]}"
    if "buildx component is missing" in text:
        return "starting BuildKit (this docker client needs the buildx plugin; use --docker)"
    return "docker build"


def prune(bc: BuildClient, c: docker.DockerClient, repository: str, keep_storage: str) -> int:
    """Remove the candidate tags and dangling images, bound the build cache; how many tags went."""
    removed = 0
    for img in c.images.list(name=f"{repository}-candidate"):
        for ref in img.tags:
            c.images.remove(ref, noprune=False)
            removed += 1
    c.images.prune(filters={"dangling": True})
    # Layer records and build-context copies only: BuildKit's LRU would otherwise also drop the
    # cache mounts (the compiled ops, TE's extension), and the next build runs nvcc again. Those
    # stay bounded by the matrix; docs/cli.md (prune) says how to empty them.
    for kind in ("regular", "source.local"):
        subprocess.run([bc.argv[0], "builder", "prune", "--force", "--keep-storage", keep_storage,
                        "--filter", f"type={kind}"],
                       env={**os.environ, **bc.env}, check=False, stdout=subprocess.DEVNULL)
    return removed


def prune_ops_seed(c: docker.DockerClient, rows: Iterable[str]) -> tuple[int, int]:
    """Drop the host's ops-seed entries no image names (how many, their bytes). An image names its
    entry while it is a row of the matrix (its next --no-cache build takes the entry, even with
    the image removed), or while an image tagged with its name is on the daemon (a row of another
    matrix, or of an older checkout; nothing in the image names the key, so its tag stands in)."""
    local = {ref.rsplit(":", 1)[1] for img in c.images.list() for ref in img.tags}
    return opsseed.prune(set(rows) | local)


class Timer:
    """Wall time per pipeline stage, for the summary."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}

    def __call__(self, name: str) -> Any:
        timer = self

        class _Span:
            def __enter__(self) -> None:
                self.t0 = time.monotonic()

            def __exit__(self, *exc: object) -> None:
                timer.stages[name] = timer.stages.get(name, 0.0) + time.monotonic() - self.t0

        return _Span()
