"""security.py: advisories of the locked Python packages, Debian packages behind the security
suite, vulnerabilities.json, the publish gate and `lock --check-security`; all from the
recordings in tests/data/security (see its README.md), never the network."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests
import tenacity
import yaml

from pytorch_cuda_build import matrix, pipeline
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import AdvisoryLookupError, VulnerableImage
from pytorch_cuda_build.registry import retry
from pytorch_cuda_build.stages import publish, sbom, security

from helpers import ROOT, run_cli

DATA = ROOT / "tests" / "data" / "security"
ROW = matrix.load(ROOT / "matrix.yaml").select("2.7", "12.1")
SELECT = ("--torch", "2.7", "--cuda", "12.1")


def _project(tmp_path: Path) -> Path:
    """A root with only the row's committed lock: report_for_image writes its build-results/ there."""
    shutil.copytree(ROOT / "images" / ROW.name, tmp_path / "images" / ROW.name)
    return tmp_path


def _report(tmp_path: Path, installed: dict[str, str]) -> dict:
    return security.report_for_image(_project(tmp_path), ROW, installed, fetch=security.Snapshot(DATA))


# ---- Debian: versions ordered as dpkg orders them -------------------------------------------

def test_debian_packages_behind_security_by_debian_ordering(tmp_path):
    installed = {
        "openssh-client": "1:9.2p1-2+deb12u10",  # newer than security's deb12u9 (as text, "u10" < "u9")
        "ca-certificates": "20230311+deb12u1",   # older: behind 20250419~deb12u2
        "libssl3": "3.0.23-1",                   # newer than the (seeded) 3.0.23-1~deb12u1: "~" sorts first
        "openssl": "1:3.0.0-1",                  # an epoch outranks any upstream version
        "openssh-server": "1:9.2p1-2+deb12u8",   # older revision: behind
        "libc6": "2.36-9+deb12u7",               # equal: not behind
        "tini": "0.19.0-1+b3",                   # not in the security suite
    }
    report = _report(tmp_path, installed)
    assert report["debian_behind_security"] == [
        {"package": "ca-certificates", "installed": "20230311+deb12u1", "security": "20250419~deb12u2"},
        {"package": "openssh-server", "installed": "1:9.2p1-2+deb12u8", "security": "1:9.2p1-2+deb12u9"},
    ]


def test_a_tilde_revision_is_behind_a_later_tilde_revision():
    assert security.behind({"libssl3": "3.0.22-1~deb12u1"}, {"libssl3": "3.0.22-1~deb12u2"}) == [
        security.Behind("libssl3", "3.0.22-1~deb12u1", "3.0.22-1~deb12u2")]


def test_an_index_listing_a_package_twice_gives_its_newest_version():
    text = "Package: libssl3\nVersion: 3.0.22-1~deb12u2\n\nPackage: libssl3\nVersion: 3.0.22-1~deb12u10\n\nPackage: x\nVersion: 1:0.1\n"
    assert security.newest(text) == {"libssl3": "3.0.22-1~deb12u10", "x": "1:0.1"}


def test_the_sboms_debian_components_are_the_installed_packages():
    doc = {"components": [{"name": "libssl3", "version": "3.0.22-1~deb12u2", "purl": "pkg:deb/debian/libssl3@3.0.22-1~deb12u2?arch=amd64"},
                          {"name": "jinja2", "version": "3.1.6", "purl": "pkg:pypi/jinja2@3.1.6"}]}
    assert security.sbom_debian(doc) == {"libssl3": "3.0.22-1~deb12u2"}


# ---- vulnerabilities.json ------------------------------------------------------------------

def test_the_report_file_lists_advisories_skips_withdrawn_and_counts_critical(tmp_path):
    _report(tmp_path, {"ca-certificates": "20230311+deb12u1"})
    written = json.loads((tmp_path / "build-results" / ROW.name / "vulnerabilities.json").read_text())
    assert written["image"] == ROW.name
    assert written["python"] == [
        {"id": "PYSEC-SEEDED-1", "package": "jinja2", "installed": "3.1.6", "fixed_in": ["3.1.7"], "severity": "CRITICAL",
         "link": "https://osv.dev/vulnerability/PYSEC-SEEDED-1", "aliases": ["GHSA-seed-crit-0001"]},
        {"id": "PYSEC-SEEDED-2", "package": "requests", "installed": "2.34.2", "fixed_in": [], "severity": "UNKNOWN",
         "link": "https://osv.dev/vulnerability/PYSEC-SEEDED-2", "aliases": ["GHSA-seed-note-0002"]},
    ]  # urllib3's advisory is withdrawn
    assert written["debian_behind_security"] == [{"package": "ca-certificates", "installed": "20230311+deb12u1", "security": "20250419~deb12u2"}]
    assert written["counts"] == {"python": 2, "debian": 1, "critical": 1}
    assert written["generated_from"]["python"].endswith("tests/data/security/pypi.json")
    assert written["generated_from"]["debian"] == "snapshot bookworm-security.Packages" and written["generated_from"]["at"]
    # the pins with no recorded answer are listed as unchecked, not taken as clean
    assert "numpy==2.4.6" in written["python_unchecked"] and "jinja2==3.1.6" not in written["python_unchecked"]


# ---- PyPI online: retried, asked once, 404 is unchecked -----------------------------------------

class FakeResponse:
    def __init__(self, status: int, body: dict | None = None):
        self.status_code, self._body = status, body

    def json(self):
        return self._body


class FakeSession:
    def __init__(self, answers: dict[str, list]):
        self.answers, self.calls = answers, []

    def get(self, url, timeout):
        self.calls.append(url)
        todo = self.answers[url]
        step = todo.pop(0) if len(todo) > 1 else todo[0]
        if isinstance(step, Exception):
            raise step
        return step


def test_pypi_answers_are_retried_on_transient_errors_and_asked_once():
    ok = FakeResponse(200, {"info": {}, "vulnerabilities": [{"id": "PYSEC-SEEDED-9", "withdrawn": None}]})
    session = FakeSession({
        "https://pypi.org/pypi/jinja2/3.1.6/json": [requests.ConnectionError("reset"), FakeResponse(503), ok],
        "https://pypi.org/pypi/not-on-pypi/1.0/json": [FakeResponse(404)],
    })
    online = security.Online(None, attempts=3, backoff=0, session=session)
    found, unchecked = security.python_advisories([("jinja2", "3.1.6"), ("jinja2", "3.1.6"), ("not-on-pypi", "1.0")], online)
    assert [a.id for a in found] == ["PYSEC-SEEDED-9"] and unchecked == ["not-on-pypi==1.0"]
    assert online.answer("jinja2", "3.1.6") == ok.json()["vulnerabilities"]
    assert session.calls.count("https://pypi.org/pypi/jinja2/3.1.6/json") == 3  # two failures, one answer, then the cache


def test_an_answer_cut_short_is_asked_again_then_one_lookup_error():
    url = "https://pypi.org/pypi/jinja2/3.1.6/json"
    cut = requests.exceptions.ChunkedEncodingError("Connection broken: IncompleteRead(10 bytes read)")
    ok = FakeResponse(200, {"vulnerabilities": []})
    assert security.Online(None, attempts=2, backoff=0, session=FakeSession({url: [cut, ok]})).answer("jinja2", "3.1.6") == []
    with pytest.raises(AdvisoryLookupError) as e:
        security.Online(None, attempts=2, backoff=0, session=FakeSession({url: [cut]})).answer("jinja2", "3.1.6")
    assert str(e.value) == f"{url} answered in part (ChunkedEncodingError) (2 attempts)"


def test_pypi_failing_every_attempt_is_one_lookup_error():
    session = FakeSession({"https://pypi.org/pypi/jinja2/3.1.6/json": [FakeResponse(502)]})
    with pytest.raises(AdvisoryLookupError) as e:
        security.Online(None, attempts=2, backoff=0, session=session).answer("jinja2", "3.1.6")
    assert e.value.exit_code == 2 and str(e.value) == "https://pypi.org/pypi/jinja2/3.1.6/json answered HTTP 502 (2 attempts)"


# ---- the gate ---------------------------------------------------------------------------

def test_refuse_critical_names_each_critical_advisory_not_allowed(tmp_path):
    report = _report(tmp_path, {})
    with pytest.raises(VulnerableImage) as e:
        security.refuse_critical(report, ["PYSEC-SEEDED-2"])
    line, = e.value.lines()
    assert line.startswith(f"{ROW.name} has 1 critical advisory not allowed: PYSEC-SEEDED-1 (jinja2 3.1.6); nothing pushed")
    security.refuse_critical(report, ["GHSA-seed-crit-0001"])  # an alias allows it too


class FakeImage:
    id = "sha256:" + "a" * 64
    labels: dict = {}


class FakeClient:
    images = property(lambda self: self)

    def get(self, ref):
        return FakeImage()


@pytest.fixture
def publishing(monkeypatch):
    """A daemon holding the row as tested, and a publish_rows that records being called (nothing reaches a registry)."""
    calls = []
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: FakeClient())
    monkeypatch.setattr(publish.tags, "passed", lambda image_id, *a: {"mode": "cpu"})
    monkeypatch.setattr(pipeline, "publish_rows", lambda c, images, *a, **k: calls.append([i.name for i in images]) or [])
    return calls


def _publish(root: Path, *extra: str):
    return run_cli(root, "--matrix", str(ROOT / "matrix.yaml"), "publish", *SELECT, "--registry", "127.0.0.1:5000/ml", *extra)


def test_publish_refuses_a_critical_advisory_in_one_line_nothing_pushed(tmp_path, publishing):
    _report(tmp_path, {})
    proc = _publish(tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {ROW.name} has 1 critical advisory not allowed: PYSEC-SEEDED-1 (jinja2 3.1.6); nothing pushed")
    assert publishing == []


@pytest.mark.parametrize("allowed", ["PYSEC-SEEDED-1", "GHSA-seed-crit-0001"])
def test_allow_vulnerable_lets_the_named_advisory_past_the_gate(tmp_path, publishing, allowed):
    _report(tmp_path, {})
    _sbom(tmp_path)
    proc = _publish(tmp_path, "--allow-vulnerable", "PYSEC-SEEDED-2", "--allow-vulnerable", allowed)
    assert proc.returncode == 0, proc.stderr
    assert publishing == [[ROW.name]] and "dry run: nothing pushed" in proc.stdout


def test_publish_refuses_an_image_without_its_report(tmp_path, publishing):
    proc = _publish(tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{ROW.name}: no {tmp_path}/build-results/{ROW.name}/vulnerabilities.json" in proc.stderr and "nothing pushed" in proc.stderr
    assert publishing == []


def test_publish_refuses_an_image_without_its_sbom_before_any_push(tmp_path, publishing):
    _report(tmp_path, {})
    proc = _publish(tmp_path, "--allow-vulnerable", "PYSEC-SEEDED-1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{ROW.name}: no {tmp_path}/build-results/{ROW.name}/sbom.cdx.json, the SBOM a push attaches" in proc.stderr
    assert "nothing pushed" in proc.stderr and publishing == []


def _sbom(tmp_path: Path) -> None:
    (tmp_path / "build-results" / ROW.name / sbom.FILE).write_text('{"bomFormat": "CycloneDX"}')


# ---- `lock --check-security` -----------------------------------------------------------------

def test_lock_check_security_offline_prints_each_finding_then_a_summary():
    proc = run_cli(ROOT, "lock", "--check-security", "--security-snapshot", str(DATA), *SELECT)
    assert proc.returncode == 1, proc.stderr
    pins = security.python_packages(ROOT, ROW)
    assert proc.stdout.splitlines() == [
        f"{ROW.name}: python jinja2 3.1.6: PYSEC-SEEDED-1 (CRITICAL), fixed in 3.1.7 https://osv.dev/vulnerability/PYSEC-SEEDED-1",
        f"{ROW.name}: python requests 2.34.2: PYSEC-SEEDED-2 (UNKNOWN), fixed in no release listed https://osv.dev/vulnerability/PYSEC-SEEDED-2",
        f"{ROW.name}: debian libssl3 3.0.22-1~deb12u2: bookworm-security has 3.0.23-1~deb12u1",
        "1 of 1 image(s) with findings: 2 Python advisories (1 critical), 1 Debian pin(s) behind the security suite; "
        f"{len(pins) - 5} package version(s) unchecked (no answer from PyPI or the snapshot)",
    ]  # openssh-client/-server are locked at deb12u10, newer than the suite's deb12u9: not behind;
    # ca-certificates is locked at the suite's own version


def test_lock_check_security_of_every_row_counts_shared_pins_per_row():
    proc = run_cli(ROOT, "lock", "--check-security", "--security-snapshot", str(DATA))
    n = len(matrix.load(ROOT / "matrix.yaml").images)
    assert proc.returncode == 1 and len(proc.stdout.splitlines()) == 3 * n + 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1].startswith(f"{n} of {n} image(s) with findings: {2 * n} Python advisories ({n} critical), {n} Debian pin(s)")


def test_lock_check_security_exits_0_when_nothing_is_found(tmp_path):
    (tmp_path / "pypi.json").write_text(json.dumps({"jinja2==3.1.6": {"vulnerabilities": []}}))
    (tmp_path / "bookworm-security.Packages").write_text("Package: ca-certificates\nVersion: 20230311+deb12u1\n")
    proc = run_cli(ROOT, "lock", "--check-security", "--security-snapshot", str(tmp_path), *SELECT)
    assert proc.returncode == 0 and proc.stdout.startswith("0 of 1 image(s) with findings: 0 Python advisories"), proc.stdout + proc.stderr


@pytest.mark.parametrize("files, says", [
    (None, "is not a folder"),
    ({}, "has no pypi.json"),
    ({"pypi.json": "{"}, "pypi.json is not valid JSON"),
    ({"pypi.json": "[]"}, "must map name==version"),
    ({"pypi.json": '{"jinja2==3.1.6": []}'}, "jinja2==3.1.6 is not PyPI's answer"),
    ({"pypi.json": "{}"}, "has no bookworm-security.Packages"),
])
def test_lock_check_security_with_a_bad_snapshot_is_one_line_exit_2(tmp_path, files, says):
    snap = tmp_path / "snap"
    if files is not None:
        snap.mkdir()
        for name, text in files.items():
            (snap / name).write_text(text)
    proc = run_cli(ROOT, "lock", "--check-security", "--security-snapshot", str(snap), *SELECT)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert says in proc.stderr


@pytest.mark.parametrize("args, says", [
    (["--security-snapshot", str(DATA)], "--security-snapshot needs --check-security"),
    (["--check-security", "--upgrade"], "apart from --check and --upgrade"),
])
def test_lock_security_flags_misused_are_one_usage_line(args, says):
    proc = run_cli(ROOT, "lock", *args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr


# ---- the scheduled refresh -----------------------------------------------------------------

def test_the_weekly_job_refreshes_the_locks_only_when_the_check_exits_1():
    job = yaml.safe_load((ROOT / ".github" / "workflows" / "images.yml").read_text())["jobs"]["security-refresh"]
    check, refresh = (next(s for s in job["steps"] if s.get("id") == i) for i in ("check", "refresh"))
    assert "build.py lock --check-security" in check["run"] and refresh["if"] == "steps.check.outputs.rc == '1'"
    assert "build.py lock --upgrade" in refresh["run"] and "build.py render" in refresh["run"]
    # checkout keeps no credentials: the push alone is given the job's token
    assert '@github.com/${GITHUB_REPOSITORY}.git" "$branch"' in refresh["run"] and refresh["env"] == {"GITHUB_TOKEN": "${{ github.token }}"}
    assert job["permissions"] == {"contents": "write"}


def test_a_recorded_check_is_the_readme_tables_count(tmp_path):
    """--record writes images/<image>/security.json for every row checked; render's table shows its counts."""
    from helpers import project_copy

    root = project_copy(tmp_path / "p")
    shutil.copy(ROOT / "README.md", root / "README.md")  # the copy holds code and inputs only
    proc = run_cli(root, "lock", "--check-security", "--record", "--security-snapshot", str(DATA), *SELECT)
    assert proc.returncode == 1, proc.stderr
    data = json.loads((root / "images" / ROW.name / "security.json").read_text())
    assert data["counts"] == {"python": 2, "critical": 1, "debian": 1}
    assert data["debian_behind_security"] == [{"package": "libssl3", "installed": "3.0.22-1~deb12u2", "security": "3.0.23-1~deb12u1"}]
    row = next(line for line in (root / "README.md").read_text().splitlines() if line.startswith(f"| `{ROW.name}`"))
    assert row.endswith(f"| 2 Python (1 critical), 1 Debian; {data['python_unchecked']} pins unchecked ({data['generated_from']['at'][:10]}) |")
    assert not (ROOT / "images" / ROW.name / "security.json").exists() or (ROOT / "images" / ROW.name / "security.json").read_text() != (
        root / "images" / ROW.name / "security.json").read_text()  # the repository's own record untouched


def test_a_build_without_pypi_or_debian_still_writes_a_report_that_says_so(tmp_path, monkeypatch):
    """The pipeline's step (security.record): the tested image is not failed for a lookup that
    could not run, but its report names the error and counts every pin as unchecked."""
    def unreachable(*a, **kw):
        raise AdvisoryLookupError("https://pypi.org/pypi/torch/2.7.1/json unreachable (ConnectionError) (4 attempts)")

    monkeypatch.setattr(security, "report_for_image", unreachable)
    root, said = _project(tmp_path), []
    report = security.record(root, ROW, {}, None, said.append)
    assert report == json.loads((root / "build-results" / ROW.name / "vulnerabilities.json").read_text())
    assert report["generated_from"]["error"].endswith("(4 attempts)") and report["counts"]["python"] == 0
    assert len(report["python_unchecked"]) == len(security.python_packages(root, ROW))
    assert len(said) == 1 and said[0].startswith("warning: vulnerabilities not looked up")


def test_the_advisory_lookup_retries_under_the_registrys_one_policy(monkeypatch):
    """PyPI's advisory API and a registry call share one retry policy (registry/retry.py): a
    Transient answer is asked again, waits doubling from the backoff up to the one cap, each
    retry logged; what still fails after the last attempt goes up."""
    waits: list[float] = []
    monkeypatch.setattr(tenacity.nap.time, "sleep", waits.append)
    said: list[str] = []
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise retry.Transient("HTTP 503")
        return "answer"
    assert retry.retrying(4, 40, said.append)(flaky, "asking") == "answer"
    assert waits == [40, 60, 60] and retry.WAIT_CAP == 60
    assert said[0] == "asking failed: HTTP 503; attempt 2/4 in 40s"
    with pytest.raises(retry.Transient):
        retry.retrying(2, 0)(lambda: (_ for _ in ()).throw(retry.Transient("down")), "asking")
    assert not hasattr(security, "_Transient") and security.Transient is retry.Transient
