"""The base of every image: a digest-pinned registry image, or a rootfs built locally.

Our build hosts reach no container registry, so the default matrix builds its Debian
root filesystem from the Debian mirror and loads it into Docker once, named after the
recipe's hash so a changed recipe never reuses an old base. Two ways, by what the user may:

- root, or password-less sudo (a hosted runner's user): debootstrap, then `docker import`;
- neither: mmdebstrap in a user namespace (the user's /etc/subuid range) writes the tree as a
  tarball, the same bytes on every run from the same mirror state (SOURCE_DATE_EPOCH), and
  BuildKit makes it an image (`FROM scratch`, `ADD`), so no root and no `docker import`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import docker
import docker.errors
from filelock import FileLock

from .. import paths
from ..engine import docker_env
from ..errors import BuildError, EnvironmentProblem
from ..matrix import REPRODUCIBLE_EPOCH, Image
from ..progress import log_tail
from . import render


def image_id(c: docker.DockerClient, ref: str) -> str | None:
    try:
        return c.images.get(ref).id
    except docker.errors.ImageNotFound:
        return None


def ensure(c: docker.DockerClient, image: Image, log_dir: Path, log=print, *, docker_cli: str) -> str:
    """The base image's ID, building the rootfs first if this machine lacks it; docker_cli
    (the user's --docker) imports it."""
    ref = render.base_ref(image)
    found = image_id(c, ref)
    if found:
        return found
    if image.os.kind == "registry":
        raise EnvironmentProblem(f"base {ref} is not present locally; pull it first (docker pull {ref})")
    paths.STATE_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(paths.STATE_DIR / "rootfs.lock")):  # two builds never debootstrap at once
        return image_id(c, ref) or _rootfs(c, image, ref, log_dir, log, docker_cli)


def _rootfs(c: docker.DockerClient, image: Image, ref: str, log_dir: Path, log, docker_cli: str) -> str:
    root = as_root()
    if root is not None:
        return _debootstrap(c, image, ref, log_dir, log, docker_cli, root)
    if not shutil.which("mmdebstrap"):
        raise EnvironmentProblem(f"building base {ref} needs root or password-less sudo (debootstrap), or mmdebstrap "
                                 "for a user with neither (Debian: apt-get install mmdebstrap uidmap); "
                                 "or pin a registry base")
    return _mmdebstrap(c, image, ref, log_dir, log, docker_cli)


def as_root() -> list[str] | None:
    """The prefix that runs a command as root: none for root; `sudo -n` for a user with
    password-less sudo, as on GitHub's hosted runners (their user is not root); None for anyone else."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    return None


def _debootstrap(c: docker.DockerClient, image: Image, ref: str, log_dir: Path, log, docker_cli: str,
                 root: list[str]) -> str:
    # /usr/sbin is not on a normal user's PATH, and debootstrap lives there
    debootstrap = shutil.which("debootstrap", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    if not debootstrap:
        raise EnvironmentProblem("debootstrap is not installed (Debian: apt-get install debootstrap)")
    os_ = image.os
    log_path = log_dir / "rootfs.log"
    via = " (through sudo)" if root else ""
    # Another architecture's second stage runs its own binaries in the chroot, through QEMU.
    arch = [] if image.platform == "linux/amd64" else [f"--arch={image.arch}"]
    if arch:
        _buildkit(docker_cli)  # it loads the tree: checked before minutes of debootstrap
    log(f"building base {ref}: debootstrap {' '.join(arch + [f'--variant={os_.variant}'])} {os_.suite} {os_.mirror}{via} "
        f"(log: {log_path})")
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-rootfs-") as tmp, open(log_path, "w") as out:
        target = Path(tmp) / "rootfs"
        try:
            cmd = [*root, debootstrap, *arch, f"--variant={os_.variant}", os_.suite, str(target), os_.mirror]
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise BuildError("debootstrap of the base rootfs", str(log_path), log_tail(log_path))
            # Debootstrap leaves apt lists and caches; they are not part of the base's identity.
            junk = [target / "var/lib/apt/lists", target / "var/cache/apt/archives"]
            subprocess.run([*root, "rm", "-rf", *map(str, junk)], check=True)
            subprocess.run([*root, "mkdir", "-p", *(str(j / "partial") for j in junk)], check=True)
            tar_cmd = [*root, "tar", "--numeric-owner", "-C", str(target), "-c", "."]
            if image.platform == "linux/amd64":
                tar = subprocess.Popen(tar_cmd, stdout=subprocess.PIPE)
                imp = subprocess.run([docker_cli, "import", "-", ref], stdin=tar.stdout, stdout=out, stderr=subprocess.STDOUT)
                tar.wait()
                if tar.returncode != 0 or imp.returncode != 0:
                    raise BuildError("importing the base rootfs into Docker", str(log_path), log_tail(log_path))
            else:
                # `docker import --platform` records amd64 on Docker 20.10 whatever it is told: BuildKit
                # loads the tree instead, as the image of the platform it builds for.
                ctx = Path(tmp) / "context"
                ctx.mkdir()
                with open(ctx / "rootfs.tar", "wb") as tarball:
                    if subprocess.run(tar_cmd, stdout=tarball, stderr=out).returncode != 0:
                        raise BuildError("packing the base rootfs", str(log_path), log_tail(log_path))
                out.flush()
                _load(docker_cli, ctx, ref, image.platform, out, log_path)
        finally:
            if root:  # the tree is root's: the temporary directory's own clean-up cannot remove it
                subprocess.run([*root, "rm", "-rf", str(target)], check=False)
    log(f"base {ref} ready")
    return c.images.get(ref).id


def _buildkit(docker_cli: str) -> docker_env.BuildClient:
    bc = docker_env.probe(docker_cli)
    if bc is None:
        raise EnvironmentProblem(f"{docker_cli} has no BuildKit (buildx) to load the base rootfs with")
    return bc


def _load(docker_cli: str, ctx: Path, ref: str, platform: str, out, log_path: Path) -> None:
    """ctx/rootfs.tar into the engine as ref, an image of platform, with BuildKit (FROM scratch, ADD)."""
    bc = _buildkit(docker_cli)
    (ctx / "Dockerfile").write_text("FROM scratch\nADD rootfs.tar /\n")  # ADD unpacks it, owners and modes kept
    argv = [*bc.argv, "--progress=plain", "--platform", platform, "--tag", ref]
    if "buildx" in bc.argv:
        argv.append("--provenance=false")  # a plain image, as `docker import` gives
    if subprocess.run([*argv, str(ctx)], stdout=out, stderr=subprocess.STDOUT, env=docker_env.build_env(bc)).returncode != 0:
        raise BuildError("loading the base rootfs into Docker (BuildKit)", str(log_path), log_tail(log_path))


def _mmdebstrap(c: docker.DockerClient, image: Image, ref: str, log_dir: Path, log, docker_cli: str) -> str:
    """The rootfs as an unprivileged user: mmdebstrap in a user namespace, loaded by BuildKit."""
    _buildkit(docker_cli)  # before minutes of mmdebstrap
    os_ = image.os
    log_path = log_dir / "rootfs.log"
    log(f"building base {ref}: mmdebstrap --mode=unshare --arch={image.arch} --variant={os_.variant} {os_.suite} "
        f"{os_.mirror} (no root; log: {log_path})")
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-rootfs-") as tmp, open(log_path, "w") as out:
        ctx = Path(tmp)
        # Like the debootstrap path: no apt lists, caches or their lock files in the base.
        # mmdebstrap's own clean-up runs after this hook and leaves the lock files: skipped.
        clean = 'rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/archives/* "$1"/var/cache/apt/*.bin; ' \
                'mkdir -p "$1"/var/lib/apt/lists/partial "$1"/var/cache/apt/archives/partial'
        cmd = ["mmdebstrap", "--mode=unshare", f"--arch={image.arch}", f"--variant={os_.variant}", "--skip=cleanup/apt/lists",
               "--skip=cleanup/apt/cache", f"--customize-hook={clean}", os_.suite, str(ctx / "rootfs.tar"), os_.mirror]
        # File times and the tar's order fixed: the same tarball from the same mirror state.
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(REPRODUCIBLE_EPOCH)}
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode != 0:
            raise BuildError("mmdebstrap of the base rootfs (as a user: it needs user namespaces and a "
                             "/etc/subuid range)", str(log_path), log_tail(log_path))
        out.flush()
        _load(docker_cli, ctx, ref, image.platform, out, log_path)
    log(f"base {ref} ready")
    return c.images.get(ref).id
