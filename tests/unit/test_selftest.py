"""`build.py selftest`: the engine set up first, then pytest, whose exit code comes back as it is."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from pytorch_cuda_build.errors import EnvironmentProblem
from pytorch_cuda_build.tooling import selftest


def fake_run(codes):
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, codes[len(calls) - 1])
    return calls, run


class FakeLane:
    """A lane's pytest: poll() is None until `ends_after` polls, then the exit code."""

    def __init__(self, code, ends_after=0):
        self.code, self.polls_left = code, ends_after

    def poll(self):
        if self.polls_left:
            self.polls_left -= 1
            return None
        return self.code

    def wait(self):
        return self.code


class Lanes:
    """subprocess.Popen for the three lanes: records each start (lane, argv, env, whether the main
    lane's build was over by then) and writes a line where a lane's output is captured. The main
    lane says its build is over as tests/conftest.py's default_build does, on its `built_at` poll
    (None: never, as when it ends before)."""

    def __init__(self, codes, built_at=0, main_polls=0):
        self.codes, self.built_at, self.main_polls, self.started = codes, built_at, main_polls, []
        self.main = None

    def __call__(self, argv, cwd=None, env=None, stdout=None, stderr=None):
        lane = (env or {}).get(selftest.LANE_ENV, "unit")
        built = self.main is not None and self.main[1].exists()
        self.started.append((lane, argv, env, built))
        if stdout is not None:
            stdout.write(f"{lane} lane: 1 passed\n")
        if lane != "main":
            return FakeLane(self.codes[lane])
        proc = FakeLane(self.codes[lane], self.main_polls)
        signal = Path(env[selftest.BUILT_ENV])
        self.main = (proc, signal)
        if self.built_at == 0:
            signal.touch()
        elif self.built_at is not None:
            poll = proc.poll

            def poll_then_build():
                self.built_at -= 1
                if self.built_at == 0:
                    signal.touch()
                return poll()
            proc.poll = poll_then_build
        return proc


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
    assert selftest.run(Path("/repo"), ["--", "-k", "cuda13", "--durations=0"], "pytorch-cuda") == 0
    engine, pytest_argv = calls
    assert engine[0] == "bash" and engine[-1] == "--with-registry"
    assert pytest_argv[:4] == [sys.executable, "-m", "pytest", "/repo/tests"]
    assert pytest_argv.index(f"--durations={selftest.SLOWEST}") < pytest_argv.index("--durations=0")  # the last one wins
    assert pytest_argv[-3:] == ["-k", "cuda13", "--durations=0"] and "--" not in pytest_argv


@pytest.mark.parametrize("args", [
    ["tests/integration/test_x.py"],
    ["tests/integration/test_x.py::test_y", "-ra"],
    ["-k", "y", "tests/integration"],
])
def test_named_files_or_tests_are_the_run_not_added_to_the_whole_tree(monkeypatch, repo, args):
    """The weekly workflow's tier jobs run `selftest -- tests/integration/test_x.py -ra`: over
    tests/ as well, pytest would run the whole suite beside the tier."""
    calls, run = fake_run([0, 0])
    monkeypatch.setattr(selftest.subprocess, "run", run)
    assert selftest.run(repo, ["--", *args], "pytorch-cuda") == 0
    argv = calls[1]
    assert str(repo / "tests") not in argv and argv[-len(args):] == args


@pytest.mark.parametrize("args", [["-k", "tests"], ["-m", "integration"], ["-k", "nosuch.py"]])
def test_a_selection_whose_value_looks_like_a_path_still_runs_over_tests(monkeypatch, repo, args):
    (repo / "integration").mkdir()  # a -m value that happens to name a folder is still a marker
    calls, run = fake_run([0, 0])
    monkeypatch.setattr(selftest.subprocess, "run", run)
    selftest.run(repo, ["--", *args], "pytorch-cuda")
    assert calls[1][3] == str(repo / "tests")


def whole_suite(monkeypatch, lanes: Lanes, repo: Path) -> int:
    calls, run = fake_run([0])
    monkeypatch.setattr(selftest.subprocess, "run", run)
    monkeypatch.setattr(selftest.subprocess, "Popen", lanes)
    monkeypatch.setattr(selftest, "POLL_S", 0)
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    rooms = []
    monkeypatch.setattr(selftest, "make_room", lambda repository: rooms.append((repository, len(lanes.started))))
    code = selftest.run(repo, [], "pytorch-cuda")
    assert len(calls) == 1  # the engine only: every pytest is a lane of its own
    assert rooms == [("pytorch-cuda", 0)]  # room made once, before any lane starts
    return code


def test_the_whole_suite_runs_three_lanes_and_prints_the_captured_two_after_the_main_one(monkeypatch, repo, capsys):
    lanes = Lanes({"unit": 0, "main": 0, selftest.SECOND: 0})
    assert whole_suite(monkeypatch, lanes, repo) == 0
    (unit, unit_argv, unit_env, _), (main, main_argv, main_env, _), (second, second_argv, second_env, _) = lanes.started
    assert (unit, main, second) == ("unit", "main", selftest.SECOND)
    tests = repo / "tests"
    assert unit_argv[3:5] == [str(tests / "unit"), str(tests / "runtime")] and unit_argv[5] == "-ra" and unit_env is None
    # The integration tier split by the markers, nothing left out: the second lane the engine26 and
    # second_lane tests, the main lane the rest.
    selection = "engine26 or second_lane"
    assert main_argv[3:] == [str(tests / "integration"), "-ra", f"--durations={selftest.SLOWEST}", "-m", f"not ({selection})"]
    assert second_argv[3:] == [str(tests / "integration"), "-ra", f"--durations={selftest.SLOWEST}", "-m", selection]
    # One lock for both integration lanes, and one file: the main lane writes its build's record
    # there, the second lane reads it.
    assert main_env[selftest.DAEMON_LOCK_ENV] == second_env[selftest.DAEMON_LOCK_ENV]
    assert main_env[selftest.BUILT_ENV] == second_env[selftest.BUILT_ENV]
    out = capsys.readouterr().out
    assert out.index(f"{selftest.SECOND} lane: 1 passed") < out.index("unit lane: 1 passed") and out.endswith("unit lane: 1 passed\n")


def test_the_second_lane_starts_once_the_main_lanes_default_build_is_over(monkeypatch, repo):
    lanes = Lanes({"unit": 0, "main": 0, selftest.SECOND: 0}, built_at=3, main_polls=10)
    assert whole_suite(monkeypatch, lanes, repo) == 0
    assert [(lane, built) for lane, _, _, built in lanes.started][-1] == (selftest.SECOND, True)
    assert lanes.main[0].polls_left == 10 - 3  # not a poll more than it took


def test_a_main_lane_that_ends_before_its_build_is_over_still_lets_the_second_lane_run(monkeypatch, repo):
    lanes = Lanes({"unit": 0, "main": 1, selftest.SECOND: 0}, built_at=None, main_polls=2)
    assert whole_suite(monkeypatch, lanes, repo) == 1
    assert [lane for lane, *_ in lanes.started] == ["unit", "main", selftest.SECOND]


@pytest.mark.parametrize("main, second, unit, code", [(0, 0, 1, 1), (5, 0, 0, 5), (0, 5, 0, 5), (1, 2, 0, 1), (0, 2, 1, 2), (2, 1, 1, 2)])
def test_pytests_exit_code_comes_back_unchanged_no_tests_ran_included(monkeypatch, repo, main, second, unit, code):
    assert whole_suite(monkeypatch, Lanes({"unit": unit, "main": main, selftest.SECOND: second}), repo) == code


def test_an_engine_that_cannot_be_set_up_stops_before_pytest(monkeypatch):
    calls, run = fake_run([1])
    monkeypatch.setattr(selftest.subprocess, "run", run)
    with pytest.raises(EnvironmentProblem, match="could not set up Docker Engine"):
        selftest.run(Path("/repo"), [], "pytorch-cuda")
    assert len(calls) == 1


def test_the_second_lane_takes_the_main_lanes_build_record_and_fails_on_a_build_that_failed_or_never_ended(monkeypatch, tmp_path):
    from helpers import main_lane_build

    built = tmp_path / "default-build-over"
    monkeypatch.setenv(selftest.BUILT_ENV, str(built))
    monkeypatch.setenv(selftest.LANE_ENV, selftest.MAIN)
    built.write_text(json.dumps({"returncode": 0, "image_id": "sha256:ab"}))
    assert main_lane_build() is None  # the main lane builds the row itself
    monkeypatch.setenv(selftest.LANE_ENV, selftest.SECOND)
    assert main_lane_build() == {"returncode": 0, "image_id": "sha256:ab"}
    built.write_text(json.dumps({"returncode": 1, "image_id": None}))
    with pytest.raises(pytest.fail.Exception, match="build of the default row failed"):
        main_lane_build()
    built.write_text("")
    with pytest.raises(pytest.fail.Exception, match="did not finish"):
        main_lane_build()
    built.unlink()
    assert main_lane_build() is None  # the main lane ended before its build: this lane builds it


def test_a_passed_tests_temporary_folder_goes_as_it_ends_and_a_failed_ones_stays(tmp_path):
    """The suite's own pytest settings (pyproject.toml), not each command's flag: the registries and
    stores a test leaves in its folder would otherwise stay on the engine's disk to the session's end."""
    (tmp_path / "test_two.py").write_text(
        "def test_passes(tmp_path):\n    (tmp_path / 'held').write_bytes(b'x')\n\n"
        "def test_fails(tmp_path):\n    (tmp_path / 'held').write_bytes(b'x')\n    assert False\n")
    base = tmp_path / "base"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(Path(selftest.__file__).parents[2] / "pyproject.toml"),
                           "--rootdir", str(tmp_path), "--basetemp", str(base), "-p", "no:cacheprovider", "-q",
                           str(tmp_path / "test_two.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "1 failed, 1 passed" in proc.stdout, proc.stdout[-2000:]
    assert (base / "test_fails0" / "held").exists() and not (base / "test_passes0").exists(), sorted(base.iterdir())


GIB = 1024**3


class Engine:
    """The engine make_room reads: the disk's free bytes in turn, a build cache (a cache mount and a
    layer record shared with another, which pruning frees nothing of), and the prunes it is asked for."""

    def __init__(self, free_gib, cache_gib):
        self.free = [int(f * GIB) for f in free_gib]
        self.cache = [{"Type": "exec.cachemount", "Size": int(cache_gib[0] * GIB), "Shared": False},
                      {"Type": "regular", "Size": int(cache_gib[1] * GIB), "Shared": False},
                      {"Type": "regular", "Size": 7 * GIB, "Shared": True}]
        self.pruned, self.closed = [], False

    def install(self, monkeypatch):
        monkeypatch.setattr(selftest.docker_env, "client", lambda: self)
        monkeypatch.setattr(selftest.docker_env, "root_dir", lambda c: "/var/lib/docker")
        monkeypatch.setattr(selftest.docker_env, "build_client", lambda override: "bc")
        monkeypatch.setattr(selftest.build, "free_bytes", lambda root: (self.free.pop(0), Path(root)))
        monkeypatch.setattr(selftest.build, "prune", lambda bc, c, repository, keep: self.pruned.append((repository, int(keep))))

    def df(self):
        if self.cache is None:
            raise requests.exceptions.ConnectionError("Connection aborted: RemoteDisconnected")
        return {"BuildCache": self.cache}

    def close(self):
        self.closed = True


def make_room(monkeypatch, engine):
    engine.install(monkeypatch)
    said = []
    selftest.make_room("pytorch-cuda", log=said.append)
    assert engine.closed
    return said


NEED_GIB = (selftest.build.MIN_FREE_BYTES + selftest.SUITE_TAKES_BYTES) / GIB


def test_a_disk_with_room_for_the_suite_and_a_build_after_it_is_left_alone(monkeypatch):
    engine = Engine([NEED_GIB], (3, 20))
    assert make_room(monkeypatch, engine) == [] and engine.pruned == []


def test_a_short_disk_gets_its_room_from_the_build_cache_least_recently_used_first_in_one_line(monkeypatch):
    engine = Engine([NEED_GIB - 8, NEED_GIB], (3, 20))
    said = make_room(monkeypatch, engine)
    # 23 GiB of cache pruning can free (a shared record frees nothing), 8 of it given back
    assert engine.pruned == [("pytorch-cuda", 15 * GIB)]
    assert said == [f"selftest: {NEED_GIB - 8:.1f} GiB free under /var/lib/docker, the whole suite needs {NEED_GIB:.1f} GiB: "
                    "bounding the build cache to 15.0 GiB, its cache mounts kept (build.py prune)"]


def test_a_shortfall_the_build_cache_cannot_give_is_said_and_the_run_goes_on(monkeypatch):
    engine = Engine([NEED_GIB - 30, NEED_GIB - 28], (3, 20))
    said = make_room(monkeypatch, engine)
    assert engine.pruned == [("pytorch-cuda", 0)]  # all it can give
    assert len(said) == 2 and said[1] == (
        f"selftest: {NEED_GIB - 28:.1f} GiB free under /var/lib/docker with the build cache bounded, {NEED_GIB:.1f} GiB needed: "
        "a build late in the run may be refused; free some space on that disk")


@pytest.mark.parametrize("addopts, makes_room", [("--collect-only -q", False), ("--co", False), ("-x -q", True), ("", True)])
def test_a_run_that_only_collects_makes_no_room(monkeypatch, repo, addopts, makes_room):
    """The workflow replay runs pr-build's test step collecting only, beside the suite that replays it:
    it builds nothing, and its engine's build cache stays as it is."""
    monkeypatch.setenv("PYTEST_ADDOPTS", addopts)
    rooms = []
    monkeypatch.setattr(selftest, "make_room", rooms.append)
    monkeypatch.setattr(selftest, "whole_suite", lambda root: 0)
    monkeypatch.setattr(selftest.subprocess, "run", fake_run([0])[1])
    assert selftest.run(repo, [], "pytorch-cuda") == 0
    assert rooms == (["pytorch-cuda"] if makes_room else [])


def test_a_daemon_lost_while_room_is_made_is_one_line_and_no_test_runs(monkeypatch):
    engine = Engine([NEED_GIB - 8], (3, 20))
    engine.cache = None  # the daemon goes away as its build cache is read
    engine.install(monkeypatch)
    monkeypatch.setattr(selftest.docker_env, "answers", lambda c: False)
    with pytest.raises(EnvironmentProblem) as e:
        selftest.make_room("pytorch-cuda", log=lambda line: None)
    assert "the suite's disk check" in str(e.value) and "no test has run" in str(e.value)
    assert "\n" not in str(e.value) and engine.pruned == [] and engine.closed
