"""Stage 2: resolve a row against the package index (the only stage that needs the network).

`uv pip compile` reads each wheel's metadata (range requests, no full downloads) and
pins the whole environment with hashes for the image's platform, not the host's.
The CUDA runtime, cuDNN and NCCL versions are then read from what the torch wheel
pins (directly, or from 2.11 on through `cuda-toolkit[...]`), never typed by hand.
"""
from __future__ import annotations

import hashlib
import lzma
import os
import re
import ssl
import urllib.error
import urllib.request
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path

from debian.debian_support import Version  # Debian's own ordering: epochs, ~, revisions

from .errors import EnvironmentProblem, ResolveError
from .matrix import Image, snapshot_time

# Wheels are manylinux_2_28 at most for the torch versions we ship; bookworm has glibc 2.36.
PYTHON_PLATFORM = "x86_64-manylinux_2_28"

# Packages whose pins tell which CUDA stack the torch wheel carries. The CUDA 12
# wheels are suffixed -cu12; the CUDA 13 ones (through cuda-toolkit) are not.
_CUDA_RUNTIME = re.compile(r"^nvidia-cuda-runtime(-cu\d+)?$")
_CUDNN = re.compile(r"^nvidia-cudnn-cu\d+$")
_NCCL = re.compile(r"^nvidia-nccl-cu\d+$")
# The packages whose versions must agree exactly between torch and the toolkit.
_COMPILER_CORE = {"nvidia-cuda-runtime", "nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt", "cuda-toolkit"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")

# PYTORCH_CUDA_EXCLUDE_NEWER (an ISO 8601 date or UTC date-time, e.g. 2026-11-22T21:30:00Z)
# freezes resolution in time: uv ignores every file uploaded to the index after it
# (--exclude-newer), so the same inputs resolve to the same pins on any later day. The
# test suite sets it (tests/conftest.py) so that no test depends on the index's newest
# release; unset, `lock` resolves against the index as it is now.
EXCLUDE_NEWER_ENV = "PYTORCH_CUDA_EXCLUDE_NEWER"


@dataclass(frozen=True)
class WheelFacts:
    """What the torch wheel really brings, as read from the resolved metadata."""

    torch: str
    torch_cuda: str
    cudnn: str
    nccl: str
    deepspeed: str


def uv_binary() -> str:
    """The uv that came with the host tool's virtualenv, else one on PATH."""
    here = Path(sys.executable).with_name("uv")
    found = str(here) if here.exists() else shutil.which("uv")
    if not found:
        raise EnvironmentProblem("uv not found; run through build.py so its virtualenv is set up")
    return found


def requirements_for(image: Image) -> list[str]:
    return [f"torch=={image.torch}", f"deepspeed=={image.deepspeed}", *image.extra_requirements]


def frozen_at(given: str | None = None) -> str | None:
    """The point in time resolution is frozen at: `given`, else $PYTORCH_CUDA_EXCLUDE_NEWER, else None."""
    value = (given or os.environ.get(EXCLUDE_NEWER_ENV, "")).strip()
    if not value:
        return None
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ResolveError(f"{EXCLUDE_NEWER_ENV}={value!r} is not an ISO 8601 date or date-time (e.g. 2026-11-22T21:30:00Z)") from None
    return value


def _uv_compile(image: Image, when: str | None, *extra: str) -> list[str]:
    cmd = [
        uv_binary(), "pip", "compile", "-", "--quiet", "--generate-hashes", "--no-header", *extra,
        "--python-version", image.python, "--python-platform", PYTHON_PLATFORM,
        "--index-url", image.index, "--no-cache",
    ]
    return [*cmd, "--exclude-newer", when] if when else cmd


def _run_uv(image: Image, requirements: str, what: str, exclude_newer: str | None, ca_bundle: str | None, *extra: str) -> str:
    """`uv pip compile` of `requirements` for the image's platform; stdout, or one ResolveError line."""
    env = dict(os.environ)
    if ca_bundle:
        env["SSL_CERT_FILE"] = ca_bundle  # uv ignores pip's config and the system store
    try:
        proc = subprocess.run(_uv_compile(image, frozen_at(exclude_newer), *extra), input=requirements,
                              capture_output=True, text=True, env=env, timeout=600)
    except subprocess.TimeoutExpired:
        raise ResolveError(f"{image.name}: resolving against {image.index} timed out after 600 s") from None
    if proc.returncode != 0:
        raise ResolveError(f"{image.name}: cannot resolve {what} from {image.index}: {_first_error_line(proc.stderr)}")
    return proc.stdout


def compile_lock(image: Image, ca_bundle: str | None, upgrade: bool = False, exclude_newer: str | None = None) -> str:
    """Hash-pinned requirements for the image's whole Python environment.

    exclude_newer (ISO 8601) ignores files uploaded after it; None reads $PYTORCH_CUDA_EXCLUDE_NEWER.
    """
    reqs = requirements_for(image)
    return _run_uv(image, "\n".join(reqs) + "\n", " ".join(reqs), exclude_newer, ca_bundle)


def _first_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith(("error:", "×", "╰─▶", "Because", "hint:")) and len(ln) > 10:
            return ln.lstrip("×╰─▶ ").strip()
    return lines[-1] if lines else "uv failed without a message"


def pins(lock_text: str) -> dict[str, str]:
    """name -> version of every `name==version` line of a requirements lock."""
    out = {}
    for line in lock_text.splitlines():
        m = _PIN.match(line.strip())
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def _one(pinned: dict[str, str], pattern: re.Pattern[str], what: str, torch: str) -> str:
    hits = [v for k, v in pinned.items() if pattern.match(k)]
    if len(hits) != 1:
        raise ResolveError(f"torch {torch}: expected one {what} package in its requirements, found {len(hits)}; is this a CUDA build?")
    return hits[0]


def wheel_facts(lock_text: str) -> WheelFacts:
    pinned = pins(lock_text)
    torch = pinned.get("torch", "?")
    runtime = _one(pinned, _CUDA_RUNTIME, "CUDA runtime", torch)
    return WheelFacts(
        torch=torch,
        torch_cuda=".".join(runtime.split(".")[:2]),
        cudnn=_one(pinned, _CUDNN, "cuDNN", torch),
        nccl=_one(pinned, _NCCL, "NCCL", torch),
        deepspeed=pinned.get("deepspeed", "?"),
    )


_DEBIAN_INDEX: dict[tuple[str, str], dict[str, dict[str, str]]] = {}


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
    for fields in _stanzas(packages_text):
        name = fields.get("Package")
        if name and fields.get("Version") and (name not in index or _newer(fields["Version"], index[name]["Version"])):
            index[name] = fields
    return index


def _newer(a: str, b: str) -> bool:
    return Version(a) > Version(b)


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
    for name, fields in index.items():
        for dep in fields.get("Provides", "").split(","):
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
    if not KEYRING.exists() or not shutil.which("gpgv"):
        raise EnvironmentProblem(f"checking Debian's signature needs gpgv and {KEYRING} (Debian: apt-get install gpgv debian-archive-keyring)")
    url = f"{mirror.rstrip('/')}/dists/{suite}/InRelease"
    data = _fetch(url, ca_bundle)
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


def _stanzas(text: str) -> list[dict[str, str]]:
    return [dict(ln.split(": ", 1) for ln in block.splitlines() if ": " in ln and not ln.startswith(" "))
            for block in text.split("\n\n")]


def fetch_verified(url: str, sha256: str, ca_bundle: str | None) -> bytes:
    """A file whose sha256 a signed index gave: its bytes, or a ResolveError."""
    data = _fetch(url, ca_bundle)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ResolveError(f"{url} does not match the sha256 in its signed index")
    return data


def debian_toolkit(mirror: str, suite: str, components: tuple[str, ...], packages: tuple[str, ...],
                   ca_bundle: str | None) -> list[Deb]:
    """The toolkit's .debs with their sha256, read from indexes whose hashes the signed Release vouches for."""
    release = signed_release(mirror, suite, ca_bundle)
    hashes = _release_hashes(release)
    index: dict[str, dict[str, str]] = {}
    for component in components:
        path = f"{component}/binary-amd64/Packages.xz"
        if path not in hashes:
            raise ResolveError(f"Debian {suite} at {mirror} has no {path}")
        data = _fetch(f"{mirror.rstrip('/')}/dists/{suite}/{path}", ca_bundle)
        if hashlib.sha256(data).hexdigest() != hashes[path]:
            raise ResolveError(f"{mirror}/dists/{suite}/{path} does not match the sha256 in the signed Release")
        for fields in _stanzas(lzma.decompress(data).decode()):
            if "Package" in fields:
                index.setdefault(fields["Package"], fields)
    missing = [p for p in packages if p not in index]
    if missing:
        raise ResolveError(f"Debian {suite} ({', '.join(components)}) at {mirror} has no package {', '.join(missing)}")
    return [Deb(p, index[p]["Version"], index[p]["Filename"], index[p]["SHA256"], int(index[p]["Size"])) for p in packages]


def pypi_toolkit(image: Image, wheel_lock: str, ca_bundle: str | None, exclude_newer: str | None = None) -> str:
    """Hash-pinned nvcc & co. from `cuda-toolkit[extras]` at the version torch pins, minus what torch already installs.

    exclude_newer as for compile_lock.
    """
    pinned = pins(wheel_lock)
    version = pinned.get("cuda-toolkit")
    if not version:
        raise ResolveError(f"{image.name}: torch {image.torch} pins no cuda-toolkit; a pypi toolkit needs one (use a debian toolkit for this CUDA major)")
    spec = f"cuda-toolkit[{','.join(image.toolkit.extras)}]=={version}"
    out = _run_uv(image, spec + "\n", spec, exclude_newer, ca_bundle, "--no-annotate")
    blocks = re.split(r"\n(?=\S)", out.strip())
    keep, notes = [], []
    for block in blocks:
        m = _PIN.match(block)
        if not m:
            continue
        name, ver = m.group(1).lower().replace("_", "-"), m.group(2)
        if name in pinned:
            # torch's own pins are installed already and must not move; a compiler whose
            # runtime is not the one torch ships would build ops against the wrong CUDA.
            if pinned[name] != ver and name in _COMPILER_CORE:
                raise ResolveError(f"{image.name}: {spec} wants {name}=={ver}, torch pins {pinned[name]}")
            if pinned[name] != ver:
                notes.append(f"# {spec} asks for {name}=={ver}; torch pins {pinned[name]}, which is installed\n")
            continue
        keep.append(block)
    return "".join(notes) + "\n".join(keep) + "\n"
