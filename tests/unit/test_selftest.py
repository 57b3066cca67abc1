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


def test_pytest_runs_over_tests_with_the_slowest_listed_and_the_callers_arguments_last(monkeypatch):
    calls, run = fake_run([0, 0])
    monkeypatch.setattr(selftest.subprocess, "run", run)
    assert selftest.run(Path("/repo"), ["--", "-k", "cuda13", "--durations=0"]) == 0
    engine, pytest_argv = calls
    assert engine[0] == "bash" and engine[-1] == "--with-registry"
    assert pytest_argv[:4] == [sys.executable, "-m", "pytest", "/repo/tests"]
    assert pytest_argv.index(f"--durations={selftest.SLOWEST}") < pytest_argv.index("--durations=0")  # the last one wins
    assert pytest_argv[-3:] == ["-k", "cuda13", "--durations=0"] and "--" not in pytest_argv


@pytest.mark.parametrize("code", [1, 5])
def test_pytests_exit_code_comes_back_unchanged_no_tests_ran_included(monkeypatch, code):
    monkeypatch.setattr(selftest.subprocess, "run", fake_run([0, code])[1])
    assert selftest.run(Path("/repo"), []) == code


def test_an_engine_that_cannot_be_set_up_stops_before_pytest(monkeypatch):
    calls, run = fake_run([1])
    monkeypatch.setattr(selftest.subprocess, "run", run)
    with pytest.raises(EnvironmentProblem, match="could not set up Docker Engine"):
        selftest.run(Path("/repo"), [])
    assert len(calls) == 1
