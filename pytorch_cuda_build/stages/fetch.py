"""Stage 3: fetch every file a row's lock names into the store, once, checked by its sha256.

The store is content-addressed (`<store>/sha256/<hex>`), on the host, shared by every row, flavor
and platform: a second row fetches only what the store lacks. A build reads its inputs from the
store alone (build.py stages them into its context; base.py serves them to mmdebstrap), so no
build step reaches a mirror or a package index, and a commit builds the same image after the
mirror has moved or dropped a file, as long as the store (or a folder or registry it was written
to, `build.py fetch --to/--from`) holds it.

Downloads resume: bytes already received wait in `<store>/partial/` and the next run asks for the
rest (HTTP Range). A file enters the store only whole and with the lock's hash (written aside,
then renamed), so a killed run leaves no half-written file where a build reads.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import http.server
import os
import shutil
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import requests
from filelock import FileLock

from pytorch_cuda_runtime.lockfile import Input

from .. import ca, paths
from ..errors import BadFile, EnvironmentProblem, InputUnavailable

DOWNLOADS_AT_ONCE = 4
ATTEMPTS = 3  # per file, for a connection that breaks or a server error; a 404 is final
CHUNK = 1 << 16  # what a download cut short loses at most of what it had received
SHOW_EVERY_S = 10.0
HOW_TO_GO_ON = ("fill the store from a folder or an image that carries this row's inputs (python3 build.py fetch --from "
                "DIR, or --from-image REF), or relock the row (python3 build.py lock --upgrade) and build the new lock")


@dataclass
class Store:
    """The host's content-addressed store of locked files."""

    root: Path

    def blob(self, sha256: str) -> Path:
        return self.root / "sha256" / sha256

    def has(self, item: Input) -> bool:
        blob = self.blob(item.sha256)
        return blob.is_file() and blob.stat().st_size == item.size

    def missing(self, items: Iterable[Input]) -> list[Input]:
        return [i for i in items if not self.has(i)]

    def _partial(self, item: Input) -> Path:
        return self.root / "partial" / f"{item.sha256}.part"

    def _lock(self, item: Input) -> FileLock:
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / "locks" / f"{item.sha256}.lock"))

    def put_file(self, item: Input, source: Path) -> bool:
        """Copy source in when its bytes are the lock's; False (nothing written) when they are not."""
        if self.has(item):
            return True
        with self._lock(item):
            part = self._partial(item)
            part.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, part)
            return self._admit(item, part)

    def _admit(self, item: Input, part: Path) -> bool:
        """Rename a complete download into the store if its sha256 is the lock's; else delete it."""
        if file_sha256(part) != item.sha256:
            part.unlink(missing_ok=True)
            return False
        blob = self.blob(item.sha256)
        blob.parent.mkdir(parents=True, exist_ok=True)
        part.chmod(0o444)
        os.replace(part, blob)
        return True

    def download(self, item: Input, session: requests.Session, progress: Callable[[int], None]) -> None:
        """The file from its address, resumed where an earlier run stopped; InputUnavailable when the
        source cannot give it whole with the lock's hash."""
        with self._lock(item):
            if self.has(item):
                return
            part = self._partial(item)
            part.parent.mkdir(parents=True, exist_ok=True)
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    self._get(item, part, session, progress)
                    break
                except requests.exceptions.SSLError:  # no try will verify it: the CA bundle lacks its issuer
                    raise InputUnavailable(f"{item.file} is not in the store, and {urllib.parse.urlsplit(item.url).netloc}'s "
                                           f"certificate could not be verified with the CA bundle in use: pass the CA that "
                                           f"signs it with --ca-bundle (a TLS proxy's, where one intercepts), or "
                                           f"{HOW_TO_GO_ON}", url=item.url) from None
                except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError, _ServerError) as e:
                    if attempt == ATTEMPTS:
                        raise InputUnavailable(f"{item.file} is not in the store and {item.url} could not be read "
                                               f"({_reason(e)}, {ATTEMPTS} tries); {HOW_TO_GO_ON}", url=item.url) from None
                    time.sleep(2 ** attempt)
            if part.stat().st_size != item.size or not self._admit(item, part):
                part.unlink(missing_ok=True)
                raise InputUnavailable(f"{item.url} served other bytes than the lock's sha256 {item.sha256[:16]}... for "
                                       f"{item.file}: the mirror replaced it; {HOW_TO_GO_ON}", url=item.url)

    def _get(self, item: Input, part: Path, session: requests.Session, progress: Callable[[int], None]) -> None:
        have = part.stat().st_size if part.exists() else 0
        if have > item.size:  # not a prefix of this file: start again
            part.unlink()
            have = 0
        if have == item.size:
            return
        headers = {"Range": f"bytes={have}-"} if have else {}
        with session.get(item.url, headers=headers, stream=True, timeout=(30, 120)) as r:
            if r.status_code in (404, 410):
                raise InputUnavailable(f"{item.file} is not in the store, and {item.url} answers {r.status_code}: the mirror "
                                       f"or index no longer serves it; {HOW_TO_GO_ON}", url=item.url)
            if r.status_code >= 500:
                raise _ServerError(f"HTTP {r.status_code}")
            if r.status_code not in (200, 206):
                raise InputUnavailable(f"{item.file} is not in the store, and {item.url} answers {r.status_code}; "
                                       f"{HOW_TO_GO_ON}", url=item.url)
            mode = "ab" if r.status_code == 206 else "wb"  # 200: the server sent it whole
            with open(part, mode) as out:
                for chunk in r.iter_content(CHUNK):
                    out.write(chunk)
                    progress(len(chunk))
        if part.stat().st_size < item.size:  # more than the lock's size is other bytes: said by the caller
            raise requests.exceptions.ChunkedEncodingError(f"got {part.stat().st_size} of {item.size} bytes")

    def stage(self, item: Input, dest: Path) -> None:
        """The stored file at dest, as a hard link where the filesystem allows (no copy, no space)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(self.blob(item.sha256), dest)
        except OSError:
            try:
                shutil.copyfile(self.blob(item.sha256), dest)
            except OSError as e:
                if _no_space(e):
                    dest.unlink(missing_ok=True)
                    raise EnvironmentProblem(f"no space left on device copying {item.file} from the store {self.root} to "
                                             f"{dest.parent}: free some there") from None
                raise


class _ServerError(Exception):
    """A 5xx answer: worth another try."""


class _Stopped(Exception):
    """The run is ending (another file failed, or an interrupt): this download stops here."""


def _reason(e: BaseException) -> str:
    text = str(e).split("\n")[0]
    return text if len(text) < 160 else text[:157] + "..."


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def store() -> Store:
    return Store(paths.STORE_DIR)


def size_text(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def fetch(items: list[Input], ca_bundle: str | None, log: Callable[[str], None], what: str, s: Store | None = None) -> int:
    """Every item into the store that it lacks, DOWNLOADS_AT_ONCE at a time, with a progress line
    every SHOW_EVERY_S; the bytes downloaded."""
    s = s or store()
    missing = s.missing(items)
    total = sum(i.size for i in items)
    if not missing:
        log(f"fetch: {what}: all {len(items)} files ({size_text(total)}) already in the store {s.root}")
        return 0
    need = sum(i.size for i in missing)
    log(f"fetch: {what}: {len(missing)} of {len(items)} files ({size_text(need)} of {size_text(total)}) into the store {s.root}")
    session = ca.session(ca_bundle)
    got = [0]
    lock = threading.Lock()
    shown = [time.monotonic()]
    start = time.monotonic()
    stop = threading.Event()  # set when the run ends early (an interrupt, a file that failed): each download ends at its next chunk

    def progress(n: int) -> None:
        if stop.is_set():
            raise _Stopped()
        with lock:
            got[0] += n
            now = time.monotonic()
            if now - shown[0] >= SHOW_EVERY_S:
                shown[0] = now
                rate = got[0] / max(now - start, 1e-6)
                log(f"fetch: {size_text(got[0])} of {size_text(need)} ({rate / 1e6:.0f} MB/s)")

    with concurrent.futures.ThreadPoolExecutor(DOWNLOADS_AT_ONCE) as pool:
        futures = [pool.submit(s.download, i, session, progress) for i in sorted(missing, key=lambda i: -i.size)]
        try:
            for f in concurrent.futures.as_completed(futures):
                f.result()
        except BaseException as e:
            stop.set()  # what was received stays in partial/, for the next run to resume
            for f in futures:
                f.cancel()
            if _no_space(e):
                raise EnvironmentProblem(f"no space left on device for the store {s.root} ({size_text(need)} to download, "
                                         f"{size_text(shutil.disk_usage(s.root).free)} free); free some, or point "
                                         "$PYTORCH_CUDA_STORE at a larger disk; what arrived waits in partial/ for the "
                                         "next run") from None
            raise
    log(f"fetch: {what}: {len(missing)} files, {size_text(need)} in {time.monotonic() - start:.0f} s")
    return need


def _no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def fill_from(items: list[Input], folder: Path, log: Callable[[str], None], s: Store | None = None) -> int:
    """The items the store lacks, from a folder that holds them by name or by sha256 (`fetch --to`
    writes one); how many were taken. A file of the wrong bytes is refused, never stored."""
    if not folder.is_dir():
        raise BadFile(f"{folder}: no such folder to fetch from", folder)
    s = s or store()
    taken = 0
    for item in s.missing(items):
        for candidate in (folder / item.file, folder / "sha256" / item.sha256):
            if candidate.is_file() and s.put_file(item, candidate):
                taken += 1
                break
    log(f"fetch: took {taken} files from {folder}")
    return taken


def write_to(items: list[Input], folder: Path, log: Callable[[str], None], s: Store | None = None) -> None:
    """The items, from the store, into folder/sha256/<hex> (what `fetch --from` and an air-gapped
    host read), with an index of names beside them."""
    s = s or store()
    lacking = s.missing(items)
    if lacking:
        raise InputUnavailable(f"{lacking[0].file} is not in the store; run `python3 build.py fetch` for the row first",
                               url=lacking[0].url)
    for item in items:
        dest = folder / "sha256" / item.sha256
        if not (dest.is_file() and dest.stat().st_size == item.size):
            tmp = dest.with_name(dest.name + ".part")
            s.stage(item, tmp)
            os.replace(tmp, dest)
    index = "".join(f"{i.sha256} {i.size} {i.file} {i.url}\n" for i in sorted(items, key=lambda i: i.file))
    (folder / "INDEX").write_text(index)
    log(f"fetch: wrote {len(items)} files ({size_text(sum(i.size for i in items))}) to {folder}")


class _Serve(http.server.BaseHTTPRequestHandler):
    """A proxy's answers from the store: GET of a locked file's address (or of any address that
    names a stored file by hash, as apt's by-hash does), 404 for anything else."""

    protocol_version = "HTTP/1.1"  # apt keeps one connection and sends its requests down it
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        # apt quotes what it asks for (libc-bin_2.36-9%2bdeb12u14_amd64.deb); indexes give it plain.
        item = self.server.by_url.get(urllib.parse.unquote(self.path.split("?", 1)[0]))
        if item is None and "/by-hash/SHA256/" in self.path:
            item = self.server.by_sha.get(self.path.rsplit("/", 1)[1])
        if item is None or not self.server.store.has(item):
            self.server.refused.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.server.served.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", str(item.size))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        with open(self.server.store.blob(item.sha256), "rb") as f:
            shutil.copyfileobj(f, self.wfile, CHUNK)

    def log_message(self, format: str, *args: object) -> None:  # the served and refused lists say it all
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, items: list[Input], s: Store) -> None:
        super().__init__(("127.0.0.1", 0), _Serve)
        self.store = s
        self.by_url = {i.url: i for i in items}
        self.by_sha = {i.sha256: i for i in items}
        self.served: list[str] = []
        self.refused: list[str] = []


@contextlib.contextmanager
def serving(items: list[Input], s: Store | None = None) -> Iterator[_Server]:
    """An HTTP proxy on 127.0.0.1 that answers for the items' addresses from the store: a tool
    that fetches by address (mmdebstrap's apt, through http_proxy) reads the store and nothing
    else, and sees the same addresses, so what it writes is what it writes from the mirror."""
    server = _Server(items, s or store())
    thread = threading.Thread(target=server.serve_forever, name="store-proxy", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def proxy_url(server: _Server) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}"
