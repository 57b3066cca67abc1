"""The default row's digest does not depend on the day it is built, on Debian's mirror or on the
network (on request: two builds of the default row on Docker 26, about 30-40 min on 2 cores).

    PYTORCH_CUDA_TEST_HERMETIC=1 python3 build.py selftest -- tests/integration/test_hermetic.py

From a clone at HEAD, on Docker 26's containerd store (`build.py engine`), with a state directory
and store of its own:

1. the row built as the README builds it: its files fetched into the store, its image ID noted;
2. the machine's clock moved to another day (two days on: `date -s`, put back after, whatever
   happens), and every mirror and index "moved": http_proxy and https_proxy point at a proxy on
   127.0.0.1 that answers every address with 404 and notes it (a mirror that dropped every locked
   version and serves nothing else either);
3. under both, the base rebuilt (`build.py base --rebuild`) and the row built again with
   `--no-cache` (every step run again; the DeepSpeed ops from the host's ops seed).

Asserted: the base has the recorded diff_id; the second build is the first's image (one image ID,
the manifest's digest on this store); the proxy was asked nothing (no step and no stage reached a
mirror or an index). Each build runs with `--network none` in any case (stages/build.py).

And security still arrives: a relock (apt's solver, stages/lock.py) over a world made of the store's
files, the release's signed index and the update suites holding exactly the locked .debs, gives the
committed debs.lock; with one more security fix in that world (the locked liblzma5 .deb with a newer
version), it moves that package's line alone, and the row's base stage built from the new lock, with
no network, holds every locked package at its version, the fix among them.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from pytorch_cuda_build import ca, matrix
from pytorch_cuda_build.resolve import debian
from pytorch_cuda_build.stages import build, fetch, lock, render
from pytorch_cuda_runtime import lockfile

from helpers import ROOT, base_in_current_engine, clone_at, current_engine, debian_suite, needs_root, project_copy, run_build_py, sources_gone, store_restored

ON_REQUEST = "PYTORCH_CUDA_TEST_HERMETIC"
pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.engine26, pytest.mark.root,
              pytest.mark.skipif(os.environ.get(ON_REQUEST) != "1",
                                 reason=f"on request ({ON_REQUEST}=1): two builds of the default row on Docker 26 with the "
                                        "machine's clock moved, about 30-40 min on 2 cores")]
ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
DAYS_ON = 2


@contextlib.contextmanager
def clock_moved(days: int):
    """The machine's clock `days` on; put back (by the monotonic time that passed) whatever happens."""
    needs_root("setting the machine's clock")
    wall, mono = time.time(), time.monotonic()
    subprocess.run(["date", "-s", f"@{int(wall + days * 86400)}"], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["date", "-s", f"@{int(wall + time.monotonic() - mono)}"], check=True, capture_output=True)


def image_id(env: dict[str, str]) -> str:
    ref = f"{ROW.repository}-candidate:{ROW.local_name}"
    return subprocess.run([env["PYTORCH_CUDA_DOCKER"], "image", "inspect", "--format", "{{.Id}}", ref], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_another_day_and_a_moved_mirror_give_the_same_image_built_from_the_store(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    checkout = clone_at(tmp_path / "checkout", head)
    with current_engine("containerd") as engine, store_restored(engine):
        env = {**os.environ, **engine, "PYTORCH_CUDA_STATE": str(tmp_path / "state")}
        first = run_build_py(checkout, "--torch", "2.7", "--cuda", "12.1", "--no-test", "--quiet", env=env, timeout=5400)
        assert first.returncode == 0, first.stderr[-3000:]
        built = image_id(env)
        with sources_gone() as (mirror, moved), clock_moved(DAYS_ON):
            cut = {**env, **moved}
            base = run_build_py(checkout, "base", "--torch", "2.7", "--cuda", "12.1", "--rebuild", env=cut, timeout=1800)
            again = run_build_py(checkout, "--torch", "2.7", "--cuda", "12.1", "--no-test", "--no-cache", "--quiet", env=cut,
                                 timeout=5400)
            asked = list(mirror.asked)
        assert base.returncode == 0, base.stderr[-3000:]
        recorded = json.loads((checkout / "images" / ROW.name / "base.json").read_text())["linux/amd64"]["diff_id"]
        assert f"diff_id:     {recorded}" in base.stdout, base.stdout
        assert again.returncode == 0, again.stderr[-3000:]
        assert "already in the store" in again.stderr, again.stderr[-3000:]
        assert image_id(cut) == built, f"another day's build from the store is not the first: {image_id(cut)} vs {built}"
        assert asked == [], f"the build asked a mirror or an index: {asked[:5]}"
    (ROOT / "build-results").mkdir(exist_ok=True)
    (ROOT / "build-results" / "hermetic.json").write_text(json.dumps(
        {"commit": head, "image_id": built, "days_on": DAYS_ON, "base_diff_id": recorded, "mirror_requests": 0}, indent=2) + "\n")




# ---- a security relock reaches the image ---------------------------------------------------------

FIXED = "liblzma5"  # xz's library: in the base, upgraded by the apt step, pinned exactly by nothing the image holds


def _control(deb: Path) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True).stdout


def _stanza(deb: Path, d: lockfile.Deb, mirror: str) -> str:
    """The suite's index entry of a locked .deb: its control fields, and where and what it is."""
    return _control(deb).rstrip("\n") + f"\nFilename: {d.url[len(mirror.rstrip('/')) + 1:]}\nSize: {d.size}\nSHA256: {d.sha256}\n"


def _store_world(s: fetch.Store, steps: dict[str, list[lockfile.Deb]]) -> dict[tuple[str, str], list[str]]:
    """Each update suite's stanzas: every .deb the lock takes from it (those the release's index
    does not hold at that version), as read from the store."""
    release = _release(s, steps)
    held = {(f["Package"], f["Version"]) for f in release.stanzas}
    world: dict[tuple[str, str], list[str]] = {(u.mirror, u.suite): [] for u in ROW.os.updates}
    for d in {d.url: d for step in ("apt", "build") for d in steps[step]}.values():
        if (d.package, d.version) not in held:
            u = next(u for u in ROW.os.updates if d.url.startswith(u.mirror.rstrip("/") + "/pool/"))
            world[(u.mirror, u.suite)].append(_stanza(s.blob(d.sha256), d, u.mirror))
    return world


def _release(s: fetch.Store, steps: dict[str, list[lockfile.Deb]]) -> debian.Suite:
    """The release's suite from the store: the signed InRelease and the Packages.xz the lock names."""
    inrelease, packages = steps["index"]
    return debian.Suite(ROW.os.mirror, ROW.os.suite, "amd64", s.blob(inrelease.sha256).read_bytes(),
                        s.blob(packages.sha256).read_bytes(), packages.sha256)


def _relocked(monkeypatch, s: fetch.Store, steps: dict, world: dict[tuple[str, str], list[str]]) -> lock.DebianLock:
    suites = {k: debian_suite(k[0], k[1], v) for k, v in world.items()} | {(ROW.os.mirror, ROW.os.suite): _release(s, steps)}
    monkeypatch.setattr(lock.resolve_debian, "read_suite", lambda mirror, suite, arch, ca_bundle: suites[(mirror, suite)])
    return lock.debian_lock(ROW, "linux/amd64", None)


def _newer(deb: Path, version: str, tmp: Path) -> Path:
    """The same .deb at a newer version: what a security release of the package looks like to apt."""
    tree = tmp / "tree"
    subprocess.run(["dpkg-deb", "--raw-extract", str(deb), str(tree)], check=True)
    control = tree / "DEBIAN" / "control"
    control.write_text(re.sub(r"(?m)^Version: .*$", f"Version: {version}", control.read_text()))
    out = tmp / f"{FIXED}_{version}_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(tree), str(out)], check=True, capture_output=True)
    return out


def _relock_row(root: Path, new: lock.DebianLock) -> None:
    """The row's lock files in root with their Python pins and files as committed and their Debian
    files from `new`, as a relock writes them."""
    assert lock.extra_platforms(ROW) == ()
    meta, d = lock.read(root, ROW), lock.image_dir(root, ROW)
    req, ds, tk = ((d / n).read_text() for n in lock.PYTHON_LOCK_FILES)
    files = lock.render_lock(ROW, lock._unsplit(req, ds), new, (tk, meta["cuda_toolkit"]), None,
                             {k: meta[k] for k in ("wheels", "sdists", "toolkit_files")})
    lock._write_files(root, ROW, files, lambda line: None)


def test_a_security_relock_moves_exactly_that_package_and_the_image_built_from_it_carries_it(tmp_path, monkeypatch,
                                                                                             docker_client):
    s = fetch.store()
    steps = lockfile.deb_steps((lock.image_dir(ROOT, ROW) / "debs.lock").read_text())
    fetch.fetch(s.missing([d.input for step in ("index", "apt", "build") for d in steps[step]]), ca.ca_bundle(None), print,
                f"{ROW.name}'s Debian files", s)
    world = _store_world(s, steps)
    before = _relocked(monkeypatch, s, steps, world)
    assert before.text == (lock.image_dir(ROOT, ROW) / "debs.lock").read_text(), "the store's world is not the lock's"

    old = next(d for d in steps["apt"] if d.package == FIXED)
    version = f"{old.version}+relock1"
    deb = _newer(s.blob(old.sha256), version, tmp_path)
    security = next(u for u in ROW.os.updates if u.suite.endswith("-security"))
    fixed = lockfile.Deb(FIXED, version, f"{old.url.rsplit('/', 1)[0]}/{deb.name}", fetch.file_sha256(deb), deb.stat().st_size)
    world[(security.mirror, security.suite)].append(_stanza(deb, fixed, security.mirror))
    after = _relocked(monkeypatch, s, steps, world)
    changed = set(before.text.splitlines()) ^ set(after.text.splitlines())
    assert {line.split()[-1] for line in changed} == {f"{FIXED}={old.version}", f"{FIXED}={version}"} and len(changed) == 2, changed
    assert {n: v for n, v in after.installed.items() if before.installed.get(n) != v} == {FIXED: version}
    assert after.pins == before.pins  # the named packages' pins stay: the fix is a dependency's

    copy = project_copy(tmp_path / "p")
    _relock_row(copy, after)
    for args in (("lock", "--check", "--torch", "2.7", "--cuda", "12.1"), ("render",), ("render", "--check")):
        proc = run_build_py(copy, *args, timeout=600)
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
    assert lock.read(copy, ROW)["debian"][FIXED] == version

    context = tmp_path / "context"
    mine = fetch.Store(tmp_path / "store")  # the fix is in no real store: this test's own, for the apt step's folder
    for item in build.input_folders(copy, ROW)["apt"]:
        assert mine.put_file(item, deb if item.sha256 == fixed.sha256 else s.blob(item.sha256)), item.file
        (context / "inputs" / "apt").mkdir(parents=True, exist_ok=True)
        mine.stage(item, context / "inputs" / "apt" / item.file)
    ref = f"pytorch-cuda-relock:{os.getpid()}"
    with current_engine("containerd") as engine:
        env = {**os.environ, **engine}
        assert base_in_current_engine(engine, docker_client, ROW, tmp_path / "rootfs") == render.base_ref(ROW)
        docker = engine["PYTORCH_CUDA_DOCKER"]
        try:
            built = subprocess.run([docker, "buildx", "build", "--load", "--progress=plain", "--target", "base", "--network", "none",
                                    "--file", str(build.dockerfile(copy, ROW)), "--tag", ref, str(context)],
                                   env=env, capture_output=True, text=True, timeout=1800)
            assert built.returncode == 0, built.stderr[-3000:]
            held = subprocess.run([docker, "run", "--rm", "--network", "none", ref, "dpkg-query", "--show",
                                   "--showformat", "${db:Status-Abbrev}${Package}=${Version}\n"],
                                  env=env, capture_output=True, text=True, check=True).stdout.splitlines()
        finally:
            subprocess.run([docker, "image", "rm", "--force", ref], env=env, capture_output=True)
    installed = dict(line[3:].split("=", 1) for line in held if line.startswith("ii "))
    assert installed[FIXED] == version
    assert installed == after.installed, sorted(set(installed.items()) ^ set(after.installed.items()))
