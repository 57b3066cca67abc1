"""A dated snapshot.debian.org mirror: the release and its security/updates suites frozen at
one timestamp, so an old commit rebuilds with its pinned versions. No network: matrices are
written to tmp_path, Release texts are made here."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.errors import MatrixError, ResolveError
from pytorch_cuda_build.resolve import debian as resolve_debian
from pytorch_cuda_build.stages import render

from helpers import ROOT

LIVE = ("http://deb.debian.org/debian", "http://deb.debian.org/debian-security")
AT = "20261120T000000Z"
SNAP = (f"http://snapshot.debian.org/archive/debian/{AT}", f"http://snapshot.debian.org/archive/debian-security/{AT}")
NOW = datetime(2026, 11, 23, tzinfo=timezone.utc)


def with_mirrors(tmp_path, main: str, security: str, updates: str):
    """matrix.yaml with the bookworm OS's three mirrors replaced, loaded."""
    text = (ROOT / "matrix.yaml").read_text()
    for old, new in ((f"mirror: {LIVE[0]}\n    variant", f"mirror: {main}\n    variant"),
                     (f"{{mirror: {LIVE[1]}, suite: bookworm-security}}", f"{{mirror: {security}, suite: bookworm-security}}"),
                     (f"{{mirror: {LIVE[0]}, suite: bookworm-updates}}", f"{{mirror: {updates}, suite: bookworm-updates}}")):
        assert text.count(old) == 1, old  # the test edits what matrix.yaml really says
        text = text.replace(old, new)
    path = tmp_path / "matrix.yaml"
    path.write_text(text)
    return matrix.load(path)


def test_snapshot_time_is_read_from_a_dated_archive_url_only():
    assert matrix.snapshot_time(SNAP[0]) == AT and matrix.snapshot_time(SNAP[1] + "/") == AT
    for other in (*LIVE, "http://snapshot.debian.org/archive/debian/", "http://snapshot.debian.org/archive/debian/2026-11-20",
                  "http://mirror.example/snapshot.debian.org/archive/debian/20261120T000000Z", None):
        assert matrix.snapshot_time(other) is None, other


def test_a_snapshot_matrix_renders_sources_apt_accepts_past_their_valid_until(tmp_path):
    m = with_mirrors(tmp_path, SNAP[0], SNAP[1], SNAP[0])
    row = m.select("2.7", "12.1")
    assert render.apt_sources(row) == (f"deb [check-valid-until=no] {SNAP[1]} bookworm-security main;"
                                       f"deb [check-valid-until=no] {SNAP[0]} bookworm-updates main")


def test_the_live_matrix_renders_plain_sources():
    row = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
    assert "check-valid-until" not in render.apt_sources(row)
    assert render.apt_sources(row).startswith(f"deb {LIVE[1]} bookworm-security main")


@pytest.mark.parametrize("main,security,updates", [
    (SNAP[0], LIVE[1], SNAP[0]),  # security fixes from today on an old release: not a rebuild
    (LIVE[0], SNAP[1], LIVE[0]),
    (SNAP[0], SNAP[1].replace(AT, "20261001T000000Z"), SNAP[0]),  # two dates
])
def test_a_half_frozen_os_is_refused_with_one_line(tmp_path, main, security, updates):
    with pytest.raises(MatrixError) as e:
        with_mirrors(tmp_path, main, security, updates)
    lines = e.value.lines()
    assert len(lines) == 1 and "snapshot.debian.org at one timestamp, or none of them" in lines[0], lines


RELEASE = "Origin: Debian\nSuite: stable-security\nDate: Sat, 14 Nov 2026 00:53:02 UTC\n{valid}SHA256:\n x 1 main/Packages\n"


def test_an_expired_live_index_is_refused_as_apt_would():
    text = RELEASE.format(valid="Valid-Until: Sat, 21 Nov 2026 00:53:02 UTC\n")
    with pytest.raises(ResolveError, match=r"expired at Sat, 21 Nov 2026 00:53:02 UTC \(Valid-Until\): a stale mirror or a replayed index"):
        resolve_debian.check_valid_until(text, "http://deb.debian.org/debian-security/dists/bookworm-security/InRelease",
                                  snapshot=False, now=NOW)


def test_a_current_index_an_index_without_expiry_and_a_snapshot_pass():
    resolve_debian.check_valid_until(RELEASE.format(valid="Valid-Until: Sat, 28 Nov 2026 00:53:02 UTC\n"), "u", snapshot=False, now=NOW)
    resolve_debian.check_valid_until(RELEASE.format(valid=""), "u", snapshot=False, now=NOW)  # bookworm main has none
    resolve_debian.check_valid_until(RELEASE.format(valid="Valid-Until: Sat, 21 Nov 2026 00:53:02 UTC\n"), "u", snapshot=True, now=NOW)


def test_an_unreadable_valid_until_is_an_error_not_a_pass():
    with pytest.raises(ResolveError, match="unreadable Valid-Until"):
        resolve_debian.check_valid_until(RELEASE.format(valid="Valid-Until: next week\n"), "u", snapshot=False, now=NOW)
