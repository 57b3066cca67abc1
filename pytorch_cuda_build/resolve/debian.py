"""Stage 2, the Debian side: the base's packages and a Debian CUDA toolkit, read from the
suite's indexes only after their sha256 matches what the signed InRelease gives (gpgv
against Debian's archive keyring).
"""
from __future__ import annotations

import hashlib
import lzma
import re
import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path

from debian.debian_support import Version  # Debian's own ordering: epochs, ~, revisions

from pytorch_cuda_runtime.lockfile import Deb as IndexFile

from ..errors import EnvironmentProblem, ResolveError
from ..matrix import snapshot_time

_DEBIAN_INDEX: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
_SUITES: dict[tuple[str, str, str], "Suite"] = {}


@dataclass(frozen=True)
class Suite:
    """One suite's main index for one architecture, as read and checked: the signed InRelease
    as served, and its Packages.xz, whose sha256 the InRelease vouches for."""

    mirror: str
    suite: str
    arch: str
    inrelease: bytes
    packages_xz: bytes
    packages_sha256: str

    @property
    def packages_text(self) -> str:
        return lzma.decompress(self.packages_xz).decode()

    @property
    def stanzas(self) -> list[dict[str, str]]:
        return [f for f in stanzas(self.packages_text) if f.get("Package") and f.get("Version")]

    def index_files(self) -> tuple[IndexFile, ...]:
        """The two files apt reads of this suite, by the addresses it asks for them: the InRelease,
        and the Packages.xz by its hash (the suite's Release says Acquire-By-Hash)."""
        top = f"{self.mirror.rstrip('/')}/dists/{self.suite}"
        return (IndexFile("-", "", f"{top}/InRelease", hashlib.sha256(self.inrelease).hexdigest(), len(self.inrelease)),
                IndexFile("-", "", f"{top}/main/binary-{self.arch}/by-hash/SHA256/{self.packages_sha256}",
                          self.packages_sha256, len(self.packages_xz)))


def read_suite(mirror: str, suite: str, arch: str, ca_bundle: str | None) -> Suite:
    """A suite's main index on arch, read only after gpgv has checked the InRelease against Debian's
    archive keyring and the index's sha256 matches the one it gives."""
    key = (mirror, suite, arch)
    if key not in _SUITES:
        url = f"{mirror.rstrip('/')}/dists/{suite}/InRelease"
        raw = _fetch(url, ca_bundle)
        hashes = _release_hashes(check_signed(raw, url, mirror))
        path = f"main/binary-{arch}/Packages.xz"
        _SUITES[key] = Suite(mirror, suite, arch, raw, _signed_file(mirror, suite, path, hashes, ca_bundle), hashes[path])
    return _SUITES[key]


def debian_index(mirror: str, suite: str, ca_bundle: str | None) -> dict[str, dict[str, str]]:
    """name -> fields of the newest stanza of each package in the suite's main amd64 index,
    read only after its sha256 matches the one the signed InRelease gives."""
    key = (mirror, suite)
    if key not in _DEBIAN_INDEX:
        hashes = _release_hashes(signed_release(mirror, suite, ca_bundle))
        path = "main/binary-amd64/Packages.xz"
        url = f"{mirror.rstrip('/')}/dists/{suite}/{path}"
        if path not in hashes:
            raise ResolveError(f"Debian {suite} at {mirror} has no {path} in its signed InRelease")
        data = _fetch(url, ca_bundle)
        if hashlib.sha256(data).hexdigest() != hashes[path]:
            raise ResolveError(f"{url} does not match the sha256 in the signed InRelease")
        try:
            text = lzma.decompress(data).decode()
        except lzma.LZMAError as e:
            raise ResolveError(f"cannot read the Debian package index {url}: {e}") from None
        _DEBIAN_INDEX[key] = newest_stanzas(text)
    return _DEBIAN_INDEX[key]


def newest_stanzas(packages_text: str) -> dict[str, dict[str, str]]:
    """name -> fields of its newest stanza in a Packages index (the security suite can list
    several versions of one package). A version Debian's ordering cannot read raises ValueError."""
    index: dict[str, dict[str, str]] = {}
    for fields in stanzas(packages_text):
        name = fields.get("Package")
        if name and fields.get("Version") and (name not in index or _newer(fields["Version"], index[name]["Version"])):
            index[name] = fields
    return index


def _newer(a: str, b: str) -> bool:
    return Version(a) > Version(b)


def newest_of(suites: list[Suite], names: list[str], where: str) -> dict[str, str]:
    """name -> the newest version any of the suites holds (the one apt installs), for each name."""
    out: dict[str, str] = {}
    for s in suites:
        for fields in s.stanzas:
            name = fields["Package"]
            if name in names and (name not in out or _newer(fields["Version"], out[name])):
                out[name] = fields["Version"]
    missing = [n for n in names if n not in out]
    if missing:
        raise ResolveError(f"{where} has no package {', '.join(missing)}")
    return {n: out[n] for n in names}


# A dependency: "name", "name (>= 1.0)", "name:any"; "a | b" are alternatives.
_DEP = re.compile(r"^\s*([a-z0-9][a-z0-9.+-]*)")


@dataclass
class DebianSuites:
    """A release (mirror, suite) and its update suites, as apt in the build sees them together."""

    mirror: str
    suite: str
    updates: tuple[tuple[str, str], ...]
    ca_bundle: str | None

    def _indexes(self) -> list[dict[str, dict[str, str]]]:
        return [debian_index(m, s, self.ca_bundle) for m, s in ((self.mirror, self.suite), *self.updates)]

    def newest(self, names: list[str]) -> dict[str, str]:
        """name -> the version apt installs: the newest any of the suites holds."""
        indexes = self._indexes()
        missing = [n for n in names if not any(n in i for i in indexes)]
        if missing:
            raise ResolveError(f"Debian {self.suite} at {self.mirror} has no package {', '.join(missing)}")
        out = {}
        for n in names:
            versions = [i[n]["Version"] for i in indexes if n in i]
            out[n] = max(versions, key=Version)
        return out

    def fixes(self, names: list[str]) -> dict[str, str]:
        """name -> newest version in the update suites, for every package an image of these
        names can hold: the names, the release's Priority: required set (debootstrap's minbase)
        and everything they depend on, alternatives and providers of virtual packages included."""
        main, *updates = self._indexes()
        wanted = closure(main, [*names, *(n for n, f in main.items() if f.get("Priority") == "required")])
        out: dict[str, str] = {}
        for index in updates:
            for n in wanted & index.keys():
                if n not in out or _newer(index[n]["Version"], out[n]):
                    out[n] = index[n]["Version"]
        return dict(sorted(out.items()))


def closure(index: dict[str, dict[str, str]], roots: list[str]) -> set[str]:
    """Every package reachable from roots through Depends and Pre-Depends (an over-approximation:
    all alternatives, all providers): no package the image may hold is left out."""
    providers: dict[str, list[str]] = {}
    for name, entry in index.items():
        for dep in entry.get("Provides", "").split(","):
            m = _DEP.match(dep)
            if m:
                providers.setdefault(m.group(1), []).append(name)
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        fields = index.get(name)
        if fields is None:
            todo += providers.get(name, [])
            continue
        for field in ("Pre-Depends", "Depends"):
            for alt in fields.get(field, "").replace("|", ",").split(","):
                m = _DEP.match(alt)
                if m:
                    todo.append(m.group(1))
    return {n for n in seen if n in index}


# ---- the CUDA toolkit DeepSpeed's ops are built with ----------------------------------

KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")


@dataclass(frozen=True)
class Deb:
    """One .deb of a toolkit, as the suite's signed index describes it."""

    package: str
    version: str
    filename: str  # path under the mirror
    sha256: str
    size: int


def _fetch(url: str, ca_bundle: str | None) -> bytes:
    context = ssl.create_default_context(cafile=ca_bundle) if ca_bundle and url.startswith("https") else None
    try:
        with urllib.request.urlopen(url, timeout=300, context=context) as r:
            return r.read()
    except (urllib.error.URLError, OSError) as e:
        raise ResolveError(f"cannot read {url}: {e}") from None


def signed_release(mirror: str, suite: str, ca_bundle: str | None) -> str:
    """The suite's InRelease text, after gpgv has checked it against Debian's archive keyring."""
    url = f"{mirror.rstrip('/')}/dists/{suite}/InRelease"
    return check_signed(_fetch(url, ca_bundle), url, mirror)


def check_signed(data: bytes, url: str, mirror: str) -> str:
    """An InRelease's text, after gpgv has checked it against Debian's archive keyring, and its
    Valid-Until (check_valid_until)."""
    if not KEYRING.exists() or not shutil.which("gpgv"):
        raise EnvironmentProblem(f"checking Debian's signature needs gpgv and {KEYRING} (Debian: apt-get install gpgv debian-archive-keyring)")
    proc = subprocess.run(["gpgv", "--keyring", str(KEYRING), "--output", "-", "-"], input=data, capture_output=True, timeout=60)
    if proc.returncode != 0:
        reason = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        raise ResolveError(f"{url}: signature not valid against {KEYRING}: {reason}")
    release = proc.stdout.decode()
    check_valid_until(release, url, snapshot=snapshot_time(mirror) is not None, now=datetime.now(timezone.utc))
    return release


def check_valid_until(release: str, url: str, *, snapshot: bool, now: datetime) -> None:
    """Refuse a signed index past its Valid-Until, as apt does: a mirror that stopped syncing,
    or an old index replayed to hide the security fixes after it, is still validly signed.
    A dated snapshot is old on purpose; its expiry is the snapshot's, not a fault."""
    field = next((ln.split(":", 1)[1].strip() for ln in release.splitlines() if ln.startswith("Valid-Until:")), None)
    if field is None or snapshot:
        return
    try:
        until = parsedate_to_datetime(field)
    except (TypeError, ValueError):
        raise ResolveError(f"{url}: unreadable Valid-Until {field!r}") from None
    if until < now:
        raise ResolveError(f"{url}: expired at {field} (Valid-Until): a stale mirror or a replayed index; "
                           "for a dated archive, point the mirror at snapshot.debian.org/archive/<archive>/<timestamp>")


def _release_hashes(release: str) -> dict[str, str]:
    """path -> sha256 from the SHA256 section of a Release file."""
    out, inside = {}, False
    for line in release.splitlines():
        if not line.startswith(" "):
            inside = line.startswith("SHA256:")
            continue
        if inside:
            digest, _size, path = line.split()
            out[path] = digest
    return out


def stanzas(text: str) -> list[dict[str, str]]:
    return [dict(ln.split(": ", 1) for ln in block.splitlines() if ": " in ln and not ln.startswith(" "))
            for block in text.split("\n\n")]


def fetch_verified(url: str, sha256: str, ca_bundle: str | None) -> bytes:
    """A file whose sha256 a signed index gave: its bytes, or a ResolveError."""
    data = _fetch(url, ca_bundle)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ResolveError(f"{url} does not match the sha256 in its signed index")
    return data


def _signed_file(mirror: str, suite: str, path: str, hashes: dict[str, str], ca_bundle: str | None) -> bytes:
    """A file under dists/<suite>/ that the suite's signed Release names (hashes: its sha256 list),
    checked against that sha256."""
    if path not in hashes:
        raise ResolveError(f"Debian {suite} at {mirror} has no {path} in its signed Release")
    url = f"{mirror.rstrip('/')}/dists/{suite}/{path}"
    data = _fetch(url, ca_bundle)
    if hashlib.sha256(data).hexdigest() != hashes[path]:
        raise ResolveError(f"{url} does not match the sha256 in the signed Release")
    return data


def debian_toolkit(mirror: str, suite: str, components: tuple[str, ...], packages: tuple[str, ...],
                   ca_bundle: str | None) -> list[Deb]:
    """The toolkit's .debs with their sha256, read from indexes whose hashes the signed Release vouches for."""
    release = signed_release(mirror, suite, ca_bundle)
    hashes = _release_hashes(release)
    index: dict[str, dict[str, str]] = {}
    for component in components:
        data = _signed_file(mirror, suite, f"{component}/binary-amd64/Packages.xz", hashes, ca_bundle)
        for fields in stanzas(lzma.decompress(data).decode()):
            if "Package" in fields:
                index.setdefault(fields["Package"], fields)
    missing = [p for p in packages if p not in index]
    if missing:
        raise ResolveError(f"Debian {suite} ({', '.join(components)}) at {mirror} has no package {', '.join(missing)}")
    return [Deb(p, index[p]["Version"], index[p]["Filename"], index[p]["SHA256"], int(index[p]["Size"])) for p in packages]
