"""A current Docker Engine beside 20.10 (`build.py engine`): trixie's Docker 26 with buildx and
the containerd image store comes up from Debian's signed packages, starts containers on a
bridge of its own, and leaves the 20.10 engine and its docker0 working. The same engine with
the classic image store builds with `--load`, saves in its OCI layout and publishes under the
config digest."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.commands import verify
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.registry import client as registry
from pytorch_cuda_build.stages import publish
from pytorch_cuda_build.tooling import engine_current

from helpers import ROOT, base_in_current_engine, current_engine, run_build_py
from registry import LocalRegistry, require_binary

pytestmark = [pytest.mark.docker, pytest.mark.engine26]

ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")


@pytest.fixture(scope="module")
def current():
    with current_engine() as env:
        yield env


@pytest.fixture(scope="module")
def classic():
    with current_engine("classic") as env:
        yield env


def cli(env: dict[str, str], *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([env["PYTORCH_CUDA_DOCKER"], *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600, **kw)


def test_docker_26_with_buildx_and_the_containerd_store_answers_beside_20_10(current, docker_client):
    info = json.loads(cli(current, "info", "--format", "{{json .}}").stdout)
    assert info["ServerVersion"].startswith("26."), info["ServerVersion"]
    assert ["driver-type", "io.containerd.snapshotter.v1"] in info["DriverStatus"]
    assert info["DockerRootDir"] == str(engine_current.STORES["containerd"].state / "docker")
    assert "0.13" in cli(current, "buildx", "version").stdout
    assert docker_client.version()["Version"].startswith("20.10")  # the SDK's default daemon is still 20.10
    assert Path("/sys/class/net/docker0").exists()


def test_asking_again_finds_it_up_and_prints_the_same(current):
    proc = run_build_py(ROOT, "engine", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "starting dockerd" not in proc.stderr
    assert engine_current.exports(current) == proc.stdout


def test_containers_start_on_both_engines_each_on_its_own_bridge(current, docker_client, tmp_path):
    ref = base_in_current_engine(current, docker_client, ROW, tmp_path)
    new = cli(current, "run", "--rm", ref, "hostname", "-I")
    assert new.returncode == 0, new.stderr
    assert new.stdout.split()[0].startswith("172.30.213."), new.stdout  # pcb-ctrd0's subnet
    old = docker_client.containers.run(ref, ["hostname", "-I"], remove=True).decode()
    assert old.split()[0].startswith("172.17."), old  # docker0, untouched


def test_a_layer_cached_before_a_commit_exports_as_a_cold_build_of_it_does(current, docker_client, tmp_path, monkeypatch):
    """build.py's SOURCE_DATE_EPOCH is one fixed time, so a warm cache (CI's) and a cold rebuild
    give one digest. With a commit's time instead, a layer cached before the commit keeps its
    build-time file times (rewrite-timestamp clamps only later ones) while a cold build clamps
    them: the second half shows that this engine does so."""
    ref = base_in_current_engine(current, docker_client, ROW, tmp_path / "base")
    for key, value in current.items():
        monkeypatch.setenv(key, value)
    bc = docker_env.build_client()
    assert bc.export == "oci", bc
    context = tmp_path / "context"
    context.mkdir()
    # a step no earlier run cached: every build below starts from this test's own cache
    (context / "Dockerfile").write_text(f"FROM {ref}\nRUN echo {uuid.uuid4().hex} > /made && mkdir /made.d\n")

    def digest(name: str, epoch: int, *flags: str) -> str:
        out = tmp_path / f"{name}.oci.tar"
        cmd = [*bc.argv, *flags, *(["--network", bc.network] if bc.network else []), "--provenance=false",
               "--output", f"type=oci,dest={out},rewrite-timestamp=true", str(context)]
        proc = subprocess.run(cmd, env={**docker_env.build_env(bc), "SOURCE_DATE_EPOCH": str(epoch)},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        with tarfile.open(out) as tar:
            return json.load(tar.extractfile("index.json"))["manifests"][0]["digest"]

    ours = int(docker_env.build_env(bc)["SOURCE_DATE_EPOCH"])
    assert ours == matrix.REPRODUCIBLE_EPOCH
    cached = digest("cache", ours)
    time.sleep(2)  # a later commit: the cache above is older than it
    assert digest("warm", ours) == digest("cold", ours, "--no-cache") == cached
    time.sleep(2)
    commit_time = int(time.time()) - 1  # after every build above, before the next
    assert digest("warm-commit", commit_time) != digest("cold-commit", commit_time, "--no-cache")


def test_on_the_classic_store_the_image_id_is_the_config_digest_from_build_to_save_to_push(
        classic, docker_client, tmp_path, monkeypatch):
    """Docker 26 with the classic store, the third column of the README's engine table: buildx
    loads the image (no OCI export there), `docker save` writes the OCI layout with plain tar
    layers, and publish's read-back matches the image ID with the registry's config digest,
    where the containerd store's rule (the manifest digest) would call it another image."""
    require_binary()
    ref = base_in_current_engine(classic, docker_client, ROW, tmp_path / "base")
    for key, value in classic.items():
        monkeypatch.setenv(key, value)
    bc = docker_env.build_client()
    assert bc.export == "load" and "--load" in bc.argv, bc
    c = docker_env.client()
    assert docker_env.image_store(c) == "classic"
    context, made = tmp_path / "context", uuid.uuid4().hex
    context.mkdir()
    (context / "Dockerfile").write_text(f"FROM {ref}\nRUN echo {made} > /made\n")
    name, iid = f"pcb-classic-test:{made[:12]}", tmp_path / "iid"
    proc = subprocess.run([*bc.argv, *(["--network", bc.network] if bc.network else []), "--iidfile", str(iid),
                           "-t", name, str(context)], env=docker_env.build_env(bc), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    image_id = iid.read_text().strip()
    reg = LocalRegistry(tmp_path / "registry").start()
    try:
        assert c.images.get(name).id == image_id
        layers = verify.layer_index(name, docker_cli=classic["PYTORCH_CUDA_DOCKER"])
        assert len(layers) == len(c.images.get(name).attrs["RootFS"]["Layers"]) >= 2
        assert layers[-1]["made"][0][5] == hashlib.sha256(f"{made}\n".encode()).hexdigest()
        target = registry.Registry.parse(reg.address("classic"))
        mv = publish.Move(ROW, image_id, f"classic-{made[:8]}", immutable=False, by_manifest=False)
        pushed = publish.push_one(c, mv, target, None)
        remote = registry.RegistryAPI(target, None, None).manifest(ROW, mv.tag)
        assert remote is not None and remote.digest == pushed, (remote, pushed)
        assert remote.config == image_id and mv.holds(remote)
        assert remote.digest != image_id and not dataclasses.replace(mv, by_manifest=True).holds(remote)
    finally:
        reg.stop()
        c.images.remove(name, noprune=False)
        c.close()


# The whole pipeline on Docker 26 with the containerd store (build, smoke, structure, tag,
# publish, pull back by digest) is the workflow replay's: tests/integration/test_workflow_replay.py.


def test_a_base_written_around_a_rootfs_has_one_image_id_per_store_wherever_it_is_written(
        current, classic, docker_client, tmp_path):
    """The local base's image (stages/base.py): the rootfs tarball as its one layer under fixed
    config bytes. Written twice, in two directories under two umasks, it loads as one image on
    Docker 26's containerd store; on the classic stores (20.10's and 26's) its ID is the config's
    digest; its one diff_id is the tarball's sha256 on all three."""
    from pytorch_cuda_build.stages import base

    tarball = tmp_path / "rootfs.tar"
    with tarfile.open(tarball, "w") as tar:
        info = tarfile.TarInfo("./etc/motd")
        data = uuid.uuid4().hex.encode()  # a tree no other run has loaded
        info.size, info.mtime = len(data), 1767225600
        tar.addfile(info, io.BytesIO(data))
    diff_id = "sha256:" + hashlib.sha256(tarball.read_bytes()).hexdigest()
    config_digest = "sha256:" + hashlib.sha256(base.image_config(ROW, diff_id)).hexdigest()
    ref = f"pcb-base-test:{uuid.uuid4().hex[:12]}"

    def load(env: dict | None, mask: int) -> dict:
        folder = tmp_path / f"written-{uuid.uuid4().hex[:6]}"
        folder.mkdir()
        old = os.umask(mask)
        try:
            base.write_archive(folder / "image.tar", tarball, ref, ROW)
        finally:
            os.umask(old)
        docker = env["PYTORCH_CUDA_DOCKER"] if env else "/usr/bin/docker"
        run_env = {**os.environ, **(env or {})}
        loaded = subprocess.run([docker, "load", "--input", str(folder / "image.tar")], env=run_env, capture_output=True, text=True)
        assert loaded.returncode == 0, loaded.stderr
        attrs = json.loads(subprocess.run([docker, "image", "inspect", ref], env=run_env, capture_output=True, text=True).stdout)[0]
        subprocess.run([docker, "image", "rm", "--force", ref], env=run_env, capture_output=True)
        return attrs

    first, second = load(current, 0o022), load(current, 0o077)
    assert first["Id"] == second["Id"] and first["RootFS"]["Layers"] == [diff_id]
    assert first["Created"].startswith("2026-01-01T00:00:00")
    for env in (None, classic):  # 20.10's classic store, then 26's
        attrs = load(env, 0o022)
        assert attrs["Id"] == config_digest and attrs["RootFS"]["Layers"] == [diff_id]
