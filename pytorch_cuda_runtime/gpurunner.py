"""gpucheck's runner: the plan's steps in order, each within its time bound and the run's budget,
a report written before and after each (gpureport.py); a step that fails so that the rest cannot
run (Stop) marks them not run. What the steps are is gpusteps.py's; the command is gpucheck.py."""

import json
import os
import platform
import subprocess
import sys
import time
from typing import Any, Callable

from . import gpureport
from .errors import PytorchCudaError
from .smoke.results import FAIL, SKIP, record

# A step: what it finds goes into the check's records; a smoke step returns its records instead.
StepRun = Callable[["Check", "Step"], "list[dict[str, Any]] | None"]
ESTIMATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_estimates.json")


class Stop(PytorchCudaError):
    """A step failed so that the ones after it cannot run; the reason goes into their records."""


class Step:
    """One line of the plan: its name, what it needs, and how long it may take."""

    def __init__(self, name: str, run: StepRun | None, needs_gpu: bool = False, family: str | None = None) -> None:
        self.name, self.run, self.needs_gpu, self.family = name, run, needs_gpu, family
        self.estimate, self.basis, self.bound = 0.0, "", 0.0
        self.state: str = "planned"
        self.seconds: float | None = None  # planned, running, done, skipped, not run, cut

    def row(self) -> dict[str, Any]:
        return {"step": self.name, "state": self.state, "estimate_s": self.estimate, "bound_s": self.bound,
                "seconds": self.seconds, "basis": self.basis}


class Check:
    """One run: the records, the facts for the report's header, the plan, and where things go."""

    def __init__(self, bundle: str, desc: dict[str, Any], report_dir: str, work: str, budget: float, rehearse: bool) -> None:
        self.bundle, self.desc, self.report_dir, self.work = bundle, desc, report_dir, work
        self.budget, self.rehearse = budget, rehearse
        self.site = os.path.join(work, "site")  # the bundle's packages: first on PYTHONPATH, nothing replaced
        self.logs = os.path.join(report_dir, "logs")
        self.records: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                                       "mode": "rehearsal (no GPU steps)" if rehearse else "GPU"}
        self.steps: list[Step] = []
        self.current: str | None = None
        self.t0 = time.monotonic()
        self.suite: Any = None  # the smoke suite (smoke/cli.py Suite), started by the first smoke step
        self.manifest: dict[str, Any] = {}
        self.gpus = 0
        os.makedirs(self.logs, exist_ok=True)

    def add(self, check: str, status: str, expected: Any = None, actual: Any = None, detail: str = "", run: str = "") -> None:
        self.records.append(record(check, status, run, expected=expected, actual=actual, detail=detail))
        print(f"gpucheck: {check}: {status}{' - ' + str(actual) if actual is not None else ''}"
              f"{' (' + detail + ')' if detail else ''}", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def write(self) -> tuple[str, str]:
        """Both report files, whole, with the plan's states: what ran, what runs now, what is left."""
        running = [s.name for s in self.steps if s.state in ("running", "cut")]
        return gpureport.write(self.report_dir, self.desc, self.facts, self.records, self.elapsed(),
                               [s.row() for s in self.steps], running[0] if running else None)

    def env(self, **extra: object) -> dict[str, str]:
        """The bundle's site, then the bundle's package, before the machine's own; libaio from the bundle."""
        e = dict(os.environ)
        e["PATH"] = os.pathsep.join(filter(None, [os.path.join(self.site, "bin"), e.get("PATH")]))
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [self.site, self.bundle, e.get("PYTHONPATH")]))
        e["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [os.path.join(self.bundle, "lib"), e.get("LD_LIBRARY_PATH")]))
        e.update({k: str(v) for k, v in extra.items()})
        return e

    def run(self, name: str, cmd: list[str], timeout: float) -> tuple[int | None, str]:
        """A child with its output in logs/<name>.log; (returncode or None on timeout, log path)."""
        log = os.path.join(self.logs, name + ".log")
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env(), cwd=self.work,
                                    start_new_session=True)
            try:
                return proc.wait(timeout=timeout), log
            except subprocess.TimeoutExpired:
                stop(proc)
                return None, log
            except BaseException:  # interrupted: the child goes too
                stop(proc)
                raise


def stop(proc: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM, then SIGKILL after grace seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path: str, n: int = 3) -> str:
    with open(path, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return " | ".join(lines[-n:])


def estimate(steps: list[Step], path: str = ESTIMATES) -> tuple[float, dict[str, Any]]:
    """Each step's estimate and time bound from the estimates file; the plan's total."""
    with open(path) as f:
        est = json.load(f)
    for s in steps:
        e = est["steps"].get(s.name, {"seconds": est["min_bound_s"], "basis": "no estimate recorded: one bound"})
        s.estimate, s.basis = float(e["seconds"]), e["basis"]
        s.bound = max(3 * s.estimate, float(est["min_bound_s"]))
    return round(sum(s.estimate for s in steps), 1), est


def print_plan(c: Check, total: float, est: dict[str, Any]) -> None:
    where = f"{c.gpus} GPU(s) per nvidia-smi" + (", rehearsal: the GPU steps are skipped" if c.rehearse else "")
    print(f"gpucheck: plan for {c.desc['image']} ({where}): {len(c.steps)} steps, about {total:g} s on {est['device']} "
          f"(estimates from {est['source']}); budget {c.budget:g} s", file=sys.stderr)
    for s in c.steps:
        print(f"  {s.name:<24} {s.estimate:>6g} s  (bound {s.bound:g} s; {s.basis})", file=sys.stderr)
    sys.stderr.flush()


def skip_reason(c: Check, step: Step) -> str | None:
    if step.needs_gpu and c.rehearse:
        return "rehearsal: this step needs a GPU"
    if step.needs_gpu and not c.gpus:
        return "no CUDA device visible to torch"
    return None


def run_step(c: Check, step: Step) -> None:
    """Report (naming the step as running), run it within its bound, report again."""
    left = c.budget - c.elapsed()
    if left < step.estimate:
        step.state = "not run"
        c.add(step.name, SKIP, detail=f"not started: {max(left, 0):.0f} s of the {c.budget:g} s budget left, "
                                      f"estimate {step.estimate:g} s")
        return
    step.bound, step.state, c.current = min(step.bound, left), "running", step.name
    c.write()
    if c.suite:
        c.suite.args.timeout = step.bound
    t0 = time.monotonic()
    assert step.run is not None  # every planned step has its function (None: a test's stand-in, never run)
    recs = step.run(c, step)
    step.seconds, step.state = round(time.monotonic() - t0, 1), "done"
    if recs is not None:  # a smoke step: its records join ours as smoke.<check>
        c.records += [dict(r, check=f"smoke.{r['check']}") for r in recs]
        failed = [r["check"] for r in recs if r["status"] == FAIL]
        print(f"gpucheck: {step.name}: {'FAIL: ' + ', '.join(failed[:4]) if failed else 'done'} in {step.seconds:g} s",
              file=sys.stderr, flush=True)
    c.write()


def run_steps(c: Check) -> None:
    """Every step in order; a Stop marks the rest as not run, with its reason."""
    for step in c.steps:
        if step.state != "planned":
            continue
        why = skip_reason(c, step)
        if why:
            step.state = "skipped"
            c.add(step.name, SKIP, detail=why)
            continue
        try:
            try:
                run_step(c, step)
            except (OSError, ValueError, KeyError, subprocess.SubprocessError) as e:  # the machine, or our bug: recorded
                c.add(f"{step.name}.error", FAIL, actual=f"{type(e).__name__}: {e}", detail="gpucheck could not run this step")
                raise Stop(f"{step.name} ended in an error") from None
        except Stop as e:
            step.state, step.seconds = "done", None
            for rest in c.steps:
                if rest.state == "planned":
                    rest.state = "not run"
            c.add("not_run", SKIP, detail=f"the steps after {step.name} did not run: {e}")
            c.write()
            return


