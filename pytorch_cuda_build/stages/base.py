"""Stage 4: the base of every image: a digest-pinned registry image, or a rootfs built locally.

Our build hosts reach no container registry, so the default matrix builds its Debian root
filesystem from the Debian mirror and loads it into Docker once, named after the recipe's hash
so a changed recipe never reuses an old base.

mmdebstrap reads the release's index and .debs that debs.lock names (step `index` and `base`)
from the host's store, through an HTTP proxy on 127.0.0.1 that answers for their addresses
(fetch.serving): apt asks for the same addresses as from the mirror, so the tree is the one the
mirror would give, and the mirror itself is never read (it may have moved, or be unreachable).

The rootfs is the same bytes wherever it is built, from the same recipe and locked files:
mmdebstrap with SOURCE_DATE_EPOCH writes a tarball with fixed file times and order, as root
(`--mode=root`, directly or through password-less sudo, as on a hosted runner) or as a user
without either (`--mode=unshare`, in the user's /etc/subuid range). This module then writes the
image around it itself: the tarball is the one layer, unchanged (its sha256 is the diff_id), and
the config is fixed bytes (creation time SOURCE_DATE_EPOCH), so `docker load` gives one image ID
on every engine: the config's digest on the classic store, the manifest's on containerd's.
`docker import` would stamp the time of the import, and BuildKit's `ADD` re-packs the tree.

What a built base was made from (mmdebstrap's own view of the suite's signed InRelease date) and
what it is (diff_id, image ID) go to build-results/<image>/base.json; `images/<image>/base.json`,
where committed, is the recorded identity a build compares against (docs/reproducibility.md).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import docker
import docker.errors
from filelock import FileLock

from pytorch_cuda_runtime.lockfile import Input

from .. import paths
from ..errors import BuildError, EnvironmentProblem, NotReady
from ..matrix import REPRODUCIBLE_EPOCH, Image, Matrix
from ..progress import log_tail
from . import fetch, lock, render

Inputs = tuple[Input, ...]

RECORD = "base.json"  # images/<image>/base.json: the identity recorded for a commit


def image_id(c: docker.DockerClient, ref: str) -> str | None:
    try:
        return c.images.get(ref).id
    except docker.errors.ImageNotFound:
        return None


def ensure(c: docker.DockerClient, image: Image, log_dir: Path, log: Callable[[str], None] = print, *, docker_cli: str,
           root: Path | None = None, rebuild: bool = False, inputs: Inputs | None = None) -> str:
    """The base image's ID, building the rootfs first if this machine lacks it from its locked
    files (inputs, in the store; by default the row's, fetched here), or, rebuild, anew in any
    case; docker_cli (the user's --docker) loads it. With the project's root, a local base is
    compared with the identity recorded for it, in one line of the log."""
    ref = render.base_ref(image)
    if inputs is None and image.os.kind != "registry":
        inputs = lock.build_inputs(root or paths.CHECKOUT, image).base
        fetch.fetch(list(inputs), None, log, f"the base of {image.name} ({image.platform})")  # Debian's mirror: HTTP, no CA
    inputs = inputs or ()
    found = None if rebuild else current(c, ref, inputs)
    if not found:
        if image.os.kind == "registry":
            raise EnvironmentProblem(f"base {ref} is not present locally; pull it first (docker pull {ref})")
        if not inputs:
            raise NotReady(f"base {ref} is not built here, and building it needs its locked files (python3 build.py fetch)", ref=ref)
        paths.STATE_DIR.mkdir(parents=True, exist_ok=True)
        with FileLock(str(paths.STATE_DIR / "rootfs.lock")):  # two builds never bootstrap at once
            found = (None if rebuild else current(c, ref, inputs)) or _rootfs(c, image, ref, log_dir, log, docker_cli, inputs)
    if root is not None and image.os.kind != "registry":
        log(f"base {ref}: {compare(identity(c, ref, log_dir), recorded(root, image))}")
    return found


def _made_from(ref: str) -> Path:
    """Where this machine records which locked files its local base `ref` was built from."""
    return paths.STATE_DIR / "rootfs" / (ref.replace("/", "_").replace(":", "_") + ".json")


def inputs_key(inputs: Inputs) -> str:
    return hashlib.sha256("".join(sorted(i.sha256 for i in inputs)).encode()).hexdigest()


def current(c: docker.DockerClient, ref: str, inputs: Inputs) -> str | None:
    """The local base's ID where it was built here from exactly these locked files (a relock after
    Debian's next point release names others under the same recipe); None where it must be built."""
    found = image_id(c, ref)
    if found is None or not inputs:
        return found
    try:
        made = json.loads(_made_from(ref).read_text())
    except (OSError, ValueError):
        return None
    return found if made.get("inputs") == inputs_key(inputs) and made.get("image_id") == found else None


def identity(c: docker.DockerClient, ref: str, log_dir: Path) -> dict:
    """What the local base is: its diff_id and ID, and the mirror state where this run built it."""
    attrs = c.images.get(ref).attrs
    layers = attrs.get("RootFS", {}).get("Layers") or []
    built = log_dir / RECORD
    made = json.loads(built.read_text()) if built.exists() else {}
    found = {"diff_id": layers[0] if len(layers) == 1 else None, "image_id": attrs["Id"]}
    return {**made, **found} if made.get("diff_id") == found["diff_id"] else found


def _rootfs(c: docker.DockerClient, image: Image, ref: str, log_dir: Path, log: Callable[[str], None], docker_cli: str,
            inputs: Inputs) -> str:
    root = as_root()
    if not shutil.which("mmdebstrap"):
        raise EnvironmentProblem(f"building base {ref} needs mmdebstrap (Debian: apt-get install mmdebstrap; a user "
                                 "with neither root nor password-less sudo also needs uidmap); or pin a registry base")
    found = _mmdebstrap(c, image, ref, log_dir, log, docker_cli, root, inputs)
    made = _made_from(ref)
    made.parent.mkdir(parents=True, exist_ok=True)
    made.write_text(json.dumps({"inputs": inputs_key(inputs), "image_id": found}) + "\n")
    return found


def as_root() -> list[str] | None:
    """The prefix that runs a command as root: none for root; `sudo -n` for a user with
    password-less sudo, as on GitHub's hosted runners (their user is not root); None for anyone else."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return None


# mmdebstrap's customize hook, outside the chroot ($1 is the tree): first the mirror state the
# tree was made from (each suite's signed InRelease date, into a file named by $STATE); then no
# apt lists, downloaded .debs or binary caches in the base, as in every later apt layer (the
# `partial` directories stay as apt made them, whatever the caller's umask); and not the host's
# /etc/hostname and /etc/resolv.conf, which mmdebstrap copies in as debootstrap does: they made
# the tree differ by machine, and put this host's name server into every image. Docker, Podman,
# enroot and Kubernetes mount both into each container.
HOOK = (
    'for f in "$1"/var/lib/apt/lists/*_InRelease; do '
    'printf "%s\\t%s\\n" "${f##*/}" "$(sed -n "s/^Date: //p" "$f" | head -n1)"; done > "$STATE"; '
    'find "$1"/var/lib/apt/lists "$1"/var/cache/apt/archives -mindepth 1 -maxdepth 1 ! -name partial -exec rm -rf {} +; '
    'rm -f "$1"/var/cache/apt/*.bin "$1"/etc/hostname "$1"/etc/resolv.conf'
)
# Merged /usr as debootstrap makes it (the symlinks and the usr-is-merged package), not through
# the usrmerge package, which pulls perl into the base (47 MB).
MERGED_USR = "/usr/share/mmdebstrap/hooks/merged-usr"


def mmdebstrap_command(image: Image, root: list[str] | None, proxy: str = "") -> list[str]:
    """The rootfs as a tarball on stdout (so the file is the caller's, whoever runs mmdebstrap);
    apt's downloads through proxy (the store's, fetch.serving) where given."""
    os_ = image.os
    assert os_.suite is not None and os_.mirror is not None, f"{image.name}: a debootstrap base needs a suite and a mirror (matrix.yaml)"
    mode = "unshare" if root is None else "root"
    # sudo drops the environment: SOURCE_DATE_EPOCH goes through `env`, as STATE and the proxy do.
    # apt reads http_proxy from its environment: nothing of it lands in the tree (an --aptopt would).
    env = ["env", f"SOURCE_DATE_EPOCH={REPRODUCIBLE_EPOCH}", *([f"http_proxy={proxy}", f"https_proxy={proxy}"] if proxy else [])]
    return [*(root or []), *env, "mmdebstrap", f"--mode={mode}", f"--arch={image.arch}", f"--variant={os_.variant}",
            "--skip=cleanup/apt/lists", "--skip=cleanup/apt/cache", f"--hook-dir={MERGED_USR}", f"--customize-hook={HOOK}",
            os_.suite, "-", os_.mirror]


def _mmdebstrap(c: docker.DockerClient, image: Image, ref: str, log_dir: Path, log: Callable[[str], None], docker_cli: str,
                root: list[str] | None, inputs: Inputs) -> str:
    os_ = image.os
    log_path = log_dir / "rootfs.log"
    how = "as root" if root == [] else "through sudo" if root else "without root, in a user namespace"
    log(f"building base {ref}: mmdebstrap --arch={image.arch} --variant={os_.variant} {os_.suite} {os_.mirror}, its "
        f"{len(inputs)} locked files from the store ({how}; log: {log_path})")
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-rootfs-") as tmp, open(log_path, "w") as out, \
            fetch.serving(list(inputs)) as proxy:
        work = Path(tmp)
        work.chmod(0o711)  # an unshare-mode hook runs as a uid of the user's subuid range: it passes through
        state = work / "state"
        state.mkdir()
        state.chmod(0o777)  # the hook may run as a mapped uid (unshare mode) or as root (sudo)
        tarball = work / "rootfs.tar"
        cmd = mmdebstrap_command(image, root, fetch.proxy_url(proxy))
        cmd.insert(cmd.index("mmdebstrap"), f"STATE={state / 'inrelease'}")
        with open(tarball, "wb") as tar_out:
            proc = subprocess.run(cmd, stdout=tar_out, stderr=out)
        out.write("".join(f"store: served {p}\n" for p in proxy.served) + "".join(f"store: no locked file for {p}\n" for p in proxy.refused))
        out.flush()
        if proc.returncode != 0:
            raise BuildError("mmdebstrap of the base rootfs" + ("" if root is not None else
                             " (as a user: it needs user namespaces and a /etc/subuid range)")
                             + (f" (apt asked for {len(proxy.refused)} files the lock does not name)" if proxy.refused else ""),
                             str(log_path), log_tail(log_path))
        identity: dict = {"recipe": ref, "platform": image.platform, "rootfs_sha256": file_sha256(tarball),
                    "mirror": mirror_state(state / "inrelease")}
        archive = work / "image.tar"
        write_archive(archive, tarball, ref, image)
        load = subprocess.run([docker_cli, "load", "--input", str(archive)], stdout=out, stderr=subprocess.STDOUT)
        if load.returncode != 0:
            raise BuildError("loading the base rootfs into Docker (docker load)", str(log_path), log_tail(log_path))
    image_id = c.images.get(ref).id
    assert image_id is not None  # docker-py types Model.id optional; an image the engine lists has one
    identity.update(diff_id=f"sha256:{identity['rootfs_sha256']}", image_id=image_id)
    (log_dir / RECORD).write_text(json.dumps(identity, indent=2, sort_keys=True) + "\n")
    log(f"base {ref} ready: diff_id {identity['diff_id'][:19]}..., image ID {image_id[:19]}...")
    return image_id


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def mirror_state(path: Path) -> dict[str, str]:
    """{apt list file of the suite's InRelease: its Date, ISO 8601}: the mirror as mmdebstrap read it."""
    state = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        name, _, date = line.partition("\t")
        if name and date:
            state[name.removesuffix("_InRelease")] = iso_date(date)
    return state


def iso_date(rfc2822: str) -> str:
    """`Sat, 15 Nov 2026 09:12:34 UTC` (a Release file's Date) as 2026-11-15T09:12:34Z."""
    stamp = datetime.strptime(rfc2822.strip().replace("UTC", "+0000"), "%a, %d %b %Y %H:%M:%S %z")
    return stamp.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def image_config(image: Image, diff_id: str) -> bytes:
    """The base image's config: fixed bytes for one rootfs, so its digest (the classic store's
    image ID) is the same on every machine and every day."""
    created = datetime.fromtimestamp(REPRODUCIBLE_EPOCH, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    config = {
        "architecture": image.arch,
        "os": "linux",
        "created": created,
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": created, "created_by": f"mmdebstrap --variant={image.os.variant} {image.os.suite} "
                                                       f"{image.os.mirror} (SOURCE_DATE_EPOCH={REPRODUCIBLE_EPOCH})"}],
    }
    if image.arch == "arm64":
        config["variant"] = "v8"
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def write_archive(archive: Path, tarball: Path, ref: str, image: Image) -> None:
    """A `docker save` archive (the format every `docker load` reads) of one layer, the tarball as it is."""
    diff = file_sha256(tarball)
    config = image_config(image, f"sha256:{diff}")
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [ref], "Layers": [f"{diff}/layer.tar"]}]).encode()
    with tarfile.open(archive, "w") as out:
        for name, data in ((config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), REPRODUCIBLE_EPOCH
            out.addfile(info, io.BytesIO(data))
        info = out.gettarinfo(str(tarball), arcname=f"{diff}/layer.tar")
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        with open(tarball, "rb") as f:
            out.addfile(info, f)


def recorded(root: Path, image: Image) -> dict | None:
    """The identity committed for this image's base on its platform (images/<image>/base.json)."""
    path = root / "images" / image.name / RECORD
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(image.platform)


def compare(found: dict, record: dict | None) -> str:
    """One line: whether a base built here is the recorded one, and if not, what differs."""
    if record is None:
        return "no identity recorded for this base (images/<image>/base.json): nothing to compare"
    if found["diff_id"] == record["diff_id"]:
        return f"the recorded base: diff_id {found['diff_id'][:19]}... (mirror of {_dates(record)})"
    moved = found.get("mirror") != record.get("mirror")
    return (f"NOT the recorded base: diff_id {found['diff_id'][:19]}... against {record['diff_id'][:19]}... recorded; "
            + (f"the mirror moved since ({_dates(record)} then, {_dates(found)} now)" if moved else
               f"from the same mirror state ({_dates(found)})"))


def _dates(identity: dict) -> str:
    return ", ".join(f"{k.split('_dists_')[-1]} {v}" for k, v in sorted((identity.get("mirror") or {}).items())) or "unknown"


def describe(ref: str, found: dict) -> str:
    """What `build.py base` prints: the base's identity, one fact a line."""
    lines = [f"base:        {ref}", f"diff_id:     {found.get('diff_id')}",
             f"image ID:    {found['image_id']} ({found['store']} store)"]
    for suite, date in sorted((found.get("mirror") or {}).items()):
        lines.append(f"mirror:      {suite.replace('_dists_', ' ')} InRelease {date}")
    return "\n".join(lines)


def record(root: Path, matrix: Matrix, image: Image, found: dict, revision: str) -> list[Path]:
    """Write found as the recorded identity of this base on image's platform, in the base.json
    of every row that shares it (same base name and platform); the paths written."""
    if not found.get("diff_id") or not found.get("mirror"):
        raise NotReady(f"nothing to record: the base {render.base_ref(image)} was not built by this checkout's "
                         "build.py, so its mirror state is unknown (build.py base --rebuild --record)", ref=render.base_ref(image))
    # The config's digest is the image ID on a classic store: computed, so one record serves both stores.
    config_digest = "sha256:" + hashlib.sha256(image_config(image, found["diff_id"])).hexdigest()
    entry = {"diff_id": found["diff_id"], "image_id": found["image_id"], "store": found["store"], "mirror": found["mirror"],
             "config_digest": config_digest,
             "revision": revision, "recorded": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
    written = []
    for row in matrix.images:
        if image.platform not in row.platforms or render.base_ref(row.on(image.platform)) != render.base_ref(image):
            continue
        path = root / "images" / row.name / RECORD
        data = json.loads(path.read_text()) if path.exists() else {}
        data[image.platform] = entry
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written

