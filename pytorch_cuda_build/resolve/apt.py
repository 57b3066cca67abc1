"""Lock's helper: the exact Debian files a row's build installs, by apt's own solver, offline.

A row's image holds Debian packages from three steps: the base (mmdebstrap's minbase from the
release), the base stage's apt step (the security and updates suites' fixes to what the base
holds, then the OS's `packages`) and the ops builder's (`build_packages`). Each step's set is
what apt itself would install there: `apt-get --simulate` run over the suites' signed indexes
(read and checked by debian.py) in a throwaway apt tree whose dpkg status is the step before it.
Nothing here installs anything or needs root; it needs the host's apt-get, as mmdebstrap does.

The result names each .deb by its pool address and the sha256 and size the signed index gives,
so a build can take the files from the store (fetch.py) with no mirror at all.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pytorch_cuda_runtime.lockfile import Deb

from ..errors import EnvironmentProblem, ResolveError
from . import debian

# The base: mmdebstrap's minbase (Essential: yes, Priority: required, apt) with merged /usr as
# its merged-usr hook makes it (usr-is-merged, not usrmerge): base.py runs exactly that.
MINBASE = ("?narrow(?architecture({arch}),?essential)", "?narrow(?architecture({arch}),?priority(required))", "apt", "usr-is-merged")
# `Inst libc6 [2.36-9+deb12u7] (2.36-9+deb12u14 Debian:12.15/oldstable [amd64])`: name, new version, arch.
_INST = re.compile(r"^Inst (\S+) (?:\[[^\]]*\] )?\((\S+) .*\[([a-z0-9]+)\]\)")
# Stanza fields apt reads from a dpkg status file to know what is installed.
_STATUS_FIELDS = ("Package", "Essential", "Priority", "Section", "Installed-Size", "Maintainer", "Architecture",
                  "Multi-Arch", "Source", "Version", "Replaces", "Provides", "Depends", "Pre-Depends", "Breaks",
                  "Conflicts", "Recommends", "Suggests", "Enhances", "Protected")


@dataclass(frozen=True)
class Steps:
    """The .debs of each step, in the order apt named them; `installed`: what the image then holds."""

    base: tuple[Deb, ...]
    apt: tuple[Deb, ...]
    build: tuple[Deb, ...]
    index: tuple[Deb, ...]  # the release's InRelease and Packages.xz, which mmdebstrap reads (package "-")

    def installed(self) -> dict[str, str]:
        """name -> version of every package the image holds (the base, then its apt step)."""
        out = {d.package: d.version for d in self.base}
        out.update({d.package: d.version for d in self.apt})
        return dict(sorted(out.items()))


def _list_name(url: str) -> str:
    """apt's file name in /var/lib/apt/lists for an index URL."""
    return re.sub(r"^[a-z]+://", "", url).replace("/", "_")


class _Tree:
    """A throwaway apt tree: the suites' checked indexes as apt's lists, and a dpkg status."""

    def __init__(self, work: Path, arch: str, suites: list[debian.Suite]):
        self.work, self.arch, self.suites = work, arch, suites
        lists = work / "lists"
        (lists / "partial").mkdir(parents=True)
        (work / "archives" / "partial").mkdir(parents=True)
        (work / "etc" / "preferences.d").mkdir(parents=True)
        (work / "etc" / "apt.conf.d").mkdir(parents=True)
        sources = []
        for s in suites:
            base = f"{s.mirror.rstrip('/')}/dists/{s.suite}"
            (lists / _list_name(f"{base}/InRelease")).write_bytes(s.inrelease)
            (lists / _list_name(f"{base}/main/binary-{arch}/Packages")).write_text(s.packages_text)
            sources.append(f"deb [arch={arch} trusted=yes] {s.mirror} {s.suite} main\n")
        (work / "etc" / "sources.list").write_text("".join(sources))
        self.status = work / "status"
        self.status.write_text("")
        self.config = work / "apt.conf"
        self.config.write_text(
            f'Dir "{work}/";\nDir::Etc "{work}/etc/";\nDir::State "{work}/";\nDir::State::lists "{lists}/";\n'
            f'Dir::State::status "{self.status}";\nDir::Cache "{work}/";\nDir::Cache::archives "{work}/archives/";\n'
            f'APT::Architecture "{arch}";\nAPT::Architectures {{ "{arch}"; }};\nAPT::Install-Recommends "false";\n'
            'APT::Install-Suggests "false";\nAcquire::Languages "none";\nDebug::NoLocking "true";\n'
            'Dir::Etc::TrustedParts "/nonexistent";\nAPT::Get::AllowUnauthenticated "true";\n')

    def simulate(self, *args: str) -> list[tuple[str, str, str]]:
        """(name, version, arch) of each package apt-get --simulate would unpack, in its order."""
        proc = subprocess.run(["apt-get", "--simulate", "--quiet", "--yes", *args], capture_output=True, text=True,
                              env={"APT_CONFIG": str(self.config), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"})
        if proc.returncode != 0:
            reason = " ".join(line.strip() for line in proc.stderr.splitlines() if line.startswith("E:")) or proc.stderr.strip()[-300:]
            raise ResolveError(f"apt cannot resolve `{' '.join(args)}` over {', '.join(s.suite for s in self.suites)}: {reason}")
        return [(m.group(1), m.group(2), m.group(3)) for m in map(_INST.match, proc.stdout.splitlines()) if m]

    def install(self, debs: list[tuple[str, str, str]], stanzas: dict[tuple[str, str], dict[str, str]]) -> None:
        """Record debs as installed in the tree's dpkg status (replacing older versions)."""
        held = _read_status(self.status)
        for name, version, _arch in debs:
            held[name] = {k: v for k, v in stanzas[(name, version)].items() if k in _STATUS_FIELDS}
        text = "".join("".join(f"{k}: {v}\n" for k, v in {**fields, "Status": "install ok installed"}.items()) + "\n"
                       for _, fields in sorted(held.items()))
        self.status.write_text(text)


def _read_status(path: Path) -> dict[str, dict[str, str]]:
    out = {}
    for fields in debian.stanzas(path.read_text()):
        if "Package" in fields:
            out[fields["Package"]] = {k: v for k, v in fields.items() if k != "Status"}
    return out


def steps(release: debian.Suite, updates: list[debian.Suite], arch: str, packages: dict[str, str],
          build_packages: dict[str, str]) -> Steps:
    """The .debs of the base, the apt step (fixes, then packages at their pins) and the ops
    builder's step (build_packages at their pins) on arch."""
    if not shutil.which("apt-get"):
        raise EnvironmentProblem("locking a row's Debian packages runs apt's solver (apt-get --simulate): "
                                 "lock on a Debian or Ubuntu host, or in a Debian container")
    stanzas: dict[tuple[str, str], dict[str, str]] = {}
    where: dict[tuple[str, str], debian.Suite] = {}
    for s in [release, *updates]:
        for fields in s.stanzas:
            key = (fields["Package"], fields["Version"])
            if key not in stanzas:
                stanzas[key], where[key] = fields, s

    def debs(found: list[tuple[str, str, str]]) -> tuple[Deb, ...]:
        out = []
        for name, version, _arch in found:
            fields = stanzas.get((name, version))
            if fields is None:
                raise ResolveError(f"apt chose {name} {version}, which no index read here lists")
            out.append(Deb(package=name, version=version, url=f"{where[(name, version)].mirror.rstrip('/')}/{fields['Filename']}",
                           sha256=fields["SHA256"], size=int(fields["Size"])))
        return tuple(out)

    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-apt-") as tmp:
        base_tree = _Tree(Path(tmp) / "base", arch, [release])
        base = base_tree.simulate("install", *(p.format(arch=arch) for p in MINBASE))
        tree = _Tree(Path(tmp) / "image", arch, [release, *updates])
        tree.install(base, stanzas)
        fixes = tree.simulate("upgrade")
        tree.install(fixes, stanzas)
        named = tree.simulate("install", *(f"{n}={v}" for n, v in packages.items()))
        tree.install(named, stanzas)
        build = tree.simulate("install", *(f"{n}={v}" for n, v in build_packages.items())) if build_packages else []
    apt_step = {d[0]: d for d in fixes}
    apt_step.update({d[0]: d for d in named})
    return Steps(base=debs(base), apt=debs(list(apt_step.values())), build=debs(build), index=release.index_files())
