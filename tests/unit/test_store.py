"""The store (stages/fetch.py): every locked file fetched once, checked, resumed; carried to and
from a folder; served to mmdebstrap on 127.0.0.1. Against a real HTTP server on loopback."""
from __future__ import annotations

import hashlib
import http.server
import ssl
import subprocess
import threading
import urllib.parse
from pathlib import Path

import pytest
import requests

from pytorch_cuda_build import matrix, paths
from pytorch_cuda_build.engine.docker_env import BuildClient
from pytorch_cuda_build.errors import EnvironmentProblem, InputUnavailable
from pytorch_cuda_build.stages import build, fetch
from pytorch_cuda_runtime.lockfile import Input


class Mirror(http.server.ThreadingHTTPServer):
    """A mirror on 127.0.0.1: files by path, Range honoured, each request recorded; `cut_after`
    bytes of a file and the connection drops (a download cut short)."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files: dict[str, bytes] = {}
        self.status: dict[str, int] = {}
        self.cut_after: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Mirror

    def do_GET(self) -> None:  # noqa: N802
        path = urllib.parse.urlsplit(self.path).path
        self.server.requests.append((path, self.headers.get("Range", "")))
        if path in self.server.status:
            self.send_response(self.server.status[path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = self.server.files.get(path)
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers.get("Range") else 0
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = self.server.cut_after.pop(path, None)
        self.wfile.write(body if cut is None else body[:cut])
        if cut is not None:
            self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def mirror():
    server = Mirror()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def item(mirror: Mirror, path: str, data: bytes) -> Input:
    mirror.files[path] = data
    return Input(path.rsplit("/", 1)[1], mirror.url(path), hashlib.sha256(data).hexdigest(), len(data))


def test_each_file_is_fetched_once_checked_and_read_only(mirror, tmp_path):
    store = fetch.Store(tmp_path / "store")
    a, b = item(mirror, "/pool/a_1.deb", b"a" * 3000), item(mirror, "/simple/b-1.whl", b"b" * 10)
    lines: list[str] = []
    assert fetch.fetch([a, b], None, lines.append, "the row", store) == 3010
    assert store.blob(a.sha256).read_bytes() == b"a" * 3000 and store.blob(b.sha256).stat().st_mode & 0o777 == 0o444
    assert lines[0] == f"fetch: the row: 2 of 2 files (0.0 MB of 0.0 MB) into the store {store.root}"
    mirror.requests.clear()
    assert fetch.fetch([a, b], None, lines.append, "the row", store) == 0  # a second row: nothing it has
    assert mirror.requests == [] and lines[-1].startswith("fetch: the row: all 2 files")


def test_a_download_cut_short_is_resumed_where_it_stopped(mirror, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch.time, "sleep", lambda s: None)
    store = fetch.Store(tmp_path / "store")
    a = item(mirror, "/pool/big.deb", bytes(range(256)) * 2000)
    mirror.cut_after["/pool/big.deb"] = 300_000
    fetch.fetch([a], None, lambda line: None, "the row", store)
    assert store.blob(a.sha256).read_bytes() == mirror.files["/pool/big.deb"]
    (first, whole), (again, rest) = mirror.requests
    assert first == again == "/pool/big.deb" and whole == ""
    assert 0 < int(rest.removeprefix("bytes=").rstrip("-")) <= 300_000  # only the rest: what it had stays
    assert list((store.root / "partial").iterdir()) == []


def test_other_bytes_than_the_locks_never_enter_the_store(mirror, tmp_path):
    store = fetch.Store(tmp_path / "store")
    a = item(mirror, "/pool/a_1.deb", b"the locked bytes")
    mirror.files["/pool/a_1.deb"] = b"the mirror replaced them"
    with pytest.raises(InputUnavailable) as e:
        fetch.fetch([a], None, lambda line: None, "the row", store)
    assert str(e.value).startswith(f"{a.url} served other bytes than the lock's sha256 {a.sha256[:16]}... for a_1.deb: "
                                   "the mirror replaced it; fill the store from a folder")
    assert not store.blob(a.sha256).exists() and list((store.root / "partial").iterdir()) == []


def test_a_store_on_a_full_disk_is_one_line_naming_it_and_nothing_enters_it(mirror, tmp_path):
    """Found by the fault tier: a store on a disk that fills mid-download ended in a traceback."""
    store = fetch.Store(tmp_path / "store")
    a = item(mirror, "/pool/a_1.deb", b"a" * 3000)
    (store.root / "partial").mkdir(parents=True)
    (store.root / "partial" / f"{a.sha256}.part").symlink_to("/dev/full")  # each write: ENOSPC, as on a full disk
    with pytest.raises(EnvironmentProblem) as e:
        fetch.fetch([a], None, lambda line: None, "the row", store)
    assert str(e.value).startswith(f"no space left on device for the store {store.root} (0.0 MB to download, ")
    assert "free some, or point $PYTORCH_CUDA_STORE at a larger disk" in str(e.value) and e.value.exit_code == 2
    assert not store.blob(a.sha256).exists()


def test_a_file_the_mirror_dropped_is_one_line_naming_it_and_the_ways_on(mirror, tmp_path):
    store = fetch.Store(tmp_path / "store")
    gone = Input("linux-libc-dev_6.1.192-2_amd64.deb", mirror.url("/pool/linux-libc-dev_6.1.192-2_amd64.deb"), "0" * 64, 5)
    with pytest.raises(InputUnavailable) as e:
        fetch.fetch([gone], None, lambda line: None, "the row", store)
    assert str(e.value) == (f"linux-libc-dev_6.1.192-2_amd64.deb is not in the store, and {gone.url} answers 404: the mirror or "
                            f"index no longer serves it; {fetch.HOW_TO_GO_ON}")
    assert e.value.url == gone.url and e.value.exit_code == 1


def test_a_server_error_is_tried_again_then_named(mirror, tmp_path, monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(fetch.time, "sleep", waits.append)
    store = fetch.Store(tmp_path / "store")
    a = item(mirror, "/pool/a.deb", b"x")
    mirror.status["/pool/a.deb"] = 503
    with pytest.raises(InputUnavailable, match=r"a.deb is not in the store and .* could not be read \(HTTP 503, 3 tries\)"):
        fetch.fetch([a], None, lambda line: None, "the row", store)
    assert waits == [2, 4] and len(mirror.requests) == 3


def test_an_unreachable_source_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch.time, "sleep", lambda s: None)
    closed = Input("a.whl", "http://127.0.0.1:9/a.whl", "0" * 64, 1)  # the discard port: nothing listens
    with pytest.raises(InputUnavailable, match=r"^a.whl is not in the store and http://127.0.0.1:9/a.whl could not be read"):
        fetch.fetch([closed], None, lambda line: None, "the row", fetch.Store(tmp_path / "store"))


def _certificate(tmp_path, name: str):
    """A self-signed certificate for 127.0.0.1, made here by openssl: (its key, itself)."""
    key, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return key, cert


def test_a_source_whose_certificate_the_bundle_cannot_verify_is_one_line_at_once(mirror, tmp_path, monkeypatch):
    """As behind a TLS proxy with another CA bundle: no retry can verify it, so no wait; the line
    names the host and --ca-bundle. With the bundle that holds its issuer, the same file comes."""
    waits: list[float] = []
    monkeypatch.setattr(fetch.time, "sleep", waits.append)
    key, cert = _certificate(tmp_path, "the-proxy")
    _, other = _certificate(tmp_path, "another-ca")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    mirror.socket = tls.wrap_socket(mirror.socket, server_side=True)
    a = item(mirror, "/pool/a.deb", b"a" * 100)
    a = Input(a.file, a.url.replace("http://", "https://"), a.sha256, a.size)
    store = fetch.Store(tmp_path / "store")
    with pytest.raises(InputUnavailable) as e:
        fetch.fetch([a], str(other), lambda line: None, "the row", store)
    host = a.url.split("/")[2]
    assert str(e.value).startswith(f"a.deb is not in the store, and {host}'s certificate could not be verified with the CA "
                                   "bundle in use: pass the CA that signs it with --ca-bundle"), str(e.value)
    assert waits == [] and not store.has(a)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(other))  # the environment's bundle never replaces the one given
    fetch.fetch([a], str(cert), lambda line: None, "the row", store)
    assert store.has(a)


def test_a_folder_carries_the_files_and_refuses_other_bytes(mirror, tmp_path):
    here, there = fetch.Store(tmp_path / "here"), fetch.Store(tmp_path / "there")
    a, b = item(mirror, "/pool/a.deb", b"aaa"), item(mirror, "/simple/b.whl", b"bbb")
    fetch.fetch([a, b], None, lambda line: None, "the row", here)
    fetch.write_to([a, b], tmp_path / "usb", lambda line: None, here)
    assert (tmp_path / "usb" / "sha256" / a.sha256).read_bytes() == b"aaa"
    assert (tmp_path / "usb" / "INDEX").read_text().splitlines()[0] == f"{a.sha256} 3 a.deb {a.url}"
    (tmp_path / "usb" / "sha256" / b.sha256).chmod(0o644)
    (tmp_path / "usb" / "sha256" / b.sha256).write_bytes(b"BBB")  # tampered on the way
    assert fetch.fill_from([a, b], tmp_path / "usb", lambda line: None, there) == 1
    assert there.has(a) and not there.has(b)
    with pytest.raises(InputUnavailable, match="b.whl is not in the store"):
        fetch.write_to([a, b], tmp_path / "again", lambda line: None, there)


def test_the_proxy_answers_for_locked_addresses_from_the_store_and_nothing_else(mirror, tmp_path):
    """What mmdebstrap's apt asks: an absolute address, quoted (+ as %2b); the index by hash."""
    store = fetch.Store(tmp_path / "store")
    deb = item(mirror, "/debian/pool/main/g/glibc/libc-bin_2.36-9+deb12u14_amd64.deb", b"deb")
    index = item(mirror, "/debian/dists/bookworm/main/binary-amd64/Packages.xz", b"index")
    fetch.fetch([deb, index], None, lambda line: None, "the base", store)
    mirror.requests.clear()
    with fetch.serving([deb, index], store) as proxy:
        proxies = {"http": fetch.proxy_url(proxy)}
        got = requests.get(deb.url.replace("+", "%2b"), proxies=proxies, timeout=10)
        by_hash = requests.get(mirror.url(f"/debian/dists/bookworm/main/binary-amd64/by-hash/SHA256/{index.sha256}"),
                               proxies=proxies, timeout=10)
        other = requests.get(mirror.url("/debian/pool/main/p/perl/perl_5.36.deb"), proxies=proxies, timeout=10)
    assert (got.status_code, got.content, by_hash.content, other.status_code) == (200, b"deb", b"index", 404)
    assert mirror.requests == []  # the mirror itself was never asked
    assert len(proxy.served) == 2 and proxy.refused == ["http://127.0.0.1:%d/debian/pool/main/p/perl/perl_5.36.deb" % mirror.server_address[1]]


def test_staging_links_the_stored_file(mirror, tmp_path):
    store = fetch.Store(tmp_path / "store")
    a = item(mirror, "/pool/a.deb", b"aaa")
    fetch.fetch([a], None, lambda line: None, "the row", store)
    store.stage(a, tmp_path / "ctx" / "inputs" / "apt" / "a.deb")
    staged = tmp_path / "ctx" / "inputs" / "apt" / "a.deb"
    assert staged.read_bytes() == b"aaa" and staged.stat().st_ino == store.blob(a.sha256).stat().st_ino  # no copy


def test_a_copy_into_a_full_disk_is_one_line(mirror, tmp_path, monkeypatch):
    """Where a link cannot be made (another filesystem) the file is copied; a full disk there is one line."""
    store = fetch.Store(tmp_path / "store")
    a = item(mirror, "/pool/a.deb", b"aaa")
    fetch.fetch([a], None, lambda line: None, "the row", store)
    monkeypatch.setattr(fetch.os, "link", lambda src, dst: (_ for _ in ()).throw(OSError(18, "Invalid cross-device link")))
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "a.deb").symlink_to("/dev/full")  # each write: ENOSPC, as on a full disk
    with pytest.raises(EnvironmentProblem) as e:
        store.stage(a, tmp_path / "ctx" / "a.deb")
    assert str(e.value) == f"no space left on device copying a.deb from the store {store.root} to {tmp_path / 'ctx'}: free some there"


def test_a_rows_context_is_in_the_stores_folder_so_its_links_need_no_copy(monkeypatch, tmp_path):
    """A store set apart on another disk ($PYTORCH_CUDA_STORE) with the contexts in the state
    directory would make every staged file a copy (a hard link cannot cross filesystems): found by
    the fault tier, whose small state disk filled with the context before the build began."""
    monkeypatch.setattr(paths, "STORE_DIR", tmp_path / "big-disk" / "store")
    row = matrix.load(Path(__file__).resolve().parents[2] / "matrix.yaml").select("2.7", "12.1")
    bc = BuildClient(("docker", "buildx", "build", "--load"), {"DOCKER_HOST": "unix:///a.sock"}, "docker buildx", "plain")
    here, other = build.context_dir(row, bc), build.context_dir(row, BuildClient(bc.argv, {"DOCKER_HOST": "unix:///b.sock"}, "", ""))
    assert here.parent == tmp_path / "big-disk" / "store" / "contexts" and here != other  # one per daemon
    assert here.name.startswith(row.local_name)
