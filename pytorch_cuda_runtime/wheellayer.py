"""Install locked wheels as one image layer whose bytes depend only on those wheels.

    python wheellayer.py --epoch N --wheels DIR 'torch==2.11.0 --hash=sha256:...'       one pinned wheel
    python wheellayer.py --epoch N --wheels DIR --rest /opt/pytorch-cuda/requirements.lock  every pin not yet installed

DIR holds the locked wheel files themselves (the build bind-mounts them from the host's store,
pytorch_cuda_build/stages/fetch.py): nothing is downloaded, and the step needs no network.

Each RUN step of the image's python-env stage calls this once (templates/python_env.j2). The
layer it leaves must hold that wheel's files and nothing else of the environment, with the same
bytes on every build, so that every row and every refresh that installs the same wheel makes the
same blob (docs/performance.md#layers):
- byte-code is compiled for the installed distributions' own files only (hash-based, so it is
  the same on every build); compileall over the whole venv would rewrite, and so copy into this
  layer, every earlier layer's .pyc;
- every file it installed and every directory above them, up to the venv, takes one fixed mtime, the image's
  epoch: a layer's tar records them, and engines that cannot rewrite times (Docker 20.10, the
  classic store) would otherwise make a new blob on every build. The headers need it anyway:
  nvcc records their times, and GCC's #pragma once compares them. Only this layer's own entries:
  touching an earlier layer's file copies it up into this one;
- the same entries get the environment's owner (--owner, the image's user and group 0) and group
  rights equal to the owner's, so that user and any uid in group 0 can add, upgrade and remove
  packages (docs/extending.md). Set here, in the step that writes them: a later `chown -R`
  would copy the whole environment into a layer of its own.

Standard library and pip only; the build bind-mounts this one file, and the in-image lock format's
module beside it when there is one (pins are read the way the host tool reads them).
"""
from __future__ import annotations

import argparse
import contextlib
import concurrent.futures
import hashlib
import importlib.metadata
import importlib.util
import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from pytorch_cuda_runtime import lockfile
except ImportError:  # run as a script in a build step, which bind-mounts lockfile.py beside it
    import lockfile  # type: ignore[no-redef]


class LayerError(Exception):
    """What went wrong, in one line."""


def pins(lock_text: str) -> list["lockfile.Pin"]:
    """Each `name==version` requirement, in the lock's order."""
    return lockfile.pins(lock_text)


def installed() -> dict[str, str]:
    """name -> version of every distribution this interpreter sees."""
    return {lockfile.canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}


def same_version(a: str | None, b: str) -> bool:
    """PEP 440 equality (2026.09.1 is 2026.9.1), with pip's own copy of packaging."""
    if a is None or a == b:
        return a == b
    try:
        from pip._vendor.packaging.version import InvalidVersion, Version  # pip's copy: packaging may not be installed yet
    except ImportError:
        return False
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return False


def rest(lock_text: str, have: dict[str, str]) -> list["lockfile.Pin"]:
    """The lock's pins not installed at their version yet (an older one gets replaced)."""
    return [p for p in pins(lock_text) if not same_version(have.get(p.name), p.version)]


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_files(chosen: list["lockfile.Pin"], wheels: str) -> None:
    """Each pin has a file in the wheels folder with one of its locked hashes: said here, by name,
    before pip (which takes an installed distribution as it is, whatever its hash)."""
    found = {sha256_of(p) for p in Path(wheels).iterdir() if p.is_file()}
    lacking = [f"{p.name}=={p.version}" for p in chosen if not (p.hashes & found)]
    if lacking:
        raise LayerError(f"no file in {wheels} has a locked hash of {', '.join(lacking)}")


def pip(*args: str, stdin: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], input=stdin, text=True)
    if proc.returncode != 0:
        raise LayerError(f"pip {args[0]} failed (exit {proc.returncode}); its output is above")


def install(requirements: list[str], wheels: str) -> None:
    """Install from the folder of locked wheel files, hash-checked, no index, no dependencies.
    The requirements go through stdin: a file for them would change /tmp, and /tmp's time, in the layer."""
    text = "\n".join(requirements) + "\n"
    pip("install", "--quiet", "--no-index", "--find-links", wheels, "--no-deps", "--require-hashes", "--no-compile",
        "-r", "/dev/stdin", stdin=text)


@contextlib.contextmanager
def scratch(where: str):
    """A temporary directory on a mount that is never in the layer (the build's tmpfs), as TMPDIR
    for pip and this process: pip's unpacking would otherwise touch /tmp."""
    path = Path(where) / ".tmp" / str(os.getpid())
    path.mkdir(parents=True, exist_ok=True)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"], tempfile.tempdir = str(path), None
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        tempfile.tempdir = None
        shutil.rmtree(path, ignore_errors=True)


def own_files(names: list[str]) -> list[Path]:
    """Every file the named distributions installed (their RECORD), as absolute paths."""
    out = []
    for name in names:
        dist = importlib.metadata.distribution(name)
        out += [Path(dist.locate_file(f)).resolve() for f in dist.files or []]
    return out


def compile_all(sources: list[Path]) -> list[str]:
    """Hash-based byte-code for each .py, in parallel, as `compileall -f --invalidation-mode
    unchecked-hash` writes it; the files that are not this Python's syntax (torch ships a
    py312_intrinsics.py), which get none, as pip leaves them. Any other failure stops the layer."""
    todo = sorted(str(p) for p in sources if p.suffix == ".py" and p.is_file())
    with concurrent.futures.ProcessPoolExecutor() as pool:
        results = list(pool.map(_compile, todo, chunksize=64))
    return [path for path, ok in zip(todo, results) if not ok]


def _compile(path: str) -> bool:
    try:
        py_compile.compile(path, doraise=True, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    except py_compile.PyCompileError:
        return False
    return True


def with_byte_code(files: list[Path]) -> list[Path]:
    """The files and, for each .py among them, its byte-code where it was written."""
    pycs = [Path(importlib.util.cache_from_source(str(p))) for p in files if p.suffix == ".py"]
    return files + [p for p in pycs if p.exists()]


def set_times(entries: list[Path], epoch: int) -> int:
    """Each entry (layer_entries: deepest first) to mtime `epoch`; how many."""
    for p in entries:
        os.utime(p, (epoch, epoch), follow_symlinks=False)
    return len(entries)


def owner(text: str) -> tuple[int, int]:
    """UID:GID, both numeric (the image's user exists only in the image's own /etc/passwd)."""
    uid, sep, gid = text.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit()):
        raise argparse.ArgumentTypeError(f"--owner takes numeric UID:GID, not {text!r}")
    return int(uid), int(gid)


def set_owner(entries: list[Path], uid: int, gid: int) -> None:
    """Each entry to uid:gid with its group's rights equal to its owner's (chmod g=u), as
    jupyter/docker-stacks' fix-permissions leaves its environment. A symlink's own owner
    changes; its mode is not its own."""
    for p in entries:
        os.chown(p, uid, gid, follow_symlinks=False)
        if not p.is_symlink():
            mode = p.stat().st_mode
            os.chmod(p, (mode & ~0o070) | ((mode & 0o700) >> 3))


def layer_entries(files: list[Path], top: Path) -> list[Path]:
    """The files that exist, then every directory above them up to top, deepest first. Not
    above top (the environment's prefix, which every install scheme path lies in): pip writes
    nothing there, and a directory it did not write (/opt, a runner's /tmp) may not be ours."""
    dirs = {parent for p in files for parent in p.parents if parent == top or top in parent.parents}
    return [p for p in files if os.path.lexists(p)] + sorted(dirs, key=lambda d: -len(d.parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wheellayer.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("requirement", nargs="*", help="pinned requirement lines: 'NAME==VERSION --hash=sha256:HEX'")
    ap.add_argument("--rest", type=Path, metavar="LOCK", help="every pin of this requirements lock not yet installed")
    ap.add_argument("--epoch", type=int, required=True, help="the mtime of every file and directory the layer writes (the image's SOURCE_DATE_EPOCH)")
    ap.add_argument("--owner", type=owner, metavar="UID:GID",
                    help="the owner of every file and directory the layer writes, whose group gets the owner's rights")
    ap.add_argument("--wheels", required=True, help="the folder of the locked wheel files (read only)")
    ap.add_argument("--scratch", default="/scratch", help="a folder outside the layer for pip's temporary files")
    a = ap.parse_args(argv)
    if bool(a.requirement) == bool(a.rest):
        ap.error("give requirement lines or --rest LOCK, not both or neither")
    try:
        chosen = rest(a.rest.read_text(), installed()) if a.rest else pins("\n".join(a.requirement))
        if a.requirement and len(chosen) != len(a.requirement):
            raise LayerError(f"not a pinned requirement: {' '.join(a.requirement)}")
        if not chosen:
            print("wheellayer: every pin is installed already; an empty layer", flush=True)
            return 0
        with scratch(a.scratch):
            check_files(chosen, a.wheels)
            install([p.block for p in chosen], a.wheels)
            have = installed()
            wrong = [f"{p.name}=={p.version} (installed: {have.get(p.name, 'none')})" for p in chosen if not same_version(have.get(p.name), p.version)]
            if wrong:
                raise LayerError(f"not installed as locked: {', '.join(wrong)}")
            files = own_files([p.name for p in chosen])
            for path in compile_all(files):
                print(f"wheellayer: no byte-code for {path}: not Python {sys.version_info[0]}.{sys.version_info[1]} syntax", flush=True)
            entries = layer_entries(with_byte_code(files), Path(sys.prefix).resolve())
            if a.owner:
                set_owner(entries, *a.owner)
            set_times(entries, a.epoch)
    except (LayerError, OSError, importlib.metadata.PackageNotFoundError) as e:
        print(f"wheellayer: {e}", file=sys.stderr)
        return 1
    print(f"wheellayer: {len(chosen)} wheel(s) in this layer: {', '.join(f'{p.name}=={p.version}' for p in chosen[:8])}"
          f"{' ...' if len(chosen) > 8 else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
