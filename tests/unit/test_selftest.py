"""`build.py selftest`: the engine set up first, then pytest, whose exit code comes back as it is."""
import subprocess
import sys
from pathlib import Path

import pytest

from pytorch_cuda_build.errors import EnvironmentProblem
from pytorch_cuda_build.tools import selftest


def fake_run(codes):
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, codes[len(calls) - 1])
    return calls, run


class FakeUnit:
    """subprocess.Popen for the unit tiers' pytest: writes a line where it was told, exits with code."""

    def __init__(self, code, calls):
        self.code, self.calls = code, calls

    def __call__(self, argv, stdout=None, **kw):
        self.calls.append(argv)
        stdout.write("unit tiers: 1 passed\n")
        return self

    def wait(self):
        return self.code


@pytest.fixture
def repo(tmp_path):
    """A checkout's tests/: the two unit tiers, the integration tier, and a folder with no tests."""
    for d in ("unit", "runtime", "integration"):
        (tmp_path / "tests" / d).mkdir(parents=True)
        (tmp_path / "tests" / d / "test_x.py").write_text("")
    (tmp_path / "tests" / "data").mkdir()
    return tmp_path


def test_pytest_runs_over_tests_with_the_slowest_listed_and_the_callers_arguments_last(monkeypatch):
    calls, run = fake_run([0, 0])
    monkeypatch.setattr(selftest.subprocess, "run", run)
    assert selftest.run(Path("/repo"), ["--", "-k", "cuda13", "--durations=0"]) == 0
    engine, pytest_argv = calls
    assert engine[0] == "bash" and engine[-1] == "--with-registry"
    assert pytest_argv[:4] == [sys.executable, "-m", "pytest", "/repo/tests"]
    assert pytest_argv.index(f"--durations={selftest.SLOWEST}") < pytest_argv.index("--durations=0")  # the last one wins
    assert pytest_argv[-3:] == ["-k", "cuda13", "--durations=0"] and "--" not in pytest_argv


def test_the_whole_suite_runs_the_unit_tiers_beside_the_integration_tier_and_prints_them_after(monkeypatch, repo, capsys):
    calls, run = fake_run([0, 0])
    unit_calls: list = []
    monkeypatch.setattr(selftest.subprocess, "run", run)
    monkeypatch.setattr(selftest.subprocess, "Popen", FakeUnit(0, unit_calls))
    assert selftest.run(repo, []) == 0
    (unit,), (_, integration) = unit_calls, calls
    tests = repo / "tests"
    assert unit[3:5] == [str(tests / "unit"), str(tests / "runtime")] and unit[5] == "-ra"
    assert integration[3:] == [str(tests / "integration"), "-ra", f"--durations={selftest.SLOWEST}"]
    assert capsys.readouterr().out.endswith("unit tiers: 1 passed\n")


@pytest.mark.parametrize("integration, unit, code", [(0, 1, 1), (5, 0, 5), (1, 0, 1), (2, 1, 2)])
def test_pytests_exit_code_comes_back_unchanged_no_tests_ran_included(monkeypatch, repo, integration, unit, code):
    monkeypatch.setattr(selftest.subprocess, "run", fake_run([0, integration])[1])
    monkeypatch.setattr(selftest.subprocess, "Popen", FakeUnit(unit, []))
    assert selftest.run(repo, []) == code


def test_an_engine_that_cannot_be_set_up_stops_before_pytest(monkeypatch):
    calls, run = fake_run([1])
    monkeypatch.setattr(selftest.subprocess, "run", run)
    with pytest.raises(EnvironmentProblem, match="could not set up Docker Engine"):
        selftest.run(Path("/repo"), [])
    assert len(calls) == 1
