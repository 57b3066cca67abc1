"""`lock` pins Debian packages from a release and its security/updates suites: the newest
version any suite holds, and the update suites' versions of everything the image can hold
(the structure check's floor). Indexes here are small hand-made ones; no network."""
from __future__ import annotations

import pytest

from pytorch_cuda_build.errors import ResolveError
from pytorch_cuda_build.resolve import debian as resolve_debian

MAIN = {
    "libc6": {"Version": "2.36-9+deb12u10", "Priority": "required"},
    "base-files": {"Version": "12.4+deb12u11", "Priority": "required", "Depends": "libc6"},
    "openssh-server": {"Version": "1:9.2p1-2+deb12u5", "Pre-Depends": "init-system-helpers (>= 1.54~)",
                       "Depends": "openssh-client (= 1:9.2p1-2+deb12u5), libssl3 (>= 3.0.0), default-logind | logind | libpam-systemd"},
    "openssh-client": {"Version": "1:9.2p1-2+deb12u5", "Depends": "libssl3 (>= 3.0.0)"},
    "libssl3": {"Version": "3.0.15-1~deb12u1", "Depends": "libc6:any (>= 2.34)"},
    "init-system-helpers": {"Version": "1.65.2"},
    "libpam-systemd": {"Version": "252.36-1~deb12u1"},
    "systemd-logind-impl": {"Version": "1", "Provides": "logind, default-logind (= 1)"},
    "unrelated": {"Version": "1.0"},
}
SECURITY = {
    "libssl3": {"Version": "3.0.22-1~deb12u2"},
    "openssh-client": {"Version": "1:9.2p1-2+deb12u10"},
    "openssh-server": {"Version": "1:9.2p1-2+deb12u10"},
    "unrelated": {"Version": "1.1"},
    "libc6": {"Version": "2.36-9+deb12u9"},  # older than main's point release: main wins
}
UPDATES = {"base-files": {"Version": "12.4+deb12u12"}}


@pytest.fixture
def suites(monkeypatch):
    monkeypatch.setattr(resolve_debian, "_DEBIAN_INDEX", {("m", "bookworm"): MAIN, ("s", "bookworm-security"): SECURITY,
                                                   ("m", "bookworm-updates"): UPDATES})
    return resolve_debian.DebianSuites("m", "bookworm", (("s", "bookworm-security"), ("m", "bookworm-updates")), None)


def test_each_named_package_is_pinned_at_the_newest_version_of_any_suite(suites):
    assert suites.newest(["openssh-server", "libssl3", "libc6", "init-system-helpers"]) == {
        "openssh-server": "1:9.2p1-2+deb12u10", "libssl3": "3.0.22-1~deb12u2", "libc6": "2.36-9+deb12u10",
        "init-system-helpers": "1.65.2"}


def test_a_package_no_suite_has_is_one_error(suites):
    with pytest.raises(ResolveError, match="has no package nosuch"):
        suites.newest(["openssh-server", "nosuch"])


def test_fixes_cover_dependencies_and_the_required_set_but_not_the_rest(suites):
    assert suites.fixes(["openssh-server"]) == {
        "base-files": "12.4+deb12u12",  # required, from -updates
        "libc6": "2.36-9+deb12u9",  # the security suite's own version, the floor it sets
        "libssl3": "3.0.22-1~deb12u2",  # a dependency of a dependency
        "openssh-client": "1:9.2p1-2+deb12u10",
        "openssh-server": "1:9.2p1-2+deb12u10",
    }


def test_closure_follows_alternatives_providers_and_arch_qualifiers():
    got = resolve_debian.closure(MAIN, ["openssh-server"])
    assert got == {"openssh-server", "openssh-client", "libssl3", "libc6", "init-system-helpers",
                   "libpam-systemd", "systemd-logind-impl"}


def test_debian_version_order_is_debians():
    assert resolve_debian._newer("1:1.0", "9.9") and resolve_debian._newer("3.0.22-1~deb12u2", "3.0.20-1~deb12u2")
    assert not resolve_debian._newer("1.0~rc1", "1.0") and resolve_debian._newer("1.0-2", "1.0-1+b1")
