"""`publish --compression zstd` without a daemon: the image's zstd form made from an export like
Docker 26's (the config kept byte for byte, every layer zstd and holding the diff its config
names), what may and may not be pushed, and the order of a run on a registry held in memory
(the dated tag pushed and read back before any moving tag is copied to its manifest)."""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import requests

from pytorch_cuda_build import arguments, matrix
from pytorch_cuda_build.errors import EnvironmentProblem, ImmutableTagTaken, PublishError
from pytorch_cuda_build.registry import client as registry
from pytorch_cuda_build.registry import retry, zstd
from pytorch_cuda_build.stages import publish

from helpers import ROOT, ExportingEngine, layer_tar, oci_export, require

ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
DATED = "2.7.1-cuda12.1-runtime-20261122-7904bf67"
LABELS = {publish.CREATED_LABEL: "2026-11-22T23:59:59Z", publish.LOCK_LABEL: "7904bf67" + "0" * 56}
LAYERS = [layer_tar({"etc/os-release": b"ID=debian\n"}), layer_tar({"opt/venv/big": bytes(range(256)) * 4096})]
NOISE = hashlib.shake_256(b"noise").digest(8 << 20)  # 8 MiB that gzip cannot shrink


@pytest.fixture(scope="module")
def image():
    return oci_export(LAYERS, labels=LABELS)


@pytest.fixture
def has_zstd():
    require(shutil.which("zstd"), "no zstd program (Debian: apt-get install zstd); publish --compression zstd uses it")


def unzstd(data: bytes) -> bytes:
    return subprocess.run(["zstd", "-d", "-c"], input=data, capture_output=True, check=True).stdout


def sha(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


# ---- the zstd form --------------------------------------------------------------------------

@pytest.mark.parametrize("media", ["oci", "docker"])
def test_the_zstd_form_keeps_the_config_and_every_layer_holds_its_diff(has_zstd, image, tmp_path, media):
    img = image if media == "oci" else oci_export(LAYERS, media="docker", labels=LABELS)
    layout = zstd.write_layout(ExportingEngine({img.image_id: img.tar}), img.image_id, tmp_path)

    def blob(digest: str) -> bytes:
        return (tmp_path / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()
    raw = blob(layout.digest)
    assert sha(raw) == layout.digest
    manifest = json.loads(raw)
    assert manifest["mediaType"] == zstd.OCI_MANIFEST
    assert manifest["config"] == {"mediaType": zstd.OCI_CONFIG, "digest": img.config, "size": len(img.blobs[img.config])}
    assert layout.config == img.config and blob(img.config) == img.blobs[img.config]  # the same bytes: the same image
    assert [m["mediaType"] for m in manifest["layers"]] == [registry.ZSTD_LAYER] * len(LAYERS)
    for descriptor, tar in zip(manifest["layers"], LAYERS):
        data = blob(descriptor["digest"])
        assert sha(data) == descriptor["digest"] and len(data) == descriptor["size"] and data[:4] == b"\x28\xb5\x2f\xfd"
        assert unzstd(data) == tar
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["manifests"] == [{"mediaType": zstd.OCI_MANIFEST, "digest": layout.digest, "size": len(raw),
                                   "annotations": {"org.opencontainers.image.ref.name": zstd.REF_NAME}}]


def test_the_zstd_form_is_the_same_bytes_each_time(has_zstd, image, tmp_path):
    engine = ExportingEngine({image.image_id: image.tar})
    assert zstd.write_layout(engine, image.image_id, tmp_path / "a").digest == zstd.write_layout(engine, image.image_id, tmp_path / "b").digest


def _tampered(image, old: bytes, new: bytes) -> bytes:
    assert image.tar.count(old) == 1
    return image.tar.replace(old, new)


def test_an_export_that_is_not_the_tested_image_is_refused(has_zstd, image, tmp_path):
    other = oci_export(LAYERS[:1], labels=LABELS)
    with pytest.raises(PublishError, match="lacks"):  # asked for one image, served another's blobs
        zstd.write_layout(ExportingEngine({image.image_id: other.tar}), image.image_id, tmp_path / "other")
    config = image.blobs[image.config]
    forged = _tampered(image, config, config.replace(b'"amd64"', b'"arm64"'))  # same size, other bytes
    with pytest.raises(PublishError, match="with other bytes"):
        zstd.write_layout(ExportingEngine({image.image_id: forged}), image.image_id, tmp_path / "forged")


def test_a_layer_that_does_not_hold_the_diff_its_config_names_is_refused(has_zstd, image, tmp_path):
    """Every blob is what its name says, but the config names the diffs in another order: no push."""
    config = json.loads(image.blobs[image.config])
    config["rootfs"]["diff_ids"].reverse()
    raw_config = json.dumps(config).encode()
    manifest = json.loads(image.blobs[image.image_id])
    manifest["config"].update(digest=sha(raw_config), size=len(raw_config))
    raw_manifest = json.dumps(manifest).encode()
    blobs = {**{d: b for d, b in image.blobs.items() if d not in (image.config, image.image_id)}, sha(raw_config): raw_config,
             sha(raw_manifest): raw_manifest}
    with pytest.raises(PublishError, match="layer 0 .* not the diff its config names"):
        zstd.write_layout(ExportingEngine({sha(raw_manifest): _export_of(blobs)}), sha(raw_manifest), tmp_path)


def _export_of(blobs: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for d in sorted(blobs):
            info = tarfile.TarInfo("blobs/sha256/" + d.removeprefix("sha256:"))
            info.size = len(blobs[d])
            tar.addfile(info, io.BytesIO(blobs[d]))
    return out.getvalue()


def test_the_config_digest_is_read_from_the_manifest_without_the_rest_of_the_export():
    """Docker 26's inspect does not name the config: the export is read as far as the manifest only."""
    layers = [*LAYERS, layer_tar({"opt/torch": NOISE})]
    early = oci_export(layers, first=oci_export(layers).image_id)  # the manifest's blob first in the tar
    engine = ExportingEngine({early.image_id: early.tar})
    assert zstd.config_digest(engine, early.image_id) == early.config
    assert engine.closed == 1 and engine.sent < len(early.tar) / 4096 / 4  # it stopped, and let the daemon know


def test_an_image_index_or_an_image_gone_is_one_line(image):
    index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []}).encode()
    with pytest.raises(PublishError, match="is an image index, not one image"):
        zstd.config_digest(ExportingEngine({sha(index): _export_of({sha(index): index})}), sha(index))
    with pytest.raises(PublishError, match=r"refused the export of sha256:.*\(404: No such image"):
        zstd.config_digest(ExportingEngine({}), image.image_id)


def test_a_daemon_that_stops_answering_mid_export_is_worth_another_attempt(image):
    class Dying(ExportingEngine):
        def get_image(self, image_id, chunk_size=4096):
            def chunks():
                yield image.tar[:6000]
                raise requests.ConnectionError("connection reset by peer")
            return chunks()
    with pytest.raises(registry.Transient, match="stopped answering during the export"):
        zstd.config_digest(Dying({}), image.image_id)


class Engine(ExportingEngine):
    """A daemon's info: its store."""

    def __init__(self, store: str, exports: dict[str, bytes] | None = None):
        super().__init__(exports or {})
        self.store = store

    def info(self):
        return {"DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]] if self.store == "containerd" else []}


def test_the_classic_store_is_refused_in_one_line_naming_what_to_do(monkeypatch):
    with pytest.raises(EnvironmentProblem) as e:
        zstd.check_engine(Engine("classic"))
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert 'eval "$(python3 build.py engine)"' in str(e.value) and str(e.value).endswith("nothing pushed")
    zstd.check_engine(Engine("containerd"))
    monkeypatch.setattr(zstd.shutil, "which", lambda name: None)
    with pytest.raises(EnvironmentProblem, match="apt-get install zstd"):
        zstd.check_engine(Engine("containerd"))


def test_a_build_with_all_hands_the_compression_to_each_row():
    row = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    pushed = arguments.BuildOptions(all=True, push=True, registry="127.0.0.1:5000/ml")
    assert "--compression" not in pushed.child_argv(row, Path("r.json"))
    argv = dataclasses.replace(pushed, compression="zstd").child_argv(row, Path("r.json"))
    assert argv[argv.index("--compression") + 1] == "zstd"


# ---- the read-back and skopeo's command lines --------------------------------------------------

def test_a_remote_names_its_layers_compression():
    gz, zs = "application/vnd.oci.image.layer.v1.tar+gzip", registry.ZSTD_LAYER
    assert registry.Remote("d", "c", (zs, zs)).form == "zstd"
    assert registry.Remote("d", "c", (gz, "application/vnd.docker.image.rootfs.diff.tar.gzip")).form == "gzip"
    assert registry.Remote("d", "c", (zs, gz)).form == registry.Remote("d", "c", ()).form == "mixed"


def _skopeo_seen(monkeypatch, served: bytes = b"{}") -> list[dict]:
    seen = []

    def run(cmd, **kw):
        files = {a.split("=", 1)[1] for a in cmd if "authfile=" in a}
        seen.append({"cmd": cmd, "auth": [json.loads(open(f).read()) for f in files]})
        return subprocess.CompletedProcess(cmd, 0, stdout=served, stderr=b"")

    monkeypatch.setattr(registry.shutil, "which", lambda name: "/usr/bin/skopeo")
    monkeypatch.setattr(registry.subprocess, "run", run)
    return seen


def test_a_layout_push_and_a_copy_by_digest_carry_the_credentials_in_a_file_for_each_side(monkeypatch, tmp_path):
    seen = _skopeo_seen(monkeypatch)
    api = registry.RegistryAPI(registry.Registry.parse("registry.example.com/ml"), {"username": "ci", "password": "s3cret"}, None)
    api.push_layout(tmp_path, "zstd", "pytorch-cuda", DATED)
    api.retag("pytorch-cuda", "sha256:" + "d" * 64, "v2.7")
    push, copy = (s["cmd"] for s in seen)
    assert not any("s3cret" in a for s in seen for a in s["cmd"])
    assert all(s["auth"] == [{"auths": {"registry.example.com": {"auth": base64.b64encode(b"ci:s3cret").decode()}}}] for s in seen)
    assert "--preserve-digests" in push and f"oci:{tmp_path}:zstd" in push and "--dest-tls-verify=true" in push
    assert push[-1] == f"docker://registry.example.com/ml/pytorch-cuda:{DATED}"
    assert f"--command-timeout={registry.PUSH_TIMEOUT}s" in push
    assert {a.split("=")[0] for a in copy if a.startswith("--src-") or a.startswith("--dest-")} == {
        "--src-tls-verify", "--src-authfile", "--dest-tls-verify", "--dest-authfile"}
    assert copy[-2:] == ["docker://registry.example.com/ml/pytorch-cuda@sha256:" + "d" * 64, "docker://registry.example.com/ml/pytorch-cuda:v2.7"]


def test_the_read_back_names_each_layers_media_type(monkeypatch):
    raw = json.dumps({"schemaVersion": 2, "config": {"digest": "sha256:c0"},
                      "layers": [{"mediaType": registry.ZSTD_LAYER}, {"mediaType": registry.ZSTD_LAYER}]}).encode()
    _skopeo_seen(monkeypatch, raw)
    remote = registry.RegistryAPI(registry.Registry.parse("127.0.0.1:5000/ml"), None, None).manifest(ROW, "v2.7")
    assert remote == registry.Remote(sha(raw), "sha256:c0", (registry.ZSTD_LAYER, registry.ZSTD_LAYER)) and remote.form == "zstd"


# ---- the decisions, on a registry held in memory ---------------------------------------------

class MemoryRegistry(registry.RegistryAPI):
    """RegistryAPI's calls against manifests held here, each recorded in order. `serves` can
    change what a push stores (a registry, or a client, that got it wrong)."""

    def __init__(self):
        super().__init__(registry.Registry.parse("127.0.0.1:5000/ml"), None, None)
        self.tags: dict[str, bytes] = {}  # "ml/<repository>:<tag>": manifest bytes
        self.calls: list[tuple[str, str]] = []
        self.serves = lambda raw: raw

    def ping(self, image):
        pass

    def _read(self, name: str, tag: str) -> bytes | None:
        self.calls.append(("read", tag))
        return self.tags.get(f"{name}:{tag}")

    def push_layout(self, layout, ref_name, name, tag):
        entry, = json.loads((layout / "index.json").read_text())["manifests"]
        assert entry["annotations"]["org.opencontainers.image.ref.name"] == ref_name
        raw = (layout / "blobs" / "sha256" / entry["digest"].removeprefix("sha256:")).read_bytes()
        doc = json.loads(raw)
        for d in [doc["config"]["digest"], *(layer["digest"] for layer in doc["layers"])]:
            assert (layout / "blobs" / "sha256" / d.removeprefix("sha256:")).is_file()  # every blob it names is there
        self.calls.append(("push", tag))
        self.tags[f"ml/{name}:{tag}"] = self.serves(raw)

    def retag(self, name, digest, tag):
        self.calls.append(("copy", tag))
        self.tags[f"ml/{name}:{tag}"] = next(raw for raw in self.tags.values() if sha(raw) == digest)


class ImageOnly:
    """The engine's view of the one tested image (the row's base left out: it is pushed as the
    engine holds it, never in zstd)."""

    def __init__(self, image, store="containerd"):
        self.image, self.engine = image, Engine(store, {image.image_id: image.tar})
        self.api, self.images = self.engine, self

    def get(self, ref):
        return type("Img", (), {"id": self.image.image_id, "labels": LABELS})()

    def info(self):
        return self.engine.info()


@pytest.fixture
def tested(monkeypatch):
    monkeypatch.setattr(publish.tags, "passed", lambda image_id, *a: {"mode": "cpu"})
    monkeypatch.setattr(publish, "base_move", lambda *a: None)


def run(c, api: MemoryRegistry, compression: str, push: bool = True) -> list[publish.Move]:
    once = retry.retrying(1, 0, lambda _: None)
    moves = publish.plan(c, api, [ROW], once, compression)
    if push:
        publish.execute(c, api, moves, None, once, lambda _: None)
    return moves


def test_zstd_pushes_the_dated_tag_reads_it_back_then_copies_it_to_each_moving_tag(has_zstd, tested, image, tmp_path):
    c, api = ImageOnly(image), MemoryRegistry()
    moves = run(c, api, "zstd")
    pushed = [call for call in api.calls if call[0] != "read" or call[1] == DATED]
    assert pushed[-(len(ROW.tags) + 2):] == [("push", DATED), ("read", DATED), *[("copy", t) for t in ROW.tags]]
    dated = api.tags[f"ml/pytorch-cuda:{DATED}"]
    assert {api.tags[f"ml/pytorch-cuda:{t}"] for t in ROW.tags} == {dated}  # one manifest under every tag
    doc = json.loads(dated)
    assert doc["config"]["digest"] == image.config and {m["mediaType"] for m in doc["layers"]} == {registry.ZSTD_LAYER}
    lines = publish.table(moves, api.reg, push=True)
    assert all(line.endswith("pushed, verified (zstd)") for line in lines[1:len(moves) + 1]), lines
    assert publish.ZSTD_NOTE in lines and f"pull by digest: 127.0.0.1:5000/ml/pytorch-cuda@{sha(dated)}" in lines
    publish.write_record(tmp_path, api.reg, ROW, moves)
    record = json.loads((tmp_path / "published.json").read_text())
    assert (record["digest"], record["compression"], record["image_id"]) == (sha(dated), "zstd", image.image_id)

    again = MemoryRegistry()
    again.tags = dict(api.tags)
    c2 = ImageOnly(image)
    moves = run(c2, again, "zstd")
    assert [call for call in again.calls if call[0] != "read"] == [] and all(mv.in_place for mv in moves)
    assert c2.engine.closed == 1  # the config, from the manifest, was all it read of the image


def test_a_read_back_in_gzip_stops_the_run_before_any_moving_tag_moves(has_zstd, tested, image):
    """As skopeo 1.9's own recompression does when the repository holds the gzip blob already."""
    api = MemoryRegistry()
    api.serves = lambda raw: raw.replace(registry.ZSTD_LAYER.encode(), b"application/vnd.oci.image.layer.v1.tar+gzip")
    api.tags["ml/pytorch-cuda:v2.7"] = b'{"config": {"digest": "sha256:old"}, "layers": []}'
    with pytest.raises(PublishError, match=f"read-back of .*:{DATED} does not match the push"):
        run(ImageOnly(image), api, "zstd")
    assert not [call for call in api.calls if call[0] == "copy"]
    assert api.tags["ml/pytorch-cuda:v2.7"] == b'{"config": {"digest": "sha256:old"}, "layers": []}'


def test_a_dated_tag_holding_this_image_in_gzip_stays_and_the_moving_tags_get_it(tested, image):
    """An immutable tag never changes once pushed, not even to the same image recompressed."""
    api = MemoryRegistry()
    api.tags[f"ml/pytorch-cuda:{DATED}"] = image.blobs[image.image_id]  # what the engine's own push left
    c = ImageOnly(image)
    moves = run(c, api, "zstd", push=False)
    assert moves[0].in_place and all(mv.follows and mv.follows.digest == image.image_id for mv in moves[1:])
    assert publish.table(moves, api.reg, push=False)[1].endswith("already there (gzip)")
    assert c.engine.sent == 0  # the manifest digest said it: nothing read from the engine
    publish.execute(c, api, moves, None, retry.retrying(1, 0, lambda _: None), lambda _: None)
    assert [call for call in api.calls if call[0] != "read"] == [("copy", t) for t in ROW.tags]
    assert {api.tags[f"ml/pytorch-cuda:{t}"] for t in ROW.tags} == {image.blobs[image.image_id]}


def test_a_gzip_run_after_a_zstd_one_keeps_the_zstd_tags(has_zstd, tested, image):
    api = MemoryRegistry()
    run(ImageOnly(image), api, "zstd")
    zstd_form = api.tags[f"ml/pytorch-cuda:{DATED}"]
    api.tags["ml/pytorch-cuda:v2.7"] = b'{"config": {"digest": "sha256:old"}, "layers": []}'  # moved by someone since
    api.calls.clear()
    moves = run(ImageOnly(image), api, "gzip")  # no docker push: ImageOnly cannot push
    assert moves[0].in_place and moves[0].after.form == "zstd"
    assert [call for call in api.calls if call[0] != "read"] == [("copy", "v2.7")]
    assert api.tags["ml/pytorch-cuda:v2.7"] == zstd_form
    assert publish.table(moves, api.reg, push=True)[1].endswith("already there (zstd)")


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_a_dated_tag_holding_another_config_is_refused_in_either_compression(tested, image, compression):
    other = oci_export(LAYERS[:1], labels=LABELS)
    api = MemoryRegistry()
    api.tags[f"ml/pytorch-cuda:{DATED}"] = other.blobs[other.image_id].replace(
        b"application/vnd.oci.image.layer.v1.tar+gzip", registry.ZSTD_LAYER.encode())
    with pytest.raises(ImmutableTagTaken) as e:
        run(ImageOnly(image), api, compression, push=False)
    assert other.config in e.value.lines()[0] and image.image_id in e.value.lines()[0]


def test_on_the_classic_store_the_config_is_the_image_id_and_nothing_is_read(tested, image):
    """The rule holds there too (a classic engine is refused zstd before this, by check_engine)."""
    classic = ImageOnly(image, "classic")
    api = MemoryRegistry()
    same = json.dumps({"config": {"digest": image.image_id}, "layers": [{"mediaType": registry.ZSTD_LAYER}]}).encode()
    api.tags[f"ml/pytorch-cuda:{DATED}"] = same  # the classic ID is a config digest
    moves = run(classic, api, "gzip", push=False)
    assert moves[0].in_place and moves[0].config == image.image_id and classic.engine.sent == 0
    assert all(mv.follows and mv.follows.digest == sha(same) for mv in moves[1:])  # held in zstd: the moving tags follow


def test_what_a_tag_must_hold_for_each_compression(image):
    """A zstd move holds a manifest of this config whose every layer is zstd; any immutable tag
    holding this image, in either compression, is in place; another config is another image."""
    gz, zs = "application/vnd.oci.image.layer.v1.tar+gzip", registry.ZSTD_LAYER
    engine_push = registry.Remote(image.image_id, image.config, (gz, gz))
    zstd_form = registry.Remote("sha256:" + "d" * 64, image.config, (zs, zs))
    half = registry.Remote("sha256:" + "e" * 64, image.config, (zs, gz))
    other = registry.Remote("sha256:" + "f" * 64, "sha256:" + "c" * 64, (zs, zs))
    for compression in ("gzip", "zstd"):
        mv = publish.Move(ROW, image.image_id, DATED, True, by_manifest=True, compression=compression, config=image.config)
        assert [mv.holds(r) for r in (engine_push, zstd_form, half, other)] == (
            [True, False, False, False] if compression == "gzip" else [False, True, False, False])
        assert [mv.same_image(r) for r in (engine_push, zstd_form, half, other)] == [True, True, True, False]
        mv.before = half
        assert mv.in_place  # an immutable tag is never pushed again once it holds this image
    moving = publish.Move(ROW, image.image_id, "v2.7", False, by_manifest=True, compression="zstd", config=image.config)
    moving.before = engine_push
    assert not moving.in_place
    moving.follows = engine_push
    assert moving.in_place and not moving.holds(zstd_form)
