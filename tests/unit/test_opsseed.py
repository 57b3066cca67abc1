"""The host's ops seed (opsseed): what a --no-cache build gets in its context, and how an
exported ops-dist is filed. Pure: no daemon, no network; the store is the tests' own state dir."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix, paths
from pytorch_cuda_build.buildkit import opsseed
from pytorch_cuda_build.errors import BuildError
from pytorch_cuda_build.stages import build

ROOT = Path(__file__).resolve().parents[2]
M = matrix.load(ROOT / "matrix.yaml")
ROW = M.select("2.7", "12.1")
TWIN = M.select("2.7", "12.6")


@pytest.fixture(autouse=True)
def own_store(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")


def exported(key: str = "a" * 64, wheel: bytes = b"wheel") -> Path:
    d = opsseed.export_dir()
    (d / "deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl").write_bytes(wheel)
    (d / "ops-facts.json").write_text("{}\n")
    (d / opsseed.KEY_FILE).write_text(key + "\n")
    return d


def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / opsseed.CONTEXT_DIR).mkdir(parents=True)
    return ctx


def test_a_normal_build_gets_an_empty_seed_whatever_the_host_has(tmp_path):
    opsseed.save(exported(), ROW)
    ctx = context(tmp_path)
    assert opsseed.stage(ROW, ctx, use=False) is None
    assert list((ctx / opsseed.CONTEXT_DIR).iterdir()) == []


def test_a_no_cache_build_gets_the_images_last_wheel_hard_linked(tmp_path):
    key = opsseed.save(exported(wheel=b"built once"), ROW)
    ctx = context(tmp_path)
    assert opsseed.stage(ROW, ctx, use=True) == key
    staged = ctx / opsseed.CONTEXT_DIR / key / "deepspeed-0.17.6-cp311-cp311-linux_x86_64.whl"
    assert staged.read_bytes() == b"built once"
    assert os.stat(staged).st_ino == os.stat(opsseed.store() / "wheels" / key / staged.name).st_ino


def test_nothing_exported_yet_means_an_empty_seed(tmp_path):
    ctx = context(tmp_path)
    assert opsseed.stage(ROW, ctx, use=True) is None
    assert list((ctx / opsseed.CONTEXT_DIR).iterdir()) == []


def test_rows_share_an_entry_and_an_entry_no_image_names_is_dropped():
    opsseed.save(exported("a" * 64), ROW)
    opsseed.save(exported("a" * 64), TWIN)
    assert sorted(p.name for p in (opsseed.store() / "wheels").iterdir()) == ["a" * 64]
    opsseed.save(exported("b" * 64), ROW)
    assert sorted(p.name for p in (opsseed.store() / "wheels").iterdir()) == ["a" * 64, "b" * 64]  # TWIN's still
    opsseed.save(exported("b" * 64), TWIN)
    assert sorted(p.name for p in (opsseed.store() / "wheels").iterdir()) == ["b" * 64]
    assert not [p for p in opsseed.store().iterdir() if p.name.startswith(".export-")]  # exports consumed


@pytest.mark.parametrize("spoil", ["no key", "bad key", "no facts", "two wheels"])
def test_an_export_that_is_not_one_wheel_facts_and_key_is_refused_and_files_nothing(spoil):
    d = exported()
    if spoil == "no key":
        (d / opsseed.KEY_FILE).unlink()
    elif spoil == "bad key":
        (d / opsseed.KEY_FILE).write_text("../../etc\n")
    elif spoil == "no facts":
        (d / "ops-facts.json").unlink()
    else:
        (d / "deepspeed-0.17.7-cp311-cp311-linux_x86_64.whl").write_bytes(b"other")
    with pytest.raises(BuildError, match="exporting the compiled ops"):
        opsseed.save(d, ROW)
    assert not (opsseed.store() / "images" / ROW.name).exists()
    assert list((opsseed.store() / "wheels").iterdir()) == []


class FakeClient:
    argv = ("docker", "build")
    network = "host"


def test_the_export_builds_ops_dist_to_a_directory_and_never_writes_the_rows_cache(tmp_path):
    cmd = build.export_command(FakeClient(), ROOT, ROW, tmp_path / "ctx", tmp_path / "out", "/ca.pem",
                               ["--cache-from", "type=registry,ref=r/c:x", "--cache-to", "type=registry,ref=r/c:x,mode=max"])
    assert cmd[:2] == ["docker", "build"] and cmd[-1] == str(tmp_path / "ctx")
    assert cmd[cmd.index("--target") + 1] == "ops-dist"
    assert cmd[cmd.index("--output") + 1] == f"type=local,dest={tmp_path / 'out'}"
    assert cmd[cmd.index("--cache-from") + 1] == "type=registry,ref=r/c:x" and "--cache-to" not in cmd
    assert "--secret" not in cmd and cmd[cmd.index("--network") + 1] == "none"  # every file it reads is in the context


def test_every_dockerfile_binds_the_seed_and_has_the_ops_dist_stage():
    for image in M.images:
        text = (ROOT / "images" / image.name / "Dockerfile").read_text()
        assert "--mount=type=bind,source=ops-seed,target=/opsseed" in text and "--seed /opsseed" in text, image.name
        assert "FROM scratch AS ops-dist\nCOPY --from=ops-builder /dist /\n" in text, image.name


def test_the_staged_context_has_an_empty_seed(tmp_path, monkeypatch):
    from helpers import NamesOnlyStore
    monkeypatch.setattr(build.fetch, "store", lambda: NamesOnlyStore(tmp_path / "store"))
    build.stage_context(ROOT, ROW, tmp_path)
    assert list((tmp_path / opsseed.CONTEXT_DIR).iterdir()) == []


def test_a_clean_up_drops_the_pointers_of_other_images_and_what_no_kept_pointer_names():
    pointers = {"row-a": "k1", "row-b": "k2", "gone-row": "k3", "twin": "k1"}
    assert opsseed.unnamed(pointers, ["k1", "k2", "k3", "k4"], {"row-a", "row-b", "twin"}) == (["gone-row"], ["k3", "k4"])
    assert opsseed.unnamed(pointers, ["k1", "k2"], {"row-a"}) == (["gone-row", "row-b", "twin"], ["k2"])
    assert opsseed.unnamed({}, [], {"row-a"}) == ([], [])


def test_prune_keeps_what_an_image_names_and_says_what_it_freed():
    opsseed.save(exported("a" * 64, wheel=b"kept"), ROW)
    opsseed.save(exported("b" * 64, wheel=b"x" * 1000), TWIN)
    orphan = opsseed.store() / "wheels" / ("c" * 64)  # left by a build killed between filing and pointing
    orphan.mkdir()
    (orphan / "deepspeed.whl").write_bytes(b"y" * 500)
    dropped, freed = opsseed.prune({ROW.name})
    assert dropped == 2 and freed == len(b"x" * 1000) + len("{}\n") + len("b" * 64 + "\n") + 500
    assert [p.name for p in (opsseed.store() / "wheels").iterdir()] == ["a" * 64]
    assert [p.name for p in (opsseed.store() / "images").iterdir()] == [ROW.name]
    assert opsseed.prune({ROW.name}) == (0, 0)


def test_prune_of_an_empty_host_drops_nothing():
    assert opsseed.prune({ROW.name}) == (0, 0)


class FakeImages:
    def __init__(self, tags: list[list[str]]) -> None:
        self._images = [type("Img", (), {"tags": t})() for t in tags]

    def list(self, **kw):
        return self._images


def test_builds_prune_keeps_the_matrix_rows_and_rows_whose_image_is_still_local():
    """A row the matrix no longer has keeps its entry while an image of it is on the daemon."""
    opsseed.save(exported("a" * 64), ROW)
    opsseed.save(exported("b" * 64), TWIN)
    c = type("C", (), {"images": FakeImages([[f"other-repo:{TWIN.name}", "other-repo:v2.7"], []])})()
    assert build.prune_ops_seed(c, {ROW.name}) == (0, 0)
    c = type("C", (), {"images": FakeImages([["registry.example:5000/ns/x:latest"]])})()
    assert build.prune_ops_seed(c, {ROW.name})[0] == 1
    assert [p.name for p in (opsseed.store() / "wheels").iterdir()] == ["a" * 64]


def test_the_prune_command_says_how_many_entries_it_dropped_and_their_size(monkeypatch, capsys):
    from types import SimpleNamespace

    from pytorch_cuda_build import cli
    opsseed.save(exported("a" * 64), ROW)
    gone = M.images[-1] if M.images[-1].name != ROW.name else M.images[0]
    opsseed.save(exported("b" * 64, wheel=b"z" * (3 * 2**20)), gone)
    m = SimpleNamespace(repository=M.repository, images=[i for i in M.images if i.name != gone.name])
    c = type("C", (), {"images": FakeImages([])})()
    monkeypatch.setattr(cli.docker_env, "ensure_engine", lambda log: c)
    monkeypatch.setattr(cli.docker_env, "build_client", lambda override: None)
    monkeypatch.setattr(cli.build, "prune", lambda bc, c, repository, keep: 0)
    assert cli.cmd_prune(m, SimpleNamespace(keep_storage="40GB")) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "dropped 1 ops-seed entry no image names, 3.0 MiB"
    assert [p.name for p in (opsseed.store() / "wheels").iterdir()] == ["a" * 64]


def test_a_killed_runs_export_is_removed_by_the_next_and_a_live_ones_kept(tmp_path):
    """A SIGKILL mid-export leaves .export-<pid>-*; the next export removes it once that process is
    gone, and never one of a process that runs (another row's build exporting beside it)."""
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        opsseed.store().mkdir(parents=True)
        left = opsseed.store() / f".export-{gone.pid}-abc"
        beside = opsseed.store() / f".export-{live.pid}-def"
        for d in (left, beside):
            (d / "half").mkdir(parents=True)
        fresh = opsseed.export_dir()
        assert not left.exists() and beside.is_dir() and fresh.name.startswith(f".export-{os.getpid()}-")
    finally:
        live.kill()
        live.wait()


def test_a_full_disk_while_filing_an_export_is_one_line_and_leaves_the_old_pointer(monkeypatch):
    from pytorch_cuda_build import files
    from pytorch_cuda_build.errors import EnvironmentProblem

    first = opsseed.save(exported("a" * 64), ROW)
    pointer = next((opsseed.store()).rglob(ROW.local_name))
    real = files._stage

    def full(path, text):
        if path == pointer:
            raise OSError(28, "No space left on device")
        return real(path, text)
    monkeypatch.setattr(files, "_stage", full)
    with pytest.raises(EnvironmentProblem, match="no space left on device writing .*; nothing was changed"):
        opsseed.save(exported("b" * 64), ROW)
    assert pointer.read_text() == first + "\n"
    assert not [p for p in pointer.parent.iterdir() if p.name.startswith(".")]  # no temp file left


def test_a_full_disk_during_the_ops_export_is_one_line(monkeypatch, tmp_path):
    from pytorch_cuda_build.errors import EnvironmentProblem

    def export(cmd, env, log_path, echo):
        log_path.write_text("#12 exporting to client directory\n#12 ERROR: write /x/deepspeed.whl: no space left on device\n")
        return 1
    monkeypatch.setattr(build, "_stream", export)
    bc = type("B", (), {"argv": ("docker", "build"), "env": {}, "network": None})()
    with pytest.raises(EnvironmentProblem, match="no space left on device exporting the compiled ops .* no tag was moved"):
        build.export_ops(bc, ROOT, ROW, tmp_path, {}, None, (), tmp_path / "ops-export.log")
    assert not list(opsseed.store().glob(".export-*"))  # the half export removed


def test_a_full_disk_during_the_ops_export_on_buildx_is_one_line_too(monkeypatch, tmp_path):
    """buildx on the containerd store logs only `error from receiver: context canceled` when the
    client's write fails: the fault tier's disk scenario on Docker 26 met it as exit 1."""
    import collections

    from pytorch_cuda_build.errors import EnvironmentProblem

    def export(cmd, env, log_path, echo):
        log_path.write_text("#41 exporting to client directory\n#41 CANCELED\nERROR: failed to solve: error from receiver: context canceled\n")
        return 1
    monkeypatch.setattr(build, "_stream", export)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(build.shutil, "disk_usage", lambda p: usage(10**9, 10**9, 4096))
    bc = type("B", (), {"argv": ("docker", "buildx", "build"), "env": {}, "network": None})()
    with pytest.raises(EnvironmentProblem, match="no space left on device exporting the compiled ops .* no tag was moved"):
        build.export_ops(bc, ROOT, ROW, tmp_path, {}, None, (), tmp_path / "ops-export.log")
    monkeypatch.setattr(build.shutil, "disk_usage", lambda p: usage(10**12, 0, 10**12))
    with pytest.raises(BuildError):  # room enough: a failed export, not a full disk
        build.export_ops(bc, ROOT, ROW, tmp_path, {}, None, (), tmp_path / "ops-export.log")
