"""The base of every image: a digest-pinned registry image, or a rootfs built locally.

Our build hosts reach no container registry, so the default matrix builds its Debian
root filesystem with debootstrap from the Debian mirror and imports it into Docker
once, named after the recipe's hash so a changed recipe never reuses an old base.
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

from . import build, render
from .errors import BuildError, EnvironmentProblem
from .matrix import Image

# Machine-wide state shared by every run: pass records (tag.TESTED) and the locks that keep
# two runs off one row. Read once, at import: a caller that wants its own (the test suite
# does, tests/conftest.py) sets PYTORCH_CUDA_STATE before importing the package. Empty
# means unset, never the current directory.
STATE_DIR = Path(os.environ.get("PYTORCH_CUDA_STATE") or Path.home() / ".cache" / "pytorch-cuda").expanduser()


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
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(str(STATE_DIR / "rootfs.lock")):  # two builds never debootstrap at once
        return image_id(c, ref) or _debootstrap(c, image, ref, log_dir, log, docker_cli)


def as_root(ref: str) -> list[str]:
    """The prefix that runs a command as root: none for root; `sudo -n` for a user with
    password-less sudo, as on GitHub's hosted runners (their user is not root)."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
        return ["sudo", "-n"]
    raise EnvironmentProblem(f"building base {ref} with debootstrap needs root or password-less sudo; "
                             "run as root, or pin a registry base")


def _debootstrap(c: docker.DockerClient, image: Image, ref: str, log_dir: Path, log, docker_cli: str) -> str:
    root = as_root(ref)
    # /usr/sbin is not on a normal user's PATH, and debootstrap lives there
    debootstrap = shutil.which("debootstrap", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    if not debootstrap:
        raise EnvironmentProblem("debootstrap is not installed (Debian: apt-get install debootstrap)")
    os_ = image.os
    log_path = log_dir / "rootfs.log"
    via = " (through sudo)" if root else ""
    log(f"building base {ref}: debootstrap --variant={os_.variant} {os_.suite} {os_.mirror}{via} (log: {log_path})")
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-rootfs-") as tmp, open(log_path, "w") as out:
        target = Path(tmp) / "rootfs"
        try:
            cmd = [*root, debootstrap, f"--variant={os_.variant}", os_.suite, str(target), os_.mirror]
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise BuildError("debootstrap of the base rootfs", str(log_path), build.tail(log_path))
            # Debootstrap leaves apt lists and caches; they are not part of the base's identity.
            junk = [target / "var/lib/apt/lists", target / "var/cache/apt/archives"]
            subprocess.run([*root, "rm", "-rf", *map(str, junk)], check=True)
            subprocess.run([*root, "mkdir", "-p", *(str(j / "partial") for j in junk)], check=True)
            tar = subprocess.Popen([*root, "tar", "--numeric-owner", "-C", str(target), "-c", "."], stdout=subprocess.PIPE)
            imp = subprocess.run([docker_cli, "import", "-", ref], stdin=tar.stdout, stdout=out, stderr=subprocess.STDOUT)
            tar.wait()
            if tar.returncode != 0 or imp.returncode != 0:
                raise BuildError("importing the base rootfs into Docker", str(log_path), build.tail(log_path))
        finally:
            if root:  # the tree is root's: the temporary directory's own clean-up cannot remove it
                subprocess.run([*root, "rm", "-rf", str(target)], check=False)
    log(f"base {ref} ready")
    return c.images.get(ref).id
