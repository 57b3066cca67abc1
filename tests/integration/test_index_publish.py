"""`publish --platform all`'s index, on a real registry on 127.0.0.1 with two small images, one
per platform, built here with BuildKit (no RUN step, so no emulation). A row's real images take
the same path: the arm64 run recorded in docs/arm64.md published the 2.11 row that way."""
from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import ImmutableTagTaken, NotReady
from pytorch_cuda_build.registry import index
from pytorch_cuda_build.registry.client import Registry
from pytorch_cuda_build.stages import publish, publish_index, tag

from helpers import ROOT, shown
from registry import LocalRegistry

pytestmark = [pytest.mark.docker]

LOCK = "ab" * 32


@pytest.fixture(scope="module")
def row(tmp_path_factory) -> matrix.Image:
    """The 2.11 row under a repository of this test's own, so no real tag of the row is touched."""
    path = tmp_path_factory.mktemp("matrix") / "matrix.yaml"
    path.write_text((ROOT / "matrix.yaml").read_text().replace("repository: pytorch-cuda\n", "repository: pytorch-cuda-index-test\n", 1))
    return matrix.load(path).select("2.11", "13.0")


def build_part(tmp: Path, image: matrix.Image, content: str = "", created: str = "2026-11-25T10:00:00Z") -> str:
    """A one-file image of image.platform, tagged as that platform's image of the row, its test recorded."""
    ctx = tmp / image.arch
    ctx.mkdir(exist_ok=True)
    (ctx / "file").write_text(content or f"{image.platform}\n")
    (ctx / "Dockerfile").write_text(f'FROM scratch\nCOPY file /file\nLABEL org.opencontainers.image.created="{created}" '
                                    f'io.pytorch-cuda.lock-sha256="{LOCK}"\n')
    bc = docker_env.build_client(None)
    cmd = [*bc.argv, "--platform", image.platform, "--tag", tag.own_ref(image), str(ctx)]
    if "buildx" in bc.argv:
        cmd.insert(len(bc.argv), "--provenance=false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=docker_env.build_env(bc))
    assert proc.returncode == 0, shown(proc)
    # the engine's ID for it, not buildx's iidfile: that names the config digest, which on the
    # containerd store is not the image ID (that is the manifest digest)
    with contextlib.closing(docker_env.client()) as c:
        image_id = c.images.get(tag.own_ref(image)).id
    tag.record_pass(image, image_id, {}, "test-code")
    return image_id


@pytest.fixture(scope="module")
def images(docker_client, row, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("index-images")
    ids = {p: build_part(tmp, row.on(p)) for p in row.platforms}
    # A second name for each: tests below move a platform's own tag to another image and back, and
    # the containerd store drops an image whose last name moves away.
    kept = {p: f"{row.repository}-kept:{row.on(p).arch}" for p in row.platforms}
    for p, ref in kept.items():
        docker_client.images.get(ids[p]).tag(*ref.rsplit(":", 1))
    yield ids
    for p in row.platforms:
        docker_client.images.remove(tag.own_ref(row.on(p)), force=True)
        docker_client.images.remove(kept[p], force=True)


def run(docker_client, row, reg: LocalRegistry, namespace: str, push: bool = True) -> list[str]:
    return publish_index.publish_index(docker_client, row, Registry.parse(reg.address(namespace)), push=push, ca_bundle=None,
                                 attempts=2, backoff=0.1, log=lambda _: None)


def test_the_index_lists_each_platform_and_each_pulls_back_as_the_tested_image(docker_client, row, images, registry):
    lines = run(docker_client, row, registry, "ml")
    dated = publish.dated_tag(row, docker_client.images.get(images["linux/amd64"]).labels, "x")
    assert dated == f"{row.name}-20261125-{LOCK[:8]}"
    assert [ln.split()[0].rsplit(":", 1)[1] for ln in lines[1:-1]] == [f"{dated}-amd64", f"{dated}-arm64", dated, *row.tags]
    assert all(ln.split()[2:] == ["pushed,", "verified"] for ln in lines[1:-1]), lines
    found = registry.manifest(f"ml/{row.repository}", "v2.11")
    assert found is not None and found[1]["mediaType"] == index.INDEX
    assert sorted((m["platform"]["os"], m["platform"]["architecture"]) for m in found[1]["manifests"]) == [("linux", "amd64"), ("linux", "arm64")]
    cli = docker_env.docker_cli()
    for platform, image_id in images.items():
        ref = f"{registry.host}/ml/{row.repository}:v2.11"
        proc = subprocess.run([cli, "pull", "--quiet", "--platform", platform, ref], capture_output=True, text=True)
        assert proc.returncode == 0, shown(proc)
        pulled = docker_client.images.get(ref)
        # On the containerd store the pull keeps the index, whose inspect shows this host's
        # platform, not the one pulled: the pull by --platform succeeding is the check there.
        if docker_env.image_store(docker_client) == "classic":
            assert pulled.attrs["Architecture"] == platform.split("/")[1]
            assert pulled.id == image_id  # the config digest: the tested image itself
        docker_client.images.remove(ref)


def test_a_second_publish_pushes_nothing(docker_client, row, images, registry):
    run(docker_client, row, registry, "again")
    lines = run(docker_client, row, registry, "again")
    assert all(ln.endswith("already there") for ln in lines[1:-1]), lines


def test_a_dated_tag_holding_another_index_is_refused_before_any_push(docker_client, row, images, registry, tmp_path):
    run(docker_client, row, registry, "taken")
    moving = {t: registry.manifest(f"taken/{row.repository}", t) for t in row.tags}
    arm = row.on("linux/arm64")
    build_part(tmp_path, arm, content="other bytes, same labels: the same dated tag\n")
    try:
        with pytest.raises(ImmutableTagTaken):
            run(docker_client, row, registry, "taken")
        assert {t: registry.manifest(f"taken/{row.repository}", t) for t in row.tags} == moving
    finally:
        docker_client.images.get(images["linux/arm64"]).tag(*tag.own_ref(arm).rsplit(":", 1))


def test_a_platform_never_tested_is_one_line_and_nothing_pushed(docker_client, row, images, registry, tmp_path):
    arm = row.on("linux/arm64")
    untested = tmp_path / "untested"
    untested.mkdir()
    (untested / "Dockerfile").write_text('FROM scratch\nLABEL untested="1"\n')
    bc = docker_env.build_client(None)
    subprocess.run([*bc.argv, "--platform", arm.platform, "--tag", tag.own_ref(arm), str(untested)], check=True,
                   capture_output=True, env=docker_env.build_env(bc))
    try:
        with pytest.raises(NotReady, match="never passed its tests here; nothing pushed"):
            run(docker_client, row, registry, "untested")
        assert registry.manifest(f"untested/{row.repository}", "v2.11") is None
    finally:
        docker_client.images.get(images["linux/arm64"]).tag(*tag.own_ref(arm).rsplit(":", 1))
