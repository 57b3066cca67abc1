"""Stage 2, the Python environment's files: which wheel of each pin a platform installs, and its size.

A requirements lock lists the hashes of every file of a release (every platform's); the image
installs one. `lock` asks the index once, by its simple API (PEP 691 JSON, PEP 700 sizes; the
HTML page and a HEAD request where it serves no JSON), for the files whose hashes the lock lists,
and keeps the one the platform installs: the best of its compatibility tags, as pip ranks them
for the OS's glibc. lock.json records it (`wheels`), so that render can
lay out the image's layers by size offline (layers.py) and pin each large wheel to that one file.
"""
from __future__ import annotations

import concurrent.futures
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from urllib.parse import urldefrag, urljoin

import requests
from packaging import tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from pytorch_cuda_runtime import lockfile

from .. import ca
from ..errors import ResolveError
from ..matrix import OS_PLATFORMS

_BLOCK = re.compile(r"\n(?=\S)")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
LOOKUPS_AT_ONCE = 8


@dataclass(frozen=True)
class WheelFile:
    """The one file of a pin that a platform installs."""

    file: str
    sha256: str
    size: int
    url: str

    def as_json(self) -> dict:
        return {"file": self.file, "sha256": self.sha256, "size": self.size, "url": self.url}


def pinned_hashes(lock_text: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (version, the sha256 hashes the lock allows) for each `name==version` block."""
    return {p.name: (p.version, set(p.hashes)) for p in lockfile.pins(lock_text)}


def platform_tags(python: str, platform: str, glibc: str | None = None) -> list[tags.Tag]:
    """The tags an interpreter of `python` on `platform` accepts, best first, as pip ranks them
    there: manylinux from the OS's glibc (else the level uv resolved for, OS_PLATFORMS) down to
    the oldest, then plain linux."""
    arch, level = OS_PLATFORMS[platform].split("-", 1)  # x86_64, manylinux_2_28
    top = int(glibc.split(".")[1]) if glibc else int(level.rsplit("_", 1)[1])
    lowest = 17 if arch == "aarch64" else 5  # manylinux2014 is where aarch64 starts
    plats = []
    for minor in range(top, lowest - 1, -1):
        plats.append(f"manylinux_2_{minor}_{arch}")
        plats += {17: [f"manylinux2014_{arch}"], 12: [f"manylinux2010_{arch}"], 5: [f"manylinux1_{arch}"]}.get(minor, [])
    plats.append(f"linux_{arch}")
    version = tuple(int(x) for x in python.split("."))
    return [*tags.cpython_tags(version, platforms=plats), *tags.compatible_tags(version, platforms=plats)]


def glibc_of(apt_pins: dict[str, str]) -> str | None:
    """The OS's glibc (2.36) from its libc6 pin (2.36-9+deb12u7), where the lock has one."""
    m = re.match(r"^(?:\d+:)?(2\.\d+)", apt_pins.get("libc6", ""))
    return m.group(1) if m else None


def best(files: list[tuple[str, str, int | None, str]], allowed: set[str], ranks: dict[tags.Tag, int]) -> tuple[str, str, int | None, str] | None:
    """Of (filename, sha256, size, url) files, the wheel the lock allows that ranks best for the platform."""
    found = None
    for name, sha, size, url in files:
        if sha not in allowed or not name.endswith(".whl"):
            continue
        try:
            rank = min((ranks[t] for t in parse_wheel_filename(name)[3] if t in ranks), default=None)
        except InvalidWheelFilename:
            continue
        if rank is not None and (found is None or (rank, name) < found[0]):
            found = ((rank, name), (name, sha, size, url))
    return found[1] if found else None


class _Links(HTMLParser):
    """A PEP 503 page's anchors: (filename, url)."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None and data.strip():
            self.links.append((data.strip(), self._href))
            self._href = None


class Index:
    """The package index's simple API for one lock: each project's files with hash, size and address."""

    def __init__(self, url: str, ca_bundle: str | None, session: requests.Session | None = None, timeout: float = 60):
        self.url, self.timeout = url.rstrip("/") + "/", timeout
        self.session = session or ca.session(ca_bundle)

    def files(self, project: str) -> list[tuple[str, str, int | None, str]]:
        """(filename, sha256, size or None, url) of every file of the project."""
        page = urljoin(self.url, f"{project}/")
        try:
            r = self.session.get(page, headers={"Accept": f"{JSON_TYPE}, text/html;q=0.1"}, timeout=self.timeout)
            r.raise_for_status()
        except requests.RequestException as e:
            raise ResolveError(f"reading {page}: {e}") from None
        if r.headers.get("Content-Type", "").split(";")[0].strip() == JSON_TYPE:
            return [(f["filename"], f.get("hashes", {}).get("sha256", ""), f.get("size"), urljoin(page, f["url"]))
                    for f in r.json().get("files", [])]
        parser = _Links()
        parser.feed(r.text)
        out: list[tuple[str, str, int | None, str]] = []
        for name, href in parser.links:
            url, frag = urldefrag(urljoin(page, href))
            out.append((name, frag[len("sha256="):] if frag.startswith("sha256=") else "", None, url))
        return out

    def size(self, url: str) -> int:
        """A file's size where the index gave none (PEP 503 pages): the Content-Length of its download."""
        try:
            r = self.session.head(url, allow_redirects=True, timeout=self.timeout)
            r.raise_for_status()
            return int(r.headers["Content-Length"])
        except (requests.RequestException, KeyError, ValueError) as e:
            raise ResolveError(f"the size of {url}: {e}") from None


def wheel_files(lock_text: str, python: str, platform: str, index: Index, glibc: str | None = None) -> dict[str, dict]:
    """name -> {file, sha256, size, url} of the wheel each pin of lock_text installs on platform (an OS
    with that glibc). One ResolveError naming every pin the index has no installable wheel of."""
    ranks = {t: i for i, t in enumerate(platform_tags(python, platform, glibc))}
    pins = pinned_hashes(lock_text)

    def one(name: str) -> tuple[str, WheelFile | None]:
        version, allowed = pins[name]
        found = best(index.files(name), allowed, ranks)
        if found is None:
            return name, None
        file, sha, size, url = found
        return name, WheelFile(file, sha, size if size is not None else index.size(url), url)

    with concurrent.futures.ThreadPoolExecutor(LOOKUPS_AT_ONCE) as pool:
        found = dict(pool.map(one, sorted(pins)))
    missing = sorted(f"{n}=={pins[n][0]}" for n, w in found.items() if w is None)
    if missing:
        raise ResolveError(f"{index.url} has no {platform} wheel for Python {python} with a hash the lock lists: {', '.join(missing)}")
    return {n: w.as_json() for n, w in sorted(found.items()) if w is not None}  # none is: missing above


def sdist_files(lock_text: str, index: Index) -> dict[str, dict]:
    """name -> {file, sha256, size, url} of the sdist each pin of lock_text is built from (the
    packages compiled in the image: DeepSpeed, Transformer Engine's extension)."""
    out, missing = {}, []
    for name, (version, allowed) in sorted(pinned_hashes(lock_text).items()):
        found = [(f, sha, size, url) for f, sha, size, url in index.files(name)
                 if sha in allowed and f.endswith((".tar.gz", ".zip"))]
        if not found:
            missing.append(f"{name}=={version}")
            continue
        file, sha, size, url = min(found)
        out[name] = WheelFile(file, sha, size if size is not None else index.size(url), url).as_json()
    if missing:
        raise ResolveError(f"{index.url} has no sdist with a hash the lock lists: {', '.join(missing)}")
    return out
