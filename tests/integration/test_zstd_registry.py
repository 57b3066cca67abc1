"""`publish --compression zstd` for real: a small row image and its base built on Docker 26 with
the containerd store (as build.py builds: an OCI export, then `docker load`), published to
Debian's docker-registry on 127.0.0.1, read back, pulled back by that engine. And on the
classic store (the 20.10 engine) the same command is one line, exit 2, with no request to the
registry."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import PublishError
from pytorch_cuda_build.registry import zstd
from pytorch_cuda_build.registry.client import ZSTD_LAYER, Registry, RegistryAPI
from pytorch_cuda_build.stages import publish, publish_index, tag

from helpers import CURRENT_ENGINE_ENV, ROOT, build_small_oci, containerd_client, one_error_line, require, shown
from registry import LocalRegistry

pytestmark = [pytest.mark.docker, pytest.mark.engine26]

LOCK = "cd" * 32
CREATED = "2026-11-25T10:00:00Z"


@pytest.fixture(scope="module")
def matrix_path(tmp_path_factory) -> Path:
    """The matrix with a repository of this test's own, so no real tag of a row is touched."""
    path = tmp_path_factory.mktemp("matrix") / "matrix.yaml"
    path.write_text((ROOT / "matrix.yaml").read_text().replace("repository: pytorch-cuda\n", "repository: pytorch-cuda-zstd-test\n", 1))
    return path


@pytest.fixture(scope="module")
def row(matrix_path) -> matrix.Image:
    return matrix.load(matrix_path).select("2.7", "12.1")


@pytest.fixture(scope="module")
def engine(docker_client):
    """An SDK client of Docker 26 with the containerd store, and the environment that points at it."""
    require(shutil.which("zstd"), "no zstd program (Debian: apt-get install zstd); publish --compression zstd uses it")
    with containerd_client() as engine:
        yield engine


def build_small(tmp: Path, name: str, dockerfile: str, platform: str = "linux/amd64") -> str:
    """A one-file image built as build.py builds on the containerd store; its image ID, the manifest digest."""
    return build_small_oci(tmp, name, dockerfile, LOCK, platform)


def config_in_export(tarball: Path, image_id: str) -> str:
    """The config digest that the build's own OCI export names for the manifest image_id."""
    with tarfile.open(tarball) as tar:
        return json.load(tar.extractfile("blobs/sha256/" + image_id.removeprefix("sha256:")))["config"]["digest"]


@pytest.fixture(scope="module")
def images(engine, row, tmp_path_factory):
    """The row's base and the row (labelled as build.py labels it, its test recorded): their IDs."""
    c, _ = engine
    tmp = tmp_path_factory.mktemp("zstd-images")
    base_ref = "pytorch-cuda-zstd-test-base:tiny"
    row_ref = tag.own_ref(row)
    base_id = build_small(tmp, base_ref, "FROM scratch\nCOPY file /base-file\n")
    row_id = build_small(tmp, row_ref, f"FROM {base_ref}\nCOPY file /file\n"
                                       f'LABEL {publish.CREATED_LABEL}="{CREATED}" {publish.LOCK_LABEL}="{LOCK}" '
                                       f'{publish.BASE_LABEL}="{base_id}"\n')
    tag.record_pass(row, row_id, {}, "test-code")
    yield {"base": base_id, "row": row_id, "row_config": config_in_export(tmp / row_ref.replace(":", "-") / "image.oci.tar", row_id)}
    for ref in (row_ref, base_ref):
        c.images.remove(ref, force=True)


def requests_seen(reg: LocalRegistry) -> list[tuple[str, str]]:
    """(method, path) of each request the registry answered, in order, from its access log lines."""
    return re.findall(r'^\S+ - \S+ \[[^]]+\] "(\w+) (\S+) HTTP/[\d.]+"', reg.log.read_text(errors="replace"), re.M)


def test_the_dated_tag_is_zstd_of_the_tested_config_and_read_back_before_any_moving_tag(engine, row, images, registry):
    c, _ = engine
    ns = "zstd"
    dated = f"{row.name}-20261125-{LOCK[:8]}"
    lines = []
    moves = publish.publish(c, [row], Registry.parse(registry.address(ns)), push=True, ca_bundle=None, attempts=2, backoff=0.1,
                            log=lines.append, compression="zstd")
    found = registry.manifest(f"{ns}/{row.repository}", dated)
    assert found is not None, lines
    digest, manifest = found
    assert [layer["mediaType"] for layer in manifest["layers"]] == [ZSTD_LAYER] * 2  # the base's file and the row's
    assert manifest["config"]["digest"] == images["row_config"] == zstd.config_digest(c, images["row"])
    assert all(registry.manifest(f"{ns}/{row.repository}", t)[0] == digest for t in row.tags)  # one manifest under every tag
    assert [mv.after.digest for mv in moves if not mv.base] == [digest] * (1 + len(row.tags))
    base = next(mv for mv in moves if mv.base)
    assert registry.manifest(f"{ns}/{base.name}", base.tag)[0] == base.image_id == images["base"]  # as the engine holds it: the rows' label
    table = publish.table(moves, Registry.parse(registry.address(ns)), True)
    assert [ln.split("  ")[-1] for ln in table[1:len(moves) + 1]] == [
        "pushed, verified" if mv.base else "pushed, verified (zstd)" for mv in moves], table
    assert publish.ZSTD_NOTE in table

    seen = requests_seen(registry)
    manifests = f"/v2/{ns}/{row.repository}/manifests/"
    put_dated = seen.index(("PUT", manifests + dated))
    read_back = next(i for i, (m, path) in enumerate(seen) if i > put_dated and m in ("GET", "HEAD") and path == manifests + dated)
    first_moving = min(seen.index(("PUT", manifests + t)) for t in row.tags)
    assert put_dated < read_back < first_moving, seen
    uploads = [i for i, (m, path) in enumerate(seen) if m == "POST" and path.startswith(f"/v2/{ns}/{row.repository}/blobs/uploads/")]
    assert uploads and max(uploads) < put_dated, seen  # the moving tags' copies send no blob again


def test_the_zstd_tag_pulls_back_on_the_containerd_store_as_the_tested_config(engine, row, images, registry):
    c, env = engine
    reg = Registry.parse(registry.address("pull"))
    publish.publish(c, [row], reg, push=True, ca_bundle=None, attempts=2, backoff=0.1, log=lambda _: None, compression="zstd")
    ref = f"{reg.repository(row)}:{row.tags[0]}"
    proc = subprocess.run([env["PYTORCH_CUDA_DOCKER"], "pull", "--quiet", ref], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, shown(proc)
    try:
        pulled, local = c.images.get(ref), c.images.get(images["row"])
        assert pulled.id == registry.manifest(f"pull/{row.repository}", row.tags[0])[0] != local.id  # the zstd manifest
        assert zstd.config_digest(c, pulled.id) == images["row_config"]  # the same config: the same image
        assert pulled.attrs["RootFS"] == local.attrs["RootFS"] and pulled.labels == local.labels
    finally:
        c.images.remove(ref)


def test_a_second_run_pushes_nothing_and_a_gzip_run_keeps_the_zstd_tags(engine, row, images, registry):
    c, _ = engine
    reg = Registry.parse(registry.address("again"))
    first = publish.publish(c, [row], reg, push=True, ca_bundle=None, attempts=2, backoff=0.1, log=lambda _: None, compression="zstd")
    for compression in ("zstd", "gzip"):
        before = len(requests_seen(registry))
        moves = publish.publish(c, [row], reg, push=True, ca_bundle=None, attempts=2, backoff=0.1, log=lambda _: None,
                                compression=compression)
        assert all(mv.in_place for mv in moves) and [mv.after for mv in moves] == [mv.after for mv in first]
        assert not [r for r in requests_seen(registry)[before:] if r[0] in ("PUT", "POST", "PATCH")]


def test_a_read_back_that_is_not_zstd_leaves_every_moving_tag_where_it_was(engine, row, images, registry, monkeypatch):
    """The dated tag read back as gzip (skopeo 1.9's own recompression does that when the
    repository holds the gzip blob): the run stops there."""
    c, _ = engine
    reg = Registry.parse(registry.address("halt"))
    real = RegistryAPI.manifest

    def gzip_read_back(self, image, tag, repository=None):
        remote = real(self, image, tag, repository)
        if remote is not None and tag.endswith(LOCK[:8]):
            return type(remote)(remote.digest, remote.config, ("application/vnd.oci.image.layer.v1.tar+gzip",) * len(remote.layers))
        return remote
    monkeypatch.setattr(RegistryAPI, "manifest", gzip_read_back)
    with pytest.raises(PublishError, match="does not match the push") as e:
        publish.publish(c, [row], reg, push=True, ca_bundle=None, attempts=1, backoff=0.1, log=lambda _: None, compression="zstd")
    assert all(registry.manifest(f"halt/{row.repository}", t) is None for t in row.tags), e.value.lines()


def test_an_index_of_zstd_parts_names_each_platforms_tested_config(engine, matrix_path, registry, tmp_path):
    """publish --platform all with zstd: each platform's part in zstd, then the index of the parts."""
    c, _ = engine
    row = matrix.load(matrix_path).select("2.11", "13.0")
    labels = f'LABEL {publish.CREATED_LABEL}="{CREATED}" {publish.LOCK_LABEL}="{LOCK}"\n'
    configs, made = {}, []
    try:
        for platform in row.platforms:
            image, ref = row.on(platform), tag.own_ref(row.on(platform))
            image_id = build_small(tmp_path, ref, f"FROM scratch\nCOPY file /file\n{labels}", platform)
            made.append(ref)
            tag.record_pass(image, image_id, {}, "test-code")
            configs[platform] = config_in_export(tmp_path / ref.replace(":", "-") / "image.oci.tar", image_id)
        lines = publish_index.publish_index(c, row, Registry.parse(registry.address("index")), push=True, ca_bundle=None, attempts=2,
                                      backoff=0.1, log=lambda _: None, compression="zstd")
        assert [ln.split("  ")[-1] for ln in lines[1:3]] == ["pushed, verified (zstd)"] * 2, lines
        _, index = registry.manifest(f"index/{row.repository}", row.tags[0])
        for entry in index["manifests"]:
            _, part = registry.manifest(f"index/{row.repository}", entry["digest"])
            platform = f"{entry['platform']['os']}/{entry['platform']['architecture']}"
            assert part["config"]["digest"] == configs[platform] and [m["mediaType"] for m in part["layers"]] == [ZSTD_LAYER]
        assert sorted(configs) == sorted(f"{e['platform']['os']}/{e['platform']['architecture']}" for e in index["manifests"])
    finally:
        for ref in made:
            c.images.remove(ref, force=True)


def test_on_the_classic_store_zstd_is_one_line_and_the_registry_hears_nothing(docker_client, matrix_path, registry):
    assert docker_env.image_store(docker_client) == "classic"  # the 20.10 engine
    before = len(requests_seen(registry))
    env = {k: v for k, v in os.environ.items() if k not in CURRENT_ENGINE_ENV}  # as before `eval "$(build.py engine)"`
    proc = subprocess.run([sys.executable, str(ROOT / "build.py"), "--matrix", str(matrix_path), "publish", "--torch", "2.7",
                           "--registry", registry.address("classic"), "--push", "--compression", "zstd"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    one_error_line(proc, 2, 'needs Docker\'s containerd image store')
    assert 'eval "$(python3 build.py engine)"' in proc.stderr and proc.stdout == ""
    assert requests_seen(registry)[before:] == [] and "classic/pytorch-cuda-zstd-test" not in registry.catalog()
