"""Stage 8: known vulnerabilities of an image: Python advisories, and Debian packages behind the
security suite. Written to build-results/<image>/vulnerabilities.json; publish refuses an
image whose report lists a critical advisory that no --allow-vulnerable names.

Python: PyPI's JSON API answers `/pypi/<name>/<version>/json` with a `vulnerabilities`
list (OSV advisories: id, aliases, fixed_in, link, withdrawn). Each (name, version) is
asked once however many images pin it; withdrawn advisories are skipped. A version PyPI
does not know (HTTP 404), or that a snapshot did not record, is listed as unchecked,
never counted as clean.

Severity: PyPI's answers carry none, and none is guessed from the text. An advisory's
severity is the `severity` key of its data when present (a recorded answer may carry
one, e.g. OSV's GHSA rating: CRITICAL, HIGH, MODERATE, LOW), else UNKNOWN. Only CRITICAL
stops a publish. With PyPI's live answers as they are today every advisory is UNKNOWN:
the report lists each for a person to judge, and the gate alone stops none of them.

Debian: the OS's security suite (matrix.yaml `updates`), read as `lock` reads it
(resolve_debian.debian_index: InRelease checked with gpgv, Packages.xz against its sha256 there),
gives each package's newest version. An
installed version older by Debian's ordering (epochs, `~`, revisions: python-debian) is
behind.
"""
from __future__ import annotations

import concurrent.futures as futures
import datetime as dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Protocol

import requests
from debian.debian_support import Version

from .. import ca, paths
from ..errors import AdvisoryLookupError, BadFile, BadValue, NotReady, ResolveError, VulnerableImage
from ..files import write_atomic
from ..matrix import AptSource, Image
from ..registry.retry import Transient, retrying
from ..resolve import debian as resolve_debian
from ..resolve import pypi as resolve_pypi
from . import lock

PYPI = "https://pypi.org/pypi"
# Plain HTTP, as apt uses it: the signed InRelease vouches for the index, not the transport.
REPORT = "vulnerabilities.json"
CHECKED = "security.json"  # images/<image>/: the last `lock --check-security --record`, committed
CRITICAL = "CRITICAL"
SNAPSHOT_ANSWERS = "pypi.json"  # a snapshot's PyPI answers, keyed "name==version"


@dataclass(frozen=True)
class Advisory:
    id: str
    package: str
    installed: str
    fixed_in: tuple[str, ...]
    severity: str  # from the advisory's data, else UNKNOWN (see the module's docstring)
    link: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Behind:
    """A Debian package whose installed (or locked) version is older than the security suite's."""

    package: str
    installed: str
    security: str


class Sources(Protocol):
    """Where advisories come from: PyPI and Debian (Online), or a recorded folder (Snapshot)."""

    def answer(self, name: str, version: str) -> list[dict] | None:
        """The version's advisories as PyPI lists them; None when there is no answer for it."""

    def security_index(self, source: AptSource) -> dict[str, str]:
        """name -> newest version in the OS's security suite (matrix.yaml: updates, e.g. bookworm-security)."""

    def described(self) -> dict[str, str]:
        """What data was read, for the report's generated_from."""


class Online:
    """PyPI's JSON API and Debian's signed security index; each answer asked once."""

    def __init__(self, ca_bundle: str | None, attempts: int = 4, backoff: float = 2.0, session: requests.Session | None = None):
        self.ca_bundle, self.attempts, self.backoff = ca_bundle, attempts, backoff
        self.session = session or ca.session(ca_bundle)
        self._answers: dict[str, list[dict] | None] = {}
        self._read: set[str] = set()

    def answer(self, name: str, version: str) -> list[dict] | None:
        key = f"{name}=={version}"
        if key not in self._answers:
            url = f"{PYPI}/{name}/{version}/json"
            try:
                self._answers[key] = retrying(self.attempts, self.backoff)(lambda: self._get(url), url)
            except Transient as e:
                raise AdvisoryLookupError(f"{e} ({self.attempts} attempts)") from None
        return self._answers[key]

    def _get(self, url: str) -> list[dict] | None:
        try:
            r = self.session.get(url, timeout=30)
        except (requests.ConnectionError, requests.Timeout) as e:
            raise Transient(f"{url} unreachable ({type(e).__name__})") from None
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError) as e:
            # the answer cut short or garbled on the way (a proxy or the connection dropped it): ask again
            raise Transient(f"{url} answered in part ({type(e).__name__})") from None
        if r.status_code == 404:  # not on PyPI, or not this version: unchecked, not clean
            return None
        if r.status_code == 429 or r.status_code >= 500:
            raise Transient(f"{url} answered HTTP {r.status_code}")
        if r.status_code != 200:
            raise AdvisoryLookupError(f"{url} answered HTTP {r.status_code}")
        try:
            return list(r.json().get("vulnerabilities") or [])
        except (ValueError, AttributeError):
            raise AdvisoryLookupError(f"{url} did not answer with PyPI's JSON") from None

    def security_index(self, source: AptSource) -> dict[str, str]:
        try:
            index = resolve_debian.debian_index(source.mirror, source.suite, self.ca_bundle)
        except ResolveError as e:
            raise AdvisoryLookupError(str(e)) from None
        self._read.add(f"{source.mirror}/dists/{source.suite}/InRelease (signature checked)")
        return {name: fields["Version"] for name, fields in index.items()}

    def described(self) -> dict[str, str]:
        return {"python": f"{PYPI}/<name>/<version>/json", "debian": "; ".join(sorted(self._read)) or "not read"}


class Snapshot:
    """Recorded answers in a folder: pypi.json ({"name==version": {"vulnerabilities": [...]}})
    and <suite>.Packages (e.g. bookworm-security.Packages, the suite's uncompressed index)."""

    def __init__(self, folder: Path):
        path = folder / SNAPSHOT_ANSWERS
        if not folder.is_dir():
            raise BadFile(f"security snapshot {folder} is not a folder", path=folder)
        try:
            answers = json.loads(path.read_text())
        except FileNotFoundError:
            raise BadFile(f"security snapshot {folder} has no {SNAPSHOT_ANSWERS} (PyPI's answers keyed name==version)", path=folder) from None
        except json.JSONDecodeError as e:
            raise BadFile(f"{path} is not valid JSON ({e.msg}, line {e.lineno})", path=path) from None
        if not isinstance(answers, dict):
            raise BadFile(f"{path} must map name==version to PyPI's answer", path=path)
        self.folder, self.answers = folder, answers
        self._read: list[str] = []

    def answer(self, name: str, version: str) -> list[dict] | None:
        key = f"{name}=={version}"
        if key not in self.answers:
            return None
        found = self.answers[key]
        if not isinstance(found, dict) or not isinstance(found.get("vulnerabilities", []), list):
            raise BadFile(f"{self.folder / SNAPSHOT_ANSWERS}: {key} is not PyPI's answer (an object with a vulnerabilities list)", path=self.folder / SNAPSHOT_ANSWERS)
        return found.get("vulnerabilities", [])

    def security_index(self, source: AptSource) -> dict[str, str]:
        suite = source.suite
        path = self.folder / f"{suite}.Packages"
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise BadFile(f"security snapshot {self.folder} has no {path.name} (the uncompressed {source.mirror}/dists/{suite}/main/binary-amd64/Packages.xz)", path=path) from None
        self._read.append(path.name)
        return newest(text)

    def described(self) -> dict[str, str]:
        return {"python": f"snapshot {self.folder / SNAPSHOT_ANSWERS}", "debian": f"snapshot {', '.join(sorted(set(self._read))) or 'not read'}"}


# ---- Python ------------------------------------------------------------------------


def python_packages(root: Path, image: Image) -> dict[str, str]:
    """Every Python package the image's lock pins: lock.json's pins (a train image's extras too) and deepspeed.lock's sdists."""
    meta = lock.read(root, image)
    pins = dict(meta.get("pins", {}))
    for part in meta.get("extras", {}).values():  # a train image's extras, on each platform
        pins.update(part.get("pins", {}))
        pins.update(part.get("built", {}))
    sdists = lock.image_dir(root, image) / "deepspeed.lock"
    return {**pins, **(resolve_pypi.pins(sdists.read_text()) if sdists.exists() else {})}


def python_advisories(packages: Iterable[tuple[str, str]], sources: Sources) -> tuple[list[Advisory], list[str]]:
    """The advisories of each (name, version), each asked once; and the name==version with no answer."""
    pairs = sorted(set(packages))
    with futures.ThreadPoolExecutor(8) as pool:  # some 250 distinct pins over the matrix: seconds, not minutes
        answers = list(pool.map(lambda p: sources.answer(*p), pairs))
    found, unchecked = [], []
    for (name, version), answer in zip(pairs, answers):
        if answer is None:
            unchecked.append(f"{name}=={version}")
        found += [a for a in (_advisory(name, version, raw) for raw in answer or []) if a]
    return found, unchecked


def _advisory(name: str, version: str, raw: dict) -> Advisory | None:
    if raw.get("withdrawn"):
        return None
    severity = raw.get("severity")
    return Advisory(id=str(raw.get("id") or "unnamed"), package=name, installed=version,
                    fixed_in=tuple(raw.get("fixed_in") or ()), severity=severity.upper() if isinstance(severity, str) else "UNKNOWN",
                    link=raw.get("link") or "", aliases=tuple(raw.get("aliases") or ()))


# ---- Debian ------------------------------------------------------------------------


def _version(package: str, text: str) -> Version:
    try:
        return Version(text)
    except ValueError:
        raise BadValue(f"{package}: {text!r} is not a Debian version", name=package) from None


def newest(packages_text: str) -> dict[str, str]:
    """name -> newest version in a Debian Packages index (resolve_debian.newest_stanzas, as `lock` reads one)."""
    try:
        return {name: f["Version"] for name, f in resolve_debian.newest_stanzas(packages_text).items()}
    except ValueError as e:
        raise BadValue(f"a Debian index holds a version Debian's ordering cannot read ({e})", name="Debian version") from None


def behind(installed: dict[str, str], security: dict[str, str]) -> list[Behind]:
    """The installed packages that the security suite has a newer version of."""
    return [Behind(name, version, security[name]) for name, version in sorted(installed.items())
            if name in security and _version(name, version) < _version(name, security[name])]


def security_suite(image: Image) -> AptSource | None:
    """The security suite among the OS's update suites (matrix.yaml), e.g. bookworm-security; None without one."""
    return next((u for u in image.os.updates if u.suite.endswith("-security")), None)


def sbom_debian(doc: dict) -> dict[str, str]:
    """name -> version of the Debian packages in a CycloneDX SBOM that pytorch_cuda_runtime/sbom.py wrote."""
    return {c["name"]: c["version"] for c in doc.get("components", []) if c.get("purl", "").startswith("pkg:deb/")}


# ---- the report, and the gate that reads it -------------------------------------------


def write_report(image: str, advisories: list[Advisory], debian_behind: list[Behind], path: Path,
                 generated_from: dict | None = None, unchecked: list[str] | None = None) -> dict:
    """build-results/<image>/vulnerabilities.json, written atomically; returns what was written."""
    python = [{"id": a.id, "package": a.package, "installed": a.installed, "fixed_in": list(a.fixed_in),
               "severity": a.severity, "link": a.link, "aliases": list(a.aliases)} for a in advisories]
    report = {
        "image": image,
        "generated_from": generated_from or {},
        "python": python,
        "python_unchecked": sorted(unchecked or []),
        "debian_behind_security": [asdict(b) for b in debian_behind],
        "counts": {"python": len(python), "debian": len(debian_behind), "critical": sum(a.severity == CRITICAL for a in advisories)},
    }
    write_atomic(path, json.dumps(report, indent=2) + "\n")
    return report


def report_for_image(root: Path, image: Image, installed_debian: dict[str, str], fetch: Sources | None = None,
                     ca_bundle: str | None = None) -> dict:
    """The image's vulnerabilities.json from its locked Python packages and its installed Debian
    packages (sbom_debian of its SBOM); fetch defaults to PyPI and Debian online."""
    sources = fetch or Online(ca_bundle)
    found, unchecked = python_advisories(python_packages(root, image).items(), sources)
    suite = security_suite(image)
    late = behind(installed_debian, sources.security_index(suite)) if suite else []
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return write_report(image.name, found, late, paths.results_dir(root, image) / REPORT,
                        {**sources.described(), "at": when}, unchecked)


def record(root: Path, image: Image, installed_debian: dict[str, str], ca_bundle: str | None, log: Callable[[str], None]) -> dict:
    """The build's report step: report_for_image online. Without PyPI or Debian the image is
    still the tested image: the report says nothing could be checked, and why, and the build goes on."""
    try:
        report = report_for_image(root, image, installed_debian, ca_bundle=ca_bundle)
    except AdvisoryLookupError as e:
        log(f"warning: vulnerabilities not looked up ({e}); {REPORT} says so")
        return write_report(image.name, [], [], paths.results_dir(root, image) / REPORT, {"error": str(e)},
                            [f"{n}=={v}" for n, v in python_packages(root, image).items()])
    c = report["counts"]
    log(f"vulnerabilities: {c['python']} Python advisories ({c['critical']} critical), {c['debian']} Debian packages "
        f"behind the security suite, {len(report['python_unchecked'])} Python packages PyPI gave no answer for")
    return report


def not_allowed(report: dict, allowed: set[str]) -> list[str]:
    """The report's critical advisories that no allowed ID names (by its ID or an alias): 'ID (package version)'."""
    return [f"{a['id']} ({a['package']} {a['installed']})" for a in report.get("python", [])
            if a.get("severity") == CRITICAL and not allowed & {a["id"], *a.get("aliases", [])}]


def refuse_critical(report: dict, allowed: Iterable[str]) -> None:
    """Raise VulnerableImage naming every critical advisory of the report that `allowed` does not name."""
    if refused := not_allowed(report, set(allowed)):
        raise VulnerableImage({report.get("image", "?"): refused})


def read_report(name: str, path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotReady(f"{name}: no {path} (a build writes it after the SBOM); rebuild the row to record it; nothing pushed", ref=path) from None
    except json.JSONDecodeError as e:
        raise BadFile(f"{name}: {path} is not valid JSON ({e.msg}); rebuild the row to record it again; nothing pushed", path=path) from None
    if not isinstance(report, dict) or not isinstance(report.get("python"), list):
        raise BadFile(f"{name}: {path} has no list of Python advisories; rebuild the row to record it again; nothing pushed", path=path)
    return report


def gate(reports: dict[str, Path], allowed: set[str]) -> None:
    """Refuse, for every image at once, the critical advisories that `allowed` does not name."""
    refused = {name: ids for name, path in reports.items() if (ids := not_allowed(read_report(name, path), allowed))}
    if refused:
        raise VulnerableImage(refused)


# ---- `lock --check-security` ------------------------------------------------------------


@dataclass
class LockFindings:
    image: str
    advisories: list[Advisory]
    behind: list[Behind]
    suite: str | None
    unchecked: list[str] = field(default_factory=list)


def check_lock(root: Path, image: Image, sources: Sources) -> LockFindings:
    """A row's committed lock against the advisories: its Python pins, and its Debian pins
    (lock.json "apt") against the security suite."""
    found, unchecked = python_advisories(python_packages(root, image).items(), sources)
    meta, source = lock.read(root, image), security_suite(image)
    # What the lock holds the image to: every Debian package the image holds, at its exact version.
    apt = meta.get("debian", {})
    late = behind(apt, sources.security_index(source)) if apt and source else []
    return LockFindings(image.name, found, late, source.suite if source else None, unchecked)


def record_check(root: Path, image: Image, f: LockFindings, generated_from: dict) -> None:
    """images/<image>/security.json: what the last check of the committed lock found, for the
    README's matrix table (render reads it offline) and for a refresh commit to carry."""
    data = {"image": f.image, "generated_from": generated_from,
            "python": sorted(f"{a.id} ({a.package} {a.installed}, {a.severity})" for a in f.advisories),
            "python_unchecked": len(f.unchecked), "debian_behind_security": [asdict(b) for b in f.behind],
            "counts": {"python": len(f.advisories), "critical": sum(a.severity == CRITICAL for a in f.advisories),
                       "debian": len(f.behind)}}
    write_atomic(lock.image_dir(root, image) / CHECKED, json.dumps(data, indent=2) + "\n")


def checked_cell(root: Path, image: Image) -> str:
    """The README table's cell: the counts of the last recorded check, or that there was none."""
    try:
        data = json.loads((lock.image_dir(root, image) / CHECKED).read_text())
    except (OSError, ValueError):
        return "not checked"
    c = data.get("counts", {})
    cell = f"{c.get('python', '?')} Python ({c.get('critical', '?')} critical), {c.get('debian', '?')} Debian"
    unchecked = data.get("python_unchecked", 0)
    when = str(data.get("generated_from", {}).get("at", "?"))[:10]
    return cell + (f"; {unchecked} pins unchecked" if unchecked else "") + f" ({when})"


def finding_lines(f: LockFindings) -> list[str]:
    python = [f"{f.image}: python {a.package} {a.installed}: {a.id} ({a.severity}), "
              f"fixed in {', '.join(a.fixed_in) or 'no release listed'}" + (f" {a.link}" if a.link else "") for a in f.advisories]
    debian = [f"{f.image}: debian {b.package} {b.installed}: {f.suite} has {b.security}" for b in f.behind]
    return python + debian
