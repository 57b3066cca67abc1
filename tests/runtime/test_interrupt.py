"""A smoke suite or gpucheck stopped by `timeout` (SIGTERM) still writes the report of what it
finished, names the step it was in, stops that step's processes, and exits 128 + the signal.
Real processes and real signals; no torch, no GPU."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from pytorch_cuda_runtime.smoke.results import FAIL, PASS

ROOT = Path(__file__).resolve().parents[2]
# A step that says it started, with its pid, then waits far longer than any test.
SLEEPER = "import os, time; print('started', os.getpid(), flush=True); time.sleep(600)"


def start(tmp_path: Path, body: str) -> subprocess.Popen:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path)


def started_pid(path: Path, seconds: float = 240) -> int:
    """The pid the sleeper printed in its log: its own line, `started <pid>`, not the command
    line the log opens with, which holds the word too."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = re.search(r"^started (\d+)$", path.read_text(), re.M) if path.exists() else None
        if found:
            return int(found.group(1))
        time.sleep(0.1)
    raise AssertionError(f"{path} never said it started")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") >= 0


def test_a_smoke_suite_stopped_by_sigterm_reports_what_finished(tmp_path):
    report = tmp_path / "out" / "report.json"
    proc = start(tmp_path, f"""
        import sys
        from pytorch_cuda_runtime.smoke import cli
        from pytorch_cuda_runtime.smoke.results import PASS, record

        def run_suite(suite, facts):  # one finished check, then a step that never ends
            suite.records.append(record("finished", PASS))
            suite.step("sleeper", [sys.executable, "-c", {SLEEPER!r}], suite.env())

        cli.run_suite = run_suite
        sys.exit(cli.main(["--report", {str(report)!r}, "--manifest", "absent.json"]))
    """)
    pid = started_pid(tmp_path / "out" / "logs" / "sleeper.log")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=240) == 128 + signal.SIGTERM
    results = {r["check"]: r for r in json.loads(report.read_text())["results"]}
    assert results["finished"]["status"] == PASS
    assert results["interrupted"]["status"] == FAIL and results["interrupted"]["actual"] == "SIGTERM during sleeper"
    assert gone(pid)  # the step's process group went with it


def test_gpucheck_stopped_by_sigterm_stops_its_child_gently_and_reports(tmp_path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.json").write_text(json.dumps({"schema": 2, "image": "x", "torch": "2.11.0", "torch_cuda": "13.0",
                                                   "deepspeed": "0.19.8", "python": "3", "files": {}, "ops_wheel": {
                                                       "file": "ops/x.whl", "ops": [], "arch_list": "9.0", "torch": "2.11.0"}}))
    marker = tmp_path / "child-got-sigterm"
    child = (f"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').close(), "
             f"sys.exit(0))); {SLEEPER}")
    proc = start(tmp_path, f"""
        import sys
        from pytorch_cuda_runtime import gpucheck, gpurunner
        from pytorch_cuda_runtime.smoke.results import PASS

        def finished(c, step):
            c.add("finished", PASS)

        def sleeper(c, step):
            c.run("sleeper", [sys.executable, "-c", {child!r}], step.bound)

        gpucheck.plan = lambda gpus: [gpurunner.Step("finished", finished), gpurunner.Step("sleeper", sleeper)]
        gpucheck.banner.query_gpus = lambda: None
        sys.exit(gpucheck.main(["--bundle", {str(bundle)!r}, "--report", {str(tmp_path / "r")!r}]))
    """)
    started_pid(tmp_path / "r" / "logs" / "sleeper.log")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    assert marker.exists()  # SIGTERM first: a smoke suite gets to write its own report
    checks = {r["check"]: r for r in json.loads((tmp_path / "r" / "report.json").read_text())["checks"]}
    assert checks["finished"]["status"] == PASS
    assert checks["interrupted"]["status"] == FAIL and checks["interrupted"]["actual"] == "SIGTERM during sleeper"
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [(x["step"], x["state"]) for x in report["steps"]] == [("finished", "done"), ("sleeper", "cut")]
    md = (tmp_path / "r" / "report.md").read_text()
    assert "| interrupted |" in md and "**Cut: `sleeper`**" in md
