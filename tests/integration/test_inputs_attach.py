"""The locked files attached beside a published image (registry/attach.py, `publish --attach-inputs`)
against a registry on 127.0.0.1, on a small image and a few files: one layer per file whose digest
is the lock's sha256, found by the referrers fallback tag; then a store on another "machine" filled
from the registry alone (`fetch --from-image`), and an image with none attached said so."""
from __future__ import annotations

import hashlib

import pytest

from pytorch_cuda_build.commands import verify_image
from pytorch_cuda_build.jobs import parse_image
from pytorch_cuda_build.registry import attach
from pytorch_cuda_build.stages import fetch
from pytorch_cuda_runtime.lockfile import Input

from registry import push_small, small_published

pytestmark = [pytest.mark.docker]



@pytest.fixture(scope="module")
def published(tmp_path_factory, docker_client):
    tmp = tmp_path_factory.mktemp("inputs")
    with small_published(tmp, "inputs") as (reg, api, digest, local):
        yield {"reg": reg, "api": api, "digest": digest, "tmp": tmp, "local": local}


def stored(store: fetch.Store, name: str, data: bytes, url: str) -> Input:
    item = Input(name, url, hashlib.sha256(data).hexdigest(), len(data))
    source = store.root.parent / f"src-{name}"
    source.write_bytes(data)
    assert store.put_file(item, source)
    return item


def test_the_inputs_are_layers_by_the_locks_hashes_and_fill_another_store(published, monkeypatch):
    reg, api, digest, tmp = published["reg"], published["api"], published["digest"], published["tmp"]
    here = fetch.Store(tmp / "here" / "store")
    (tmp / "here").mkdir(exist_ok=True)
    deb = stored(here, "tini_0.19.0-1+b3_amd64.deb", b"a deb " * 1000, "http://deb.debian.org/debian/pool/main/t/tini/tini_0.19.0-1+b3_amd64.deb")
    index = stored(here, "InRelease", b"signed index", "http://deb.debian.org/debian/dists/bookworm/InRelease")
    found = attach.attach_inputs(api, "pytorch-cuda", digest, [deb, index], lambda i: here.blob(i.sha256))
    _, manifest = reg.manifest("ml/pytorch-cuda", found)
    assert manifest["subject"]["digest"] == digest and manifest["artifactType"] == attach.INPUTS.artifact_type
    layers = {layer["annotations"]["org.opencontainers.image.title"]: layer for layer in manifest["layers"]}
    assert layers[deb.file]["digest"] == f"sha256:{deb.sha256}" and layers[deb.file]["mediaType"] == attach.DEB
    assert layers[index.file]["annotations"][attach.URL_ANNOTATION] == index.url
    _, listed = reg.manifest("ml/pytorch-cuda", attach.fallback_tag(digest))
    assert found in [m["digest"] for m in listed["manifests"]]

    elsewhere = fetch.Store(tmp / "elsewhere" / "store")  # another machine: an empty store, no mirror
    monkeypatch.setattr(fetch, "store", lambda: elsewhere)
    ref = parse_image(f"{reg.address('ml')}/pytorch-cuda@{digest}")
    lines: list[str] = []
    assert verify_image.fill_store(ref, [deb, index], None, lines.append) == 2
    assert elsewhere.blob(deb.sha256).read_bytes() == b"a deb " * 1000 and elsewhere.has(index)
    assert lines == [f"fetch: the files attached beside {ref}", f"fetch: took 2 files from {lines[1].split(' from ')[1]}"]


def test_an_image_without_inputs_attached_says_so_and_fills_nothing(published, monkeypatch, tmp_path):
    reg = published["reg"]
    bare = push_small(published["local"], f"{reg.address('ml')}/other:bare")  # the image again, nothing attached there
    store = fetch.Store(tmp_path / "store")
    monkeypatch.setattr(fetch, "store", lambda: store)
    item = Input("a.deb", "http://deb.example/a.deb", "0" * 64, 1)
    lines: list[str] = []
    ref = parse_image(f"{reg.address('ml')}/other@{bare}")
    assert verify_image.fill_store(ref, [item], None, lines.append) == 0
    assert lines == [f"fetch: {ref} has no inputs attached (published with --attach-inputs none, or before they were)"]
