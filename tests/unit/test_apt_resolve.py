"""The exact Debian files of each step, by apt's own solver over a suite's index (resolve/apt.py),
and debs.lock's format (pytorch_cuda_runtime/lockfile.py). Offline: small indexes written here,
the host's apt-get (Debian's) run with --simulate in a throwaway tree."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pytorch_cuda_build.errors import ResolveError
from pytorch_cuda_build.resolve import apt
from pytorch_cuda_runtime import lockfile

from helpers import debian_suite as suite

pytestmark = pytest.mark.skipif(not shutil.which("apt-get"), reason="resolving needs apt-get (Debian or Ubuntu)")

MIRROR = "http://deb.example/debian"
SECURITY = "http://deb.example/debian-security"


def stanza(name: str, version: str, *, depends: str = "", essential: bool = False, priority: str = "optional",
           provides: str = "") -> str:
    lines = [f"Package: {name}", f"Version: {version}", "Installed-Size: 10", "Maintainer: Debian <d@example.org>",
             "Architecture: amd64", f"Priority: {priority}", "Section: misc", f"Description: {name}",
             f"Filename: pool/main/{name[0]}/{name}/{name}_{version}_amd64.deb", f"Size: {len(name) * 100}",
             f"SHA256: {(name + version).encode().hex()[:64].ljust(64, '0')}"]
    lines += [f"Depends: {depends}"] if depends else []
    lines += ["Essential: yes"] if essential else []
    lines += [f"Provides: {provides}"] if provides else []
    return "\n".join(lines) + "\n"


RELEASE = [
    stanza("base-files", "12.4", essential=True, priority="required"),
    stanza("libc6", "2.36-9+deb12u14", priority="required"),
    stanza("dash", "0.5.12-2", essential=True, priority="required", depends="libc6 (>= 2.34)"),
    stanza("apt", "2.6.1", priority="important", depends="libc6, gpgv | gpgv2"),
    stanza("gpgv", "2.2.40-1.1", priority="important", depends="libc6"),
    stanza("gpgv2", "2.2.40-1.1", depends="libc6"),
    stanza("usr-is-merged", "37~deb12u1", priority="required"),
    stanza("tini", "0.19.0-1+b3", depends="libc6"),
    stanza("openssl", "3.0.17-1~deb12u2", depends="libc6, libssl3 (>= 3.0.17)"),
    stanza("libssl3", "3.0.17-1~deb12u2", depends="libc6"),
    stanza("unused", "1.0", depends="libc6"),
]
FIXES = [stanza("libssl3", "3.0.22-1~deb12u2", depends="libc6"), stanza("libc6", "2.36-9+deb12u15", priority="required")]


def test_each_step_is_what_apt_would_install_there_each_file_by_its_index_entry():
    release, security = suite(MIRROR, "bookworm", RELEASE), suite(SECURITY, "bookworm-security", FIXES)
    steps = apt.steps(release, [security], "amd64", {"tini": "0.19.0-1+b3"}, {"openssl": "3.0.17-1~deb12u2"})
    base = {d.package: d.version for d in steps.base}
    # minbase: Essential, required, apt (and its dependencies: one alternative, not both), usr-is-merged
    assert base == {"base-files": "12.4", "libc6": "2.36-9+deb12u14", "dash": "0.5.12-2", "apt": "2.6.1", "gpgv": "2.2.40-1.1",
                    "usr-is-merged": "37~deb12u1"}
    # the apt step: the security suite's fix of what the base holds, then the named packages
    assert {d.package: d.version for d in steps.apt} == {"libc6": "2.36-9+deb12u15", "tini": "0.19.0-1+b3"}
    # the ops builder's step: what it adds, at the newest version (the security suite's libssl3)
    assert {d.package: d.version for d in steps.build} == {"openssl": "3.0.17-1~deb12u2", "libssl3": "3.0.22-1~deb12u2"}
    fixed = next(d for d in steps.apt if d.package == "libc6")
    assert fixed.url == f"{SECURITY}/pool/main/l/libc6/libc6_2.36-9+deb12u15_amd64.deb" and fixed.size == 500
    assert steps.installed()["libc6"] == "2.36-9+deb12u15" and "openssl" not in steps.installed()  # the builder's stays there
    assert [d.package for d in steps.index] == ["-", "-"] and steps.index[0].url == f"{MIRROR}/dists/bookworm/InRelease"


def test_a_pin_no_suite_holds_is_one_line_from_apt():
    release = suite(MIRROR, "bookworm", RELEASE)
    with pytest.raises(ResolveError, match=r"apt cannot resolve `install tini=9.9` over bookworm: .*tini"):
        apt.steps(release, [], "amd64", {"tini": "9.9"}, {})


def test_debs_lock_reads_back_what_it_wrote_and_refuses_a_bad_line():
    d = lockfile.Deb("tini", "0.19.0-1+b3", f"{MIRROR}/pool/main/t/tini/tini_0.19.0-1+b3_amd64.deb", "a" * 64, 123)
    idx = lockfile.Deb("-", "", f"{MIRROR}/dists/bookworm/InRelease", "b" * 64, 9)
    text = lockfile.deb_steps_text("# header\n", {"index": [idx], "apt": [d]})
    assert text.splitlines()[1:] == [f"index {'b' * 64} 9 {MIRROR}/dists/bookworm/InRelease -",
                                     f"apt {'a' * 64} 123 {d.url} tini=0.19.0-1+b3"]
    assert lockfile.deb_steps(text) == {"index": [idx], "base": [], "apt": [d], "build": []}
    assert d.file == "tini_0.19.0-1+b3_amd64.deb" and d.input == lockfile.Input(d.file, d.url, d.sha256, 123)
    with pytest.raises(lockfile.LockFormatError, match=r"debs.lock:2: unknown step 'upgrade'"):
        lockfile.deb_steps("# h\nupgrade " + " ".join(text.splitlines()[2].split()[1:]))
    with pytest.raises(lockfile.LockFormatError, match=r"debs.lock:1: expected `sha256 size url package=version`"):
        lockfile.deb_steps(f"apt {'a' * 63} 1 {d.url} tini=1")


def test_pins_are_named_as_pep_503_says_once_for_both_packages():
    text = "Nvidia_CUDNN.cu12==9.5.1.17 \\\n    --hash=sha256:" + "c" * 64 + "\n    # via torch\nsix==1.17.0 \\\n    --hash=sha256:" + "d" * 64 + "\n"
    pins = lockfile.pins(text)
    assert [(p.name, p.version) for p in pins] == [("nvidia-cudnn-cu12", "9.5.1.17"), ("six", "1.17.0")]
    assert pins[0].hashes == frozenset({"c" * 64}) and pins[0].requirement == f"nvidia-cudnn-cu12==9.5.1.17 --hash=sha256:{'c' * 64}"
    with pytest.raises(lockfile.LockFormatError, match="not a file record"):
        lockfile.Input.from_json({"file": "a/b.whl", "url": "https://x/a", "sha256": "e" * 64, "size": 1}, "lock.json")


def test_a_security_relock_moves_exactly_the_fixed_package(monkeypatch):
    """The security suite gains a fix of a package the image holds: a relock changes that package's
    line of debs.lock and its version in lock.json `debian`, and nothing else; the structure check
    then holds the image to it (checks/test_image.py, the Debian packages exactly the locked ones)."""
    from dataclasses import replace

    from pytorch_cuda_build import matrix
    from pytorch_cuda_build.stages import lock

    row = matrix.load(Path(__file__).resolve().parents[2] / "matrix.yaml").select("2.7", "12.1")
    os_ = row.os.model_copy(update={"mirror": MIRROR, "suite": "bookworm", "packages": ("tini", "openssl"), "build_packages": (),
                                    "updates": (matrix.AptSource(mirror=SECURITY, suite="bookworm-security"),)})
    image = replace(row, os=os_)

    def world(fixes: list[str]):
        suites = {(MIRROR, "bookworm"): suite(MIRROR, "bookworm", RELEASE), (SECURITY, "bookworm-security"): suite(SECURITY, "bookworm-security", fixes)}
        monkeypatch.setattr(lock.resolve_debian, "read_suite", lambda mirror, name, arch, ca: suites[(mirror, name)])
        return lock.debian_lock(image, "linux/amd64", None)

    before = world(FIXES)
    after = world([*FIXES, stanza("libssl3", "3.0.23-1~deb12u1", depends="libc6")])
    moved = {n: (before.installed.get(n), v) for n, v in after.installed.items() if before.installed.get(n) != v}
    assert moved == {"libssl3": ("3.0.22-1~deb12u2", "3.0.23-1~deb12u1")}
    changed = sorted(set(before.text.splitlines()) ^ set(after.text.splitlines()))
    assert len(changed) == 2 and all("libssl3" in line for line in changed), changed
    assert after.pins == {"tini": "0.19.0-1+b3", "openssl": "3.0.17-1~deb12u2"}
