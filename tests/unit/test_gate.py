"""The test gate (stages/gate.py) passes only when a check passed and none failed: a run where
everything was skipped, or nothing was collected, proves nothing about the image."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pytorch_cuda_build import errors
from pytorch_cuda_build.stages import gate

SKIP_REASON = "no Docker daemon: Error while fetching server API version"


def junit(tmp_path, *cases: str):
    path = tmp_path / "structure.xml"
    path.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
                    '<testsuite name="pytest" errors="0" failures="0" skipped="0" tests="0">'
                    + "".join(cases) + "</testsuite></testsuites>")
    return path


def ok(name="test_ok"):
    return f'<testcase classname="test_image" name="{name}" time="0.1" />'


def skipped(reason=SKIP_REASON):
    return (f'<testcase classname="test_image" name="test_skipped" time="0">'
            f'<skipped type="pytest.skip" message="{reason}">tests/conftest.py:57: {reason}</skipped></testcase>')


def failed(kind="failure", message="AssertionError: assert 'root' == 'trainer'"):
    return (f'<testcase classname="test_image" name="test_user" time="0.2">'
            f'<{kind} message="{message}">long traceback\nmore</{kind}></testcase>')


def structure_gate(tmp_path, rc, path):
    log = tmp_path / "structure.log"
    log.write_text("= 1 passed in 0.1s =\n")
    gate.gate_structure(rc, path, log)


def test_counts(tmp_path):
    counts = gate.junit_counts(junit(tmp_path, ok(), ok("b"), skipped(), failed(), failed("error", "fixture broke")))
    assert (counts.passed, counts.failed, counts.skipped) == (2, 2, 1)
    assert counts.first_skip == SKIP_REASON
    assert counts.first_failure == "test_user: AssertionError: assert 'root' == 'trainer'"


def test_normal_pass(tmp_path):
    structure_gate(tmp_path, 0, junit(tmp_path, ok(), ok("b"), skipped("gpu only")))


def test_all_skipped_is_a_failure_naming_the_first_reason(tmp_path):
    with pytest.raises(errors.TestFailure) as e:
        structure_gate(tmp_path, 0, junit(tmp_path, skipped(), skipped("other")))
    assert e.value.suite == "structure tests"
    assert e.value.detail == f"0 tests ran (2 skipped): {SKIP_REASON}"
    assert str(e.value).startswith(f"structure tests failed: 0 tests ran (2 skipped): {SKIP_REASON}; full log: ")


@pytest.mark.parametrize("rc", [0, 5])
def test_nothing_collected_is_a_failure(tmp_path, rc):
    with pytest.raises(errors.TestFailure) as e:
        structure_gate(tmp_path, rc, junit(tmp_path))
    assert e.value.detail == "0 tests ran (0 skipped)"


def test_failures_fail_with_the_first_one(tmp_path):
    with pytest.raises(errors.TestFailure) as e:
        structure_gate(tmp_path, 1, junit(tmp_path, ok(), failed()))
    assert e.value.detail == "1 failed, 1 passed: test_user: AssertionError: assert 'root' == 'trainer'"


def test_a_failure_counts_even_when_pytest_exited_0(tmp_path):
    with pytest.raises(errors.TestFailure, match="1 failed"):
        structure_gate(tmp_path, 0, junit(tmp_path, ok(), failed("error")))


def test_nonzero_exit_without_counted_failures_fails(tmp_path):
    with pytest.raises(errors.TestFailure, match=r"0 failed, 1 passed \(pytest exit 3\)"):
        structure_gate(tmp_path, 3, junit(tmp_path, ok()))


@pytest.mark.parametrize("content", [None, "", "<testsuites><testsuite>", "not xml"])
def test_missing_or_broken_report_fails(tmp_path, content):
    path = tmp_path / "structure.xml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(errors.TestFailure, match="no junit report"):
        structure_gate(tmp_path, 4, path)


def test_timeout(tmp_path):
    with pytest.raises(errors.TestFailure, match="timed out after"):
        structure_gate(tmp_path, 124, tmp_path / "absent.xml")


def test_counts_of_a_real_pytest_run(tmp_path):
    """The junit XML pytest writes when a fixture skips every test, as in the gate without a daemon."""
    (tmp_path / "test_x.py").write_text(
        "import pytest\n@pytest.fixture\ndef host():\n    pytest.skip('no Docker daemon: gone')\n"
        "def test_a(host): pass\ndef test_b(host): pass\n")
    xml = tmp_path / "out.xml"
    rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", str(tmp_path)],
                        cwd=tmp_path, capture_output=True, timeout=120).returncode
    with pytest.raises(errors.TestFailure) as e:
        gate.gate_structure(rc, xml, tmp_path / "log")
    assert e.value.detail == "0 tests ran (2 skipped): no Docker daemon: gone"


# ---- the smoke report -----------------------------------------------------------------

def report(passes=5, skipped=0, gpus=0):
    return {"gpus": gpus, "summary": {"PASS": passes, "FAIL": 0, "SKIPPED": skipped, "INFO": 1}, "results": []}


def test_smoke_report_with_passes_is_accepted():
    gate.check_smoke_report(report(), require_gpu=False, log_path="smoke.log")
    gate.check_smoke_report(report(gpus=2), require_gpu=True, log_path="smoke.log")


@pytest.mark.parametrize("rep", [report(passes=0, skipped=7), {}, {"summary": None}, {"summary": {"PASS": "3"}}, []])
def test_smoke_report_without_a_pass_fails_despite_exit_0(rep):
    with pytest.raises(errors.TestFailure, match="0 checks passed") as e:
        gate.check_smoke_report(rep, require_gpu=False, log_path="smoke.log")
    assert e.value.suite == "smoke suite"


def test_smoke_report_without_gpus_fails_when_required():
    with pytest.raises(errors.TestFailure, match="--require-gpu: the suite ran on no GPU"):
        gate.check_smoke_report(report(gpus=0), require_gpu=True, log_path="smoke.log")
