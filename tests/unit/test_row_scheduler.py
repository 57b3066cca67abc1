"""The scheduler of `build --all`: typed results from its workers, failures gathered, no Docker."""
from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytorch_cuda_build import arguments, console, errors, pipeline, scheduler
from pytorch_cuda_build.errors import BuildError

ROWS = [SimpleNamespace(name=n, torch="2.7.1", cuda=c, flavor="runtime", platform="linux/amd64") for n, c in
        (("2.7.1-cuda12.1-runtime", "12.1"), ("2.7.1-cuda12.6-runtime", "12.6"), ("2.7.1-cuda12.8-runtime", "12.8"))]


def quiet():
    return console.Quiet(err=io.StringIO(), out=io.StringIO())


def log_path(image):
    return f"build-results/{image.name}/run.log"


def test_typed_results_come_back_in_row_order_and_failures_are_named():
    def worker(image):
        if image is ROWS[1]:
            raise BuildError("step [python-env 2/2] RUN pip download", "build-results/x/build.log", "tail")
        if image is ROWS[2]:
            return pipeline.RowResult(image.name, False, 1, error=[str(errors.TestFailure("smoke suite", "zero3 FAILED", "smoke.log"))])
        return pipeline.RowResult(image.name, True, seconds={"build": 3.0}, tags=["pytorch-cuda:v2.7"])
    con = quiet()
    results = scheduler.schedule(ROWS, worker, 2, con, log_path)
    assert [r.image for r in results] == [r.name for r in ROWS]
    assert [(r.ok, r.exit_code) for r in results] == [(True, 0), (False, 1), (False, 1)]
    assert results[1].error == ["build failed at step [python-env 2/2] RUN pip download; full log: build-results/x/build.log",
                                "--- last lines of the log ---", "tail"]
    err = scheduler.failures(results)
    assert err.exit_code == 1 and str(err) == ("2 of 3 rows failed: 2.7.1-cuda12.6-runtime, 2.7.1-cuda12.8-runtime "
                                               "(each row's run.log under build-results/)")
    said = con.err.getvalue()
    assert "==> 2.7.1-cuda12.1-runtime: started (log: build-results/2.7.1-cuda12.1-runtime/run.log)" in said
    assert "==> 2.7.1-cuda12.1-runtime: ok after 0 s" in said and "==> 2.7.1-cuda12.6-runtime: FAILED after 0 s" in said
    assert scheduler.failures(results[:1]) is None


def test_no_more_than_jobs_rows_run_at_once():
    """Six rows, two at a time: each row waits at a barrier for a second one, so two must run
    together (a scheduler running one at a time breaks the barrier) and never three."""
    lock, now, most = threading.Lock(), [0], [0]
    pair = threading.Barrier(2, timeout=30)

    def worker(image):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        pair.wait()
        with lock:
            now[0] -= 1
        return pipeline.RowResult(image.name, True)
    results = scheduler.schedule(ROWS * 2, worker, 2, quiet(), log_path)
    assert [(r.image, r.ok) for r in results] == [(i.name, True) for i in ROWS * 2]
    assert most[0] == 2


@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_or_a_bug_stops_the_running_rows_and_goes_up(raised):
    """One row at a time: the first raises, the second (already handed to the pool) may start, the
    third never does. A started row waits until stop() is called, as a child process does."""
    stopped, ran = threading.Event(), []

    def worker(image):
        ran.append(image.name)
        if image is ROWS[0]:
            raise raised("stop")
        assert stopped.wait(timeout=30), "stop() was never called"
        return pipeline.RowResult(image.name, True)
    with pytest.raises(raised):
        scheduler.schedule(ROWS, worker, 1, quiet(), log_path, stop=stopped.set)
    assert stopped.is_set()
    assert ROWS[2].name not in ran  # a row not started never starts


FAKE_CHILD = """\
import sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--result-json") + 1])
cuda = args[args.index("--cuda") + 1]
name = f"2.7.1-cuda{cuda}-runtime"
print("child argv:", " ".join(args))
if cuda == "12.1":
    out.write_text('{"image": "%s", "ok": true, "exit_code": 0, "seconds": {"build": 2.5}, "tags": ["t:1"], "size_bytes": 5}' % name)
elif cuda == "12.6":
    out.write_text('{"image": "%s", "ok": false, "exit_code": 2, "error": ["no disk space for a build"]}' % name)
    sys.exit(2)
else:
    sys.exit(137)  # killed before it could answer
"""


def test_row_processes_read_each_childs_json_result(tmp_path):
    (tmp_path / "build.py").write_text(FAKE_CHILD)
    options = arguments.BuildOptions(matrix=tmp_path / "matrix.yaml", all=True, no_test=True, no_cache=True)
    worker = scheduler.RowProcesses(tmp_path, lambda image, out: options.child_argv(image, out))
    results = scheduler.schedule(ROWS, worker, 3, quiet(), worker.log_path)
    assert (results[0].ok, results[0].seconds, results[0].tags, results[0].size_bytes) == (True, {"build": 2.5}, ["t:1"], 5)
    assert (results[1].ok, results[1].exit_code, results[1].error) == (False, 2, ["no disk space for a build"])
    log = tmp_path / "build-results" / ROWS[2].name / "run.log"
    assert (results[2].ok, results[2].exit_code, results[2].error) == (False, 137, [f"exit 137 without a result (see {log})"])
    assert "--no-test --no-cache" in (tmp_path / "build-results" / ROWS[0].name / "run.log").read_text()
    assert not worker.running


def test_a_child_records_its_typed_error_then_raises_it(tmp_path):
    path = tmp_path / "result.json"

    def fails():
        raise BuildError("step [runtime 3/9] RUN x", "build.log")
    with pytest.raises(BuildError):
        pipeline.recorded(path, ROWS[0], fails)
    r = pipeline.RowResult.from_json(path.read_text())
    assert (r.ok, r.exit_code, r.error) == (False, 1, ["build failed at step [runtime 3/9] RUN x; full log: build.log"])
    ok = pipeline.recorded(path, ROWS[0], lambda: pipeline.RowResult(ROWS[0].name, True, tags=["a"]))
    assert pipeline.RowResult.from_json(path.read_text()) == ok


def test_options_become_the_childs_flags():
    options = arguments.BuildOptions(matrix=Path("m.yaml"), all=True, jobs=2, docker="/usr/bin/docker", ca_bundle="ca.pem", retest=True,
                                     require_gpu=True, push=True, registry="127.0.0.1:5000/ml", ca_path="/ca.pem")
    argv = options.child_argv(ROWS[1], Path("r.json"))  # the CA bundle as the parent found it
    assert argv == ["--matrix", "m.yaml", "build", "--torch", "2.7.1", "--cuda", "12.6", "--registry", "127.0.0.1:5000/ml", "--push",
                    "--ca-bundle", "/ca.pem", "--docker", "/usr/bin/docker", "--retest", "--require-gpu",
                    "--result-json", "r.json"]  # --retries 4 is the child's default
    assert sys.executable  # children run with this interpreter


def test_the_smoke_containers_steps_reach_the_console_as_they_finish():
    """Display only: the follower reads this run's smoke container of this image, nothing else."""
    shown = []
    con = SimpleNamespace(follows_smoke=True, smoke=shown.append)
    mine = SimpleNamespace(id="a", attrs={"ImageID": "sha256:img"},
                           logs=lambda **kw: iter([b"pytorch-cuda-smoke: mode cpu x2\n  zero1_cpu2: rc=0 4", b"0.5s\n"]))
    other = SimpleNamespace(id="b", attrs={"ImageID": "sha256:other"}, logs=lambda **kw: iter([b"  x: rc=1 1.0s\n"]))
    client = SimpleNamespace(containers=SimpleNamespace(list=lambda filters: [other, mine]))
    with pipeline.following_smoke(client, "sha256:img", con):
        deadline = time.monotonic() + 5
        while len(shown) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert shown == ["pytorch-cuda-smoke: mode cpu x2", "  zero1_cpu2: rc=0 40.5s"]
