"""Image records (commands/record.py): read from a `docker save` stream, written and read back,
and compared with another record, naming the differing layers and files. No daemon."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import tarfile
from pathlib import Path

import pytest

from pytorch_cuda_build.commands import record
from pytorch_cuda_build.errors import ArchiveLayoutError, BadFile

EPOCH = 1767225600


def _layer(files: dict[str, bytes], mtime: int = EPOCH, symlink: tuple[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), mtime, 0o644, 1000, 0
            tar.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo(symlink[0])
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, symlink[1], mtime
            tar.addfile(info)
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _config(layers: list[bytes], label: str = "a", mirror: str = "deb.example.org") -> bytes:
    return json.dumps({"architecture": "amd64", "os": "linux", "config": {"Labels": {"io.x": label}},
                       "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(x).hexdigest() for x in layers]},
                       "history": [{"created_by": f"RUN apt-get # http://{mirror}/debian bookworm"}]}).encode()


def oci_save(layers: list[bytes], label: str = "a", mirror: str = "deb.example.org") -> bytes:
    """What Docker >= 25 writes: an OCI layout, gzip layers under blobs/, and manifest.json (last here)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        names = []
        for raw in layers:
            blob = gzip.compress(raw, mtime=0)
            digest = hashlib.sha256(blob).hexdigest()
            _add(tar, f"blobs/sha256/{digest}", blob)
            names.append(f"blobs/sha256/{digest}")
        config = _config(layers, label, mirror)
        cdigest = hashlib.sha256(config).hexdigest()
        _add(tar, f"blobs/sha256/{cdigest}", config)
        _add(tar, "index.json", b'{"schemaVersion": 2, "manifests": []}')
        _add(tar, "manifest.json", json.dumps([{"Config": f"blobs/sha256/{cdigest}", "Layers": names}]).encode())
    return out.getvalue()


def classic_save(layers: list[bytes]) -> bytes:
    """What Docker 20.10 writes: <id>/layer.tar, uncompressed; <config id>.json."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        _add(tar, "manifest.json", json.dumps([{"Config": "c0ffee.json", "Layers": [f"l{i}/layer.tar" for i in range(len(layers))]}]).encode())
        _add(tar, "c0ffee.json", _config(layers))
        for i, raw in enumerate(layers):
            _add(tar, f"l{i}/layer.tar", raw)
    return out.getvalue()


def base_layers() -> list[bytes]:
    return [_layer({"etc/os-release": b"bookworm\n"}, symlink=("bin", "usr/bin")),
            _layer({"opt/venv/lib/op.so": b"\x7fELF avx2", "opt/venv/README": b"same\n"})]


def test_a_containerd_save_gives_every_layer_its_blob_diff_id_and_entries():
    layers = base_layers()
    rec = record.read_save(io.BytesIO(oci_save(layers)), "img", "sha256:" + "1" * 64)
    assert rec.image == "sha256:" + "1" * 64  # the manifest digest (Docker 26's image ID)
    assert rec.diff_ids == ["sha256:" + hashlib.sha256(x).hexdigest() for x in layers]
    assert all(layer.blob.startswith("sha256:") and layer.blob != layer.diff_id for layer in rec.layers)  # gzip blobs
    entries = rec.layers[0].entries or {}
    assert entries["etc/os-release"] == ("0", "0o644", "1000:0", 9, EPOCH, hashlib.sha256(b"bookworm\n").hexdigest())
    assert entries["bin"][0] == "2" and entries["bin"][5] == "-> usr/bin"


def test_a_classic_save_has_no_manifest_digest_and_its_blobs_are_the_diff_ids():
    layers = base_layers()
    config_id = "sha256:" + hashlib.sha256(_config(layers)).hexdigest()
    rec = record.read_save(io.BytesIO(classic_save(layers)), "img", config_id)  # the classic image ID is the config digest
    assert rec.image == "" and rec.config_digest == config_id
    assert [layer.blob for layer in rec.layers] == rec.diff_ids


def test_a_stream_that_is_no_image_is_named_as_such():
    with pytest.raises(ArchiveLayoutError, match="no manifest.json"):
        record.read_save(io.BytesIO(_layer({"x": b"1"})), "img", "")
    with pytest.raises(ArchiveLayoutError, match="not a readable archive"):
        record.read_save(io.BytesIO(b"not a tar at all" * 100), "img", "")


def test_a_record_written_and_read_back_is_the_same_and_names_no_mirror(tmp_path: Path):
    rec = record.read_save(io.BytesIO(oci_save(base_layers())), "img", "sha256:" + "1" * 64)
    rec.what, rec.machine = "test", {"cpu": "x"}
    path = tmp_path / "r.json.xz"
    record.write(rec, path)
    again = record.load(path)
    assert again.image == rec.image and again.config_digest == rec.config_digest and again.diff_ids == rec.diff_ids
    assert [layer.entries for layer in again.layers] == [layer.entries for layer in rec.layers]
    text = lzma.decompress(path.read_bytes()).decode()
    assert "deb.example.org" not in text and "http://DEBIAN_MIRROR/debian" in text
    assert record.compare(rec, again).same_image
    assert not list(tmp_path.glob(".*.tmp"))  # nothing half-written left beside it


def test_the_same_image_reads_as_one_and_says_so():
    a = record.read_save(io.BytesIO(oci_save(base_layers())), "a", "")
    b = record.read_save(io.BytesIO(oci_save(base_layers(), mirror="mirror.other.net")), "b", "")
    assert a.config_digest != b.config_digest  # the mirror's name is in the history...
    d = record.compare(a, b)
    assert not d.same_image and d.config == [] and d.layers == []  # ...and nothing else differs


def test_a_file_built_differently_is_named_with_its_layer_and_what_differs():
    ours = base_layers()
    theirs = [ours[0], _layer({"opt/venv/lib/op.so": b"\x7fELF avx512", "opt/venv/README": b"same\n", "opt/venv/extra": b""})]
    a = record.read_save(io.BytesIO(oci_save(theirs, label="b")), "a", "")
    b = record.read_save(io.BytesIO(oci_save(ours)), "b", "")
    d = record.compare(a, b, ("the record", "the image here"))
    assert d.layers == [1]
    assert d.files == ["layer 1: opt/venv/extra: only in the record", "layer 1: opt/venv/lib/op.so: size, content"]
    assert d.config == ["label io.x: 'b' -> 'a'"]
    assert d.differing_paths == ["opt/venv/lib/op.so"]
    text = "\n".join(record.lines(d))
    assert "differing layers: 1 (by diff_id)" in text and "CONTENT DIFFERS in 2 file(s)" in text and "CONFIG DIFFERS in 1 field(s)" in text


def test_a_layer_one_side_did_not_read_is_listed_not_guessed():
    a = record.read_save(io.BytesIO(oci_save(base_layers())), "a", "")
    b = record.read_save(io.BytesIO(oci_save([base_layers()[0], _layer({"y": b"2"})])), "b", "")
    a.layers[1].entries = None  # a published image's layer that was not downloaded
    d = record.compare(a, b)
    assert d.unread == [1] and d.files == []


@pytest.mark.parametrize("content", [b"", b"{}", b'{"layers": []}', lzma.compress(b"[1, 2]")])
def test_a_file_that_is_no_record_is_one_usage_line(tmp_path: Path, content: bytes):
    path = tmp_path / "bad.json.xz"
    path.write_bytes(content)
    with pytest.raises(BadFile, match=r"bad.json.xz: not an image record"):
        record.load(path)
    with pytest.raises(BadFile, match="no such record file"):
        record.load(tmp_path / "absent.json.xz")


def test_the_second_machines_record_of_f3d6c71_reads():
    """The committed record another machine made (its format is the one record.write writes)."""
    path = Path(__file__).resolve().parents[2] / "docs/measurements/records/2.7.1-cuda12.1-runtime-f3d6c71-second-machine.json.xz"
    rec = record.load(path)
    assert rec.image == "sha256:4e2c345410d835a55b35d4d17a526f02062bce5e71c5e9d58b68dfca04b6ce0c"
    assert len(rec.layers) == 34 and rec.layers[0].diff_id.startswith("sha256:b5d4a2b7")


def test_an_entry_that_differs_in_its_mtime_alone_is_counted_not_listed():
    a = record.read_save(io.BytesIO(oci_save([_layer({"x": b"1", "y": b"2"})])), "a", "")
    b = record.read_save(io.BytesIO(oci_save([_layer({"x": b"1", "y": b"3"}, mtime=EPOCH + 5)])), "b", "")
    d = record.compare(a, b)
    assert d.mtime_only == 1 and d.files == ["layer 0: y: content"]
    assert "time stamps only: 1 file(s) differ in mtime alone" in record.lines(d)


def test_history_entries_are_compared_by_what_the_step_ran_not_when():
    a = {"history": [{"created": "2026-01-01T00:00:00Z", "created_by": "RUN make"}, {"created": "x", "created_by": "COPY a /a"}]}
    b = {"history": [{"created": "2026-11-28T18:00:00Z", "created_by": "RUN make"}, {"created": "x", "created_by": "COPY b /a"}]}
    assert record.config_differences(a, b) == ["history[1]: \"{'created_by': 'COPY a /a'}\" -> \"{'created_by': 'COPY b /a'}\""]
