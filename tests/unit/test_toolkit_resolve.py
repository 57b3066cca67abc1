"""The Debian toolkit's lock: index hashes must match the signed Release, packages must exist (no network)."""
from __future__ import annotations

import hashlib
import lzma

import pytest

from pytorch_cuda_build.errors import ResolveError
from pytorch_cuda_build.resolve import debian as resolve_debian

INDEX = b"Package: nvidia-cuda-toolkit\nVersion: 12.4.131~12.4.1-2\nFilename: pool/n/t.deb\nSHA256: ab\nSize: 3\n\n"


def fake(monkeypatch, index: bytes, listed_hash: str) -> None:
    release = f"Suite: trixie\nSHA256:\n {listed_hash} {len(index)} non-free/binary-amd64/Packages.xz\n"
    monkeypatch.setattr(resolve_debian, "signed_release", lambda *a: release)
    monkeypatch.setattr(resolve_debian, "_fetch", lambda url, ca: index)


def test_packages_come_with_their_locked_sha256(monkeypatch):
    xz = lzma.compress(INDEX)
    fake(monkeypatch, xz, hashlib.sha256(xz).hexdigest())
    (deb,) = resolve_debian.debian_toolkit("http://m", "trixie", ("non-free",), ("nvidia-cuda-toolkit",), None)
    assert (deb.version, deb.filename, deb.sha256, deb.size) == ("12.4.131~12.4.1-2", "pool/n/t.deb", "ab", 3)


def test_an_index_the_signed_release_does_not_vouch_for_is_refused(monkeypatch):
    fake(monkeypatch, lzma.compress(INDEX), "0" * 64)
    with pytest.raises(ResolveError, match="does not match the sha256 in the signed Release"):
        resolve_debian.debian_toolkit("http://m", "trixie", ("non-free",), ("nvidia-cuda-toolkit",), None)


def test_a_missing_package_is_named(monkeypatch):
    xz = lzma.compress(INDEX)
    fake(monkeypatch, xz, hashlib.sha256(xz).hexdigest())
    with pytest.raises(ResolveError, match="has no package libnvvm4"):
        resolve_debian.debian_toolkit("http://m", "trixie", ("non-free",), ("nvidia-cuda-toolkit", "libnvvm4"), None)


def test_a_toolkit_version_the_suite_no_longer_has_stops_the_lock(monkeypatch):
    from pathlib import Path

    from pytorch_cuda_build import matrix
    from pytorch_cuda_build.errors import LockError
    from pytorch_cuda_build.stages import lock

    image = matrix.load(Path(__file__).resolve().parents[2] / "matrix.yaml").select("2.7", "12.1")
    newer = resolve_debian.Deb("nvidia-cuda-toolkit", "12.4.131~12.4.1-3", "pool/n/t.deb", "ab", 3)
    monkeypatch.setattr(resolve_debian, "debian_toolkit", lambda *a: [newer])
    with pytest.raises(LockError, match="nvidia-cuda-toolkit 12.4.131~12.4.1-2 in matrix.yaml but Debian trixie has 12.4.131~12.4.1-3"):
        lock.resolve_toolkit(image, "", None)
