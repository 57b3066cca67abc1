"""verify --image without a registry or a build: which row and commit the labels name, what a
checkout at another commit gets, an index's platform, the config fields named on a mismatch,
and exit 3 for a row that cannot be rebuilt here. The registry and the images are
tests/integration/test_verify_image.py's."""
from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.commands import verify_image
from pytorch_cuda_build.errors import BuildError, ImageUnfit, RegistryMismatch
from pytorch_cuda_build.jobs import ImageRef

from helpers import ROOT

M = matrix.load(ROOT / "matrix.yaml")
REF = ImageRef("127.0.0.1:5000/ml/pytorch-cuda", "sha256:" + "a" * 64)


def published(labels: dict, platform: str = "linux/amd64") -> verify_image.Published:
    os_, arch = platform.split("/")
    config = {"os": os_, "architecture": arch, "config": {"Labels": labels}, "rootfs": {"diff_ids": []}}
    return verify_image.Published(REF, REF.digest, "sha256:" + "b" * 64, config, platform)


LABELS = {verify_image.REVISION_LABEL: "c" * 40, verify_image.ROW_LABEL: "2.11.0-cuda13.0-runtime"}


def test_the_labels_name_the_row_on_the_images_platform():
    row = verify_image.row_of(M, published(LABELS, "linux/arm64"), "c" * 40)
    assert row.name == "2.11.0-cuda13.0-runtime" and row.platform == "linux/arm64"


@pytest.mark.parametrize("revision, says", [("d" * 40, f"this checkout is at {'d' * 40}, but"),
                                            ("c" * 40 + "-dirty", "this checkout has uncommitted changes, but")])
def test_a_checkout_at_another_commit_is_told_which_to_check_out(revision, says):
    with pytest.raises(ImageUnfit) as e:
        verify_image.row_of(M, published(LABELS), revision)
    assert str(e.value).startswith(says) and str(e.value).endswith(f"was built from {'c' * 40}: git checkout {'c' * 40}")


@pytest.mark.parametrize("labels, platform, says", [
    ({}, "linux/amd64", "has no org.opencontainers.image.revision and io.pytorch-cuda.image labels"),
    ({**LABELS, verify_image.ROW_LABEL: "9.9.9-cuda99.9-runtime"}, "linux/amd64", "names row 9.9.9-cuda99.9-runtime, which"),
    ({**LABELS, verify_image.ROW_LABEL: "2.7.1-cuda12.1-runtime"}, "linux/arm64", "is for linux/arm64, which row 2.7.1"),
])
def test_an_image_this_checkout_cannot_rebuild_is_bad_input(labels, platform, says):
    with pytest.raises(ImageUnfit) as e:
        verify_image.row_of(M, published(labels, platform), "c" * 40)
    assert says in str(e.value)


class FakeAPI:
    """Serves an index of two platforms, their manifests and configs, as skopeo would."""

    def __init__(self):
        self.blobs = {}
        manifests = []
        for arch in ("amd64", "arm64"):
            config = json.dumps({"os": "linux", "architecture": arch, "config": {}, "rootfs": {"diff_ids": []}}).encode()
            manifest = json.dumps({"mediaType": "application/vnd.oci.image.manifest.v1+json",
                                   "config": {"digest": self.put(config)}, "layers": []}).encode()
            self.configs = getattr(self, "configs", {})
            digest = self.put(manifest)
            self.configs[digest] = config
            manifests.append({"digest": digest, "platform": {"os": "linux", "architecture": arch}})
        manifests.append({"digest": "sha256:" + "f" * 64, "platform": {"os": "unknown", "architecture": "unknown"}})
        self.index = json.dumps({"mediaType": verify_image.INDEX_TYPES[0], "manifests": manifests}).encode()
        self.index_digest = self.put(self.index)

    def put(self, raw: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        self.blobs[digest] = raw
        return digest

    def raw(self, name, reference):
        return self.blobs.get(reference)

    def config(self, name, digest):
        return self.configs[digest]


def test_an_index_gives_the_platforms_image_and_says_which_platforms_it_has():
    api = FakeAPI()
    ref = ImageRef(REF.repository, api.index_digest)
    got = verify_image.read_published(api, "pytorch-cuda", ref, "linux/arm64")
    assert got.platform == "linux/arm64" and got.manifest != ref.digest
    with pytest.raises(RegistryMismatch) as e:
        verify_image.read_published(api, "pytorch-cuda", ref, "linux/ppc64le")
    assert "without linux/ppc64le (it has linux/amd64, linux/arm64, unknown/unknown); give --platform" in str(e.value)


def test_bytes_of_another_digest_are_refused():
    api = FakeAPI()
    wrong = "sha256:" + "0" * 64
    api.blobs[wrong] = api.index  # a registry (or a proxy) that serves other bytes under a digest
    with pytest.raises(RegistryMismatch, match="bytes of another digest"):
        verify_image.read_published(api, "pytorch-cuda", ImageRef(REF.repository, wrong), "linux/amd64")


def test_the_config_fields_that_differ_are_named_labels_one_by_one():
    a = {"created": "2026-01-01T00:00:00Z", "config": {"Env": ["A=1"], "Labels": {"x": "1", "y": "2"}}, "rootfs": {"diff_ids": ["1"]}}
    b = {"created": "2026-01-01T00:00:00Z", "config": {"Env": ["A=2"], "Labels": {"x": "1", "z": "3"}}, "rootfs": {"diff_ids": ["2"]}}
    assert verify_image.config_differences(a, b) == ["config.Env: ['A=1'] -> ['A=2']", "label y: '2' -> None",
                                                     "label z: None -> '3'"]


def test_a_row_that_cannot_be_rebuilt_here_is_exit_3(monkeypatch, tmp_path):
    image = M.select("2.7", "12.1")
    monkeypatch.setattr(verify_image, "base_for", lambda *a: "sha256:" + "1" * 64)

    def failing(*a, **kw):
        raise BuildError("apt-get install of the pinned Debian packages", str(tmp_path / "rebuild.log"), "E: Version '1.0' for 'tini' was not found")
    monkeypatch.setattr(verify_image.build, "run", failing)
    monkeypatch.setattr(verify_image.build, "source", lambda root: SimpleNamespace(revision="c" * 40, epoch=0))
    with pytest.raises(verify_image.NotRebuilt) as e:
        verify_image.rebuild(None, SimpleNamespace(argv=["docker"]), None, image, published(LABELS), ROOT, tmp_path, None, print)
    assert e.value.exit_code == 3 and str(e.value).startswith("could not rebuild 2.7.1-cuda12.1-runtime: ")


def test_the_same_rootfs_under_another_stores_id_says_which_engine_to_rebuild_on(monkeypatch, tmp_path):
    """A base's ID is its config digest on a classic store and its manifest digest on containerd's;
    the image's label (part of its config) names the publisher's, so a rebuild elsewhere cannot match."""
    image = M.select("2.7", "12.1")
    pub = published({**LABELS, verify_image.publish.BASE_LABEL: "sha256:" + "9" * 64})
    pub.config["rootfs"]["diff_ids"] = ["sha256:" + "5" * 64, "sha256:" + "6" * 64]
    monkeypatch.setattr(verify_image.base, "ensure", lambda *a, **kw: "sha256:" + "8" * 64)
    c = SimpleNamespace(images=SimpleNamespace(get=lambda ref: SimpleNamespace(attrs={"RootFS": {"Layers": ["sha256:" + "5" * 64]}})))
    with pytest.raises(verify_image.NotRebuilt) as e:
        verify_image.base_for(c, None, image, pub, tmp_path, "docker", ROOT, print)
    assert "the base here is the image's rootfs" in str(e.value) and "containerd: build.py engine" in str(e.value)


class Images:
    def __init__(self, held: set[str]):
        self.held = held

    def remove(self, ref, force=False):
        import docker
        if ref not in self.held:
            raise docker.errors.NotFound(ref)
        self.held.discard(ref)


@pytest.mark.parametrize("same", [True, False])
def test_the_rebuild_is_removed_when_it_is_the_published_image_and_kept_and_named_when_it_differs(same):
    rebuilt = "pytorch-cuda-verify:2.7.1-cuda12.1-runtime-published"
    client = SimpleNamespace(images=Images({rebuilt, "pytorch-cuda:v2.7"}))
    verdict = verify_image.kept_unless_same(client, rebuilt, verify_image.Verdict(same, ["verdict: ..."]))
    if same:
        assert client.images.held == {"pytorch-cuda:v2.7"} and verdict.lines == ["verdict: ..."]
    else:
        assert client.images.held == {rebuilt, "pytorch-cuda:v2.7"} and not verdict.same
        assert verdict.lines[-1] == f"the rebuild is kept as {rebuilt} (remove it with `docker image rm {rebuilt}`)"
    # one already gone (removed by hand meanwhile) is no error
    assert verify_image.kept_unless_same(SimpleNamespace(images=Images(set())), rebuilt, verify_image.Verdict(True, [])).same
