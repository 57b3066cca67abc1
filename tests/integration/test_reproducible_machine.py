"""The default row built on two "machines" that differ in every way this one can vary gives one
image digest (on request: two cold builds, ops compiled in each, about 35-45 min on 2 cores).

    PYTORCH_CUDA_TEST_REPRODUCIBLE=1 python3 build.py selftest -- -k reproducible_machine

Each build runs on a Docker 26 engine of its own (containerd store, an empty data root, so
nothing is cached and the DeepSpeed ops are compiled in both), from a clone of its own, with an
ops seed and state directory of its own:

| | machine A | machine B |
|---|---|---|
| CPUs the engine and its builds get | every CPU | one (taskset: `nproc` 1 in RUN steps, so MAX_JOBS=1) |
| the engine's data | this host's filesystem (ext4 here) | an XFS filesystem (a loop device) |
| hostname (the engine's UTS namespace) | this host's | builder-b.example |
| TZ, LANG, LC_ALL (engine and client) | unset, C.UTF-8 | Pacific/Chatham, de_DE.UTF-8 |
| umask (engine and client) | 0022 | 0077 |
| the checkout's path, TMPDIR | /tmp/pytest-.../a | /var/tmp/.../elsewhere/b |

What cannot vary on one machine: the CPU's model and flags, the kernel. The record of a build on
another machine compares those (`build.py verify --record`).

With machine B's image still on its engine, the commands a user runs prove the records: `build.py
record` writes B's record, `verify --record` of B's image against A's record says THE SAME IMAGE
(exit 0), and against the second machine's record of f3d6c71 (docs/measurements/records/) says
DIFFERENT and names the files (exit 1). Records and both verdicts stay in
build-results/reproducible-machine/.

PYTORCH_CUDA_TEST_REPRODUCIBLE_COMMIT=REV builds that commit instead of HEAD, and
PYTORCH_CUDA_TEST_REPRODUCIBLE_AGAINST=RECORD[,RECORD...] (records of that commit made elsewhere)
stands for machine A: B's image must be the same as each.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.commands import record
from pytorch_cuda_build.tooling import engine_current

from helpers import ROOT, clone_at, require, run_build_py

ON_REQUEST = "PYTORCH_CUDA_TEST_REPRODUCIBLE"
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.engine26,
              pytest.mark.skipif(os.environ.get(ON_REQUEST) != "1",
                                 reason=f"on request ({ON_REQUEST}=1): two cold builds of the default row, about 1.5 h on 2 cores "
                                        "(one, against records of another machine, 50 min)")]
ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
COMMIT_ENV = "PYTORCH_CUDA_TEST_REPRODUCIBLE_COMMIT"  # default HEAD
AGAINST_ENV = "PYTORCH_CUDA_TEST_REPRODUCIBLE_AGAINST"  # records of that commit made elsewhere, comma-separated: no machine A
F3D6C71 = "f3d6c7146b103a3c6423f30e2740d45f7d2061c2"
SECOND_MACHINE = ROOT / "docs/measurements/records/2.7.1-cuda12.1-runtime-f3d6c71-second-machine.json.xz"
XFS_BYTES = 60 * 1024**3  # sparse: a cold build of the default row writes about 30 GB


def machine(name: str, bridge: str, address: str, home: Path | None = None, cpus: str | None = None,
            hostname: str | None = None, umask: str = "022", env: dict[str, str] | None = None) -> engine_current.Store:
    """A Docker 26 engine of its own, started under these conditions (a UTS namespace for the hostname)."""
    wrap: tuple[str, ...] = ("unshare", "--uts", "sh", "-c", f'hostname {hostname} && umask {umask} && exec "$0" "$@"') if hostname \
        else ("sh", "-c", f'umask {umask} && exec "$0" "$@"')
    if cpus:
        wrap += ("taskset", "-c", cpus)
    return engine_current.Store(name, bridge, address, home=home, wrap=wrap, env=tuple((env or {}).items()))


@pytest.fixture
def xfs(tmp_path_factory):
    """An XFS filesystem on a sparse file: the second engine's data on another filesystem."""
    require(os.geteuid() == 0, "mounting a filesystem needs root")
    if not shutil.which("mkfs.xfs"):
        subprocess.run(["apt-get", "install", "-y", "-q", "xfsprogs"], capture_output=True, check=False)
    require(shutil.which("mkfs.xfs"), "mkfs.xfs (Debian: xfsprogs)")
    where = Path("/var/tmp") / f"pytorch-cuda-repro-{os.getpid()}"
    where.mkdir(parents=True)
    image, mnt = where / "fs.img", where / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(XFS_BYTES)
    subprocess.run(["mkfs.xfs", "-q", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        shutil.rmtree(where, ignore_errors=True)


def build_on(store: engine_current.Store, checkout: Path, state: Path, extra_env: dict[str, str], umask: int) -> tuple[str, str, dict[str, str]]:
    """The default row built cold on store's engine: its image ID, its candidate ref and the environment
    that reaches that engine."""
    env = engine_current.up(store, None, log=lambda m: None)
    full = {**os.environ, **env, **extra_env, "PYTORCH_CUDA_STATE": str(state)}
    old = os.umask(umask)
    try:
        proc = run_build_py(checkout, "--torch", "2.7", "--cuda", "12.1", "--no-test", "--quiet", env=full, timeout=5400)
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = f"{ROW.repository}-candidate:{ROW.local_name}"
    image_id = subprocess.run([env["PYTORCH_CUDA_DOCKER"], "image", "inspect", "--format", "{{.Id}}", ref], env=full,
                              capture_output=True, text=True, check=True).stdout.strip()
    return image_id, ref, full


def record_of(ref: str, env: dict[str, str], path: Path) -> record.Record:
    """`build.py record` of ref on the engine env reaches (this checkout's command: the record's
    format is today's, whatever commit the image was built from)."""
    proc = run_build_py(ROOT, "record", "--torch", "2.7", "--cuda", "12.1", "--image", ref, "--output", str(path), env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return record.load(path)


def verify_record(path: Path, ref: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`build.py verify --record`, as a user on another machine runs it: the local image against a record."""
    return run_build_py(ROOT, "verify", "--torch", "2.7", "--cuda", "12.1", "--record", str(path), "--against", ref,
                        env=env, timeout=1800)


def test_two_machines_that_differ_in_all_this_one_can_vary_build_one_digest(tmp_path, xfs):
    elsewhere = Path("/var/tmp") / f"pytorch-cuda-repro-{os.getpid()}-elsewhere"
    elsewhere.mkdir(parents=True)
    a = machine("repro-a", "pcb-repa0", "172.30.216.1/24")
    b = machine("repro-b", "pcb-repb0", "172.30.217.1/24", home=xfs, cpus="0", hostname="builder-b.example", umask="077",
                env={"TZ": "Pacific/Chatham", "LANG": "de_DE.UTF-8", "LC_ALL": "de_DE.UTF-8"})
    commit = os.environ.get(COMMIT_ENV) or "HEAD"
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", commit], capture_output=True, text=True, check=True).stdout.strip()
    against = [Path(p) for p in os.environ.get(AGAINST_ENV, "").split(",") if p]
    kept = ROOT / "build-results" / "reproducible-machine"  # for the measurements page, and a second machine
    kept.mkdir(parents=True, exist_ok=True)
    name = f"{ROW.name}-{commit[:7]}"
    try:
        if not against:  # machine A builds here; with records of this commit from elsewhere, they stand for it
            _, ref_a, env_a = build_on(a, clone_at(tmp_path / "a", commit), tmp_path / "state-a", {"LANG": "C.UTF-8"}, 0o022)
            record_of(ref_a, env_a, kept / f"{name}-a.json.xz")
            against = [kept / f"{name}-a.json.xz"]
            engine_current.down(a)  # one engine at a time, and one engine's data: about 35 GB each
            shutil.rmtree(a.state, ignore_errors=True)
        (elsewhere / "tmp").mkdir()
        _, ref_b, env_b = build_on(b, clone_at(elsewhere / "b", commit), elsewhere / "state-b",
                                   {"TZ": "Pacific/Chatham", "LANG": "de_DE.UTF-8", "LC_ALL": "de_DE.UTF-8",
                                    "TMPDIR": str(elsewhere / "tmp")}, 0o077)
        rec_b = record_of(ref_b, env_b, kept / f"{name}-b.json.xz")
        for i, path in enumerate(against):  # B's image against each record, as a user runs it
            diff = record.compare(record.load(path), rec_b, (path.name, "machine B"))
            same = verify_record(path, ref_b, env_b)
            (kept / f"verify-b-against-{i}.txt").write_text(f"{path}\n{same.stdout}{same.stderr}")
            assert diff.same_image, "\n".join([f"B against {path}", *record.lines(diff)])
            assert same.returncode == 0 and "verdict: THE SAME IMAGE" in same.stdout, same.stdout + same.stderr[-2000:]
        if commit != F3D6C71:  # the second machine's record is of an older commit: its files differ, and are named
            other = verify_record(SECOND_MACHINE, ref_b, env_b)
            (kept / "verify-b-against-second-machine-f3d6c71.txt").write_text(other.stdout + other.stderr)
            assert other.returncode == 1 and "verdict: DIFFERENT" in other.stdout, other.stdout + other.stderr[-2000:]
            assert re.search(r"^\s*layer \d+: \S", other.stdout, re.M), other.stdout
    finally:
        for store in (a, b):
            engine_current.down(store)
            shutil.rmtree(store.state, ignore_errors=True)
            shutil.rmtree(store.run, ignore_errors=True)
            subprocess.run(["ip", "link", "del", store.bridge], capture_output=True, check=False)  # down() keeps a store's bridge
        shutil.rmtree(elsewhere, ignore_errors=True)
