"""Prove one matrix row's GPU half on a machine lent for minutes, from a gpu-bundle: nothing is
compiled there, no Docker, no network.

    bash DIR/run.sh [--report DIR] [--budget S] [--rehearse] [--python PATH]
    (= python -m pytorch_cuda_runtime.gpucheck --bundle DIR ...)

The machine brings Python and torch (the ones the bundle was made for); the bundle
(`build.py gpu-bundle`) brings DeepSpeed's wheel with the row's ops prebuilt for that Python and
torch, libaio's shared library for async_io, the small wheels DeepSpeed needs, this package and
the row's manifest. It prints its plan first (every step with its estimated seconds, from
gpu_estimates.json, the last GPU record's step times), then runs the steps in order:

  bundle.files          every file's sha256 equals bundle.json's (what travelled is what was locked)
  machine.python        Python is the bundle's
  machine.torch         torch imports, is the torch the wheel was built against, and is a CUDA build
  install.dependencies  what the machine lacks of the bundle's wheels (pip decides, --no-index)
  install.deepspeed     the prebuilt wheel, --no-deps; both into a directory of their own, first on
                        PYTHONPATH: the machine's own torch and packages are never replaced
  preflight.health      the preflight's GPU health checks (preflight/health.py: Xid, ECC, row
                        remapping, retired pages, NVLink, throttling, temperature), one record a GPU
  preflight.compute     the preflight's compute check (preflight/compute.py): a bf16 matmul on each
                        GPU against its product's peak and the others, its checksum, the PCIe link
                        under load; the machine is a job of one node
  smoke.*               the smoke suite's GPU-only mode (smoke/cli.py), one step per family: versions,
                        GPU basics, the four ops loaded under DeepSpeed's `cuda` accelerator with an
                        empty TORCH_EXTENSIONS_DIR, NCCL collectives, DDP, ZeRO 1/2/3 with and without
                        offload, the `deepspeed` launcher, FSDP2, bf16, torch.compile, the train row's
                        carried extras, the GPU measure (recorded, never asserted), and last that the
                        GPU families compiled nothing

report.json and report.md are written before each step (naming it as running) and after it, each
file whole (a temporary name, then renamed): a kill at any point, SIGKILL included, leaves every
finished step recorded and the cut one named. Each step has its own time bound (3 x its estimate,
at least a minute), and no step starts that the budget (--budget, default 540 s) has no room for.

--rehearse: a machine without a GPU, and perhaps with a CPU torch, runs the same path: the files,
the install of the prebuilt wheel, the plan, the report after each step; the steps that need a GPU
are SKIPPED with that reason. Exit 0: every check that ran passed; 1: a check failed; 2: the bundle
or the arguments are unusable; 128 + N: stopped by signal N (143: SIGTERM from `timeout`), after
writing the report. Standard library only (torch in children).
"""
import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

from . import banner, gpureport
from . import manifest as mf
from .interrupt import Interrupted, catching
from .preflight import compute, health
from .smoke import cli as smoke
from .smoke import nocompile, versions
from .smoke.results import FAIL, INFO, PASS, SKIP, record

BUNDLE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ESTIMATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_estimates.json")
DEFAULT_BUDGET = 540  # a lent machine's command runs at most 600 s: the report is written before then
TORCH_FACTS = ("import json, torch; c = torch.cuda.is_available(); n = torch.cuda.device_count() if c else 0; "
               "print(json.dumps({'torch': torch.__version__, 'torch_cuda': torch.version.cuda, 'gpus': n, "
               "'arch_flags': torch._C._cuda_getArchFlags().split() if torch.version.cuda else [], "
               "'devices': [{'name': torch.cuda.get_device_name(i), 'capability': '%d.%d' % "
               "torch.cuda.get_device_capability(i)} for i in range(n)]}))")


class Stop(Exception):
    """A step failed so that the ones after it cannot run; the reason goes into their records."""


class Step:
    """One line of the plan: its name, what it needs, and how long it may take."""

    def __init__(self, name, run, needs_gpu=False, family=None):
        self.name, self.run, self.needs_gpu, self.family = name, run, needs_gpu, family
        self.estimate, self.basis, self.bound = 0.0, "", 0.0
        self.state, self.seconds = "planned", None  # planned, running, done, skipped, not run, cut

    def row(self):
        return {"step": self.name, "state": self.state, "estimate_s": self.estimate, "bound_s": self.bound,
                "seconds": self.seconds, "basis": self.basis}


class Check:
    """One run: the records, the facts for the report's header, the plan, and where things go."""

    def __init__(self, bundle, desc, report_dir, work, budget, rehearse):
        self.bundle, self.desc, self.report_dir, self.work = bundle, desc, report_dir, work
        self.budget, self.rehearse = budget, rehearse
        self.site = os.path.join(work, "site")  # the bundle's packages: first on PYTHONPATH, nothing replaced
        self.logs = os.path.join(report_dir, "logs")
        self.records, self.facts = [], {"python": platform.python_version(), "platform": platform.platform(),
                                        "mode": "rehearsal (no GPU steps)" if rehearse else "GPU"}
        self.steps, self.current, self.t0 = [], None, time.monotonic()
        self.suite, self.manifest, self.gpus = None, {}, 0
        os.makedirs(self.logs, exist_ok=True)

    def add(self, check, status, expected=None, actual=None, detail="", run=""):
        self.records.append(record(check, status, run, expected=expected, actual=actual, detail=detail))
        print(f"gpucheck: {check}: {status}{' - ' + str(actual) if actual is not None else ''}"
              f"{' (' + detail + ')' if detail else ''}", file=sys.stderr, flush=True)

    def elapsed(self):
        return round(time.monotonic() - self.t0, 1)

    def write(self):
        """Both report files, whole, with the plan's states: what ran, what runs now, what is left."""
        running = [s.name for s in self.steps if s.state in ("running", "cut")]
        return gpureport.write(self.report_dir, self.desc, self.facts, self.records, self.elapsed(),
                               [s.row() for s in self.steps], running[0] if running else None)

    def env(self, **extra):
        """The bundle's site, then the bundle's package, before the machine's own; libaio from the bundle."""
        e = dict(os.environ)
        e["PATH"] = os.pathsep.join(filter(None, [os.path.join(self.site, "bin"), e.get("PATH")]))
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [self.site, self.bundle, e.get("PYTHONPATH")]))
        e["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [os.path.join(self.bundle, "lib"), e.get("LD_LIBRARY_PATH")]))
        e.update({k: str(v) for k, v in extra.items()})
        return e

    def run(self, name, cmd, timeout):
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


def stop(proc, grace=10):
    """SIGTERM, then SIGKILL after grace seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path, n=3):
    with open(path, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return " | ".join(lines[-n:])


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---- the machine and the install

def verify_files(c, step):
    bad = [rel for rel, f in c.desc["files"].items()
           if not os.path.isfile(os.path.join(c.bundle, rel)) or sha256(os.path.join(c.bundle, rel)) != f["sha256"]]
    c.add("bundle.files", FAIL if bad else PASS, expected=f"{len(c.desc['files'])} files as bundle.json lists them",
          actual=f"{len(bad)} missing or changed: {', '.join(bad[:5])}" if bad else f"{len(c.desc['files'])} files verified")
    if bad:
        raise Stop("the bundle's files do not match bundle.json")


def check_python(c, step):
    want, have = c.desc["python"], ".".join(platform.python_version_tuple()[:2])
    c.add("machine.python", PASS if want == have else FAIL, expected=want, actual=have,
          detail="" if want == have else f"the wheels are for Python {want}: `bash run.sh --python PATH` names another "
                                         f"interpreter, or `build.py gpu-bundle --python {have}` makes a bundle for this one")
    if want != have:
        raise Stop(f"Python {have} cannot install wheels made for {want}")


def release(version):
    return version.split("+")[0]


def probe_torch(c, step):
    rc, log = c.run("torch", [sys.executable, "-c", TORCH_FACTS], step.bound)
    with open(log, errors="replace") as f:
        lines = [ln for ln in f if ln.startswith("{")]
    if rc != 0 or not lines:
        c.add("machine.torch", FAIL, expected="torch imports", actual=tail(log))
        raise Stop("torch does not import")
    facts = json.loads(lines[-1])
    c.facts.update(facts)
    c.gpus = int(facts["gpus"])
    built_for = c.desc["ops_wheel"]["torch"]  # the row's torch, or its MAJOR.MINOR as a given wheel records it
    have = release(facts["torch"])
    if have != built_for and not have.startswith(built_for + "."):
        c.add("machine.torch", FAIL, expected=f"torch {built_for}, the one the ops were built against",
              actual=f"torch {facts['torch']}", detail="the prebuilt ops would not load: make the bundle for this torch")
        raise Stop("the machine's torch is not the one the wheel was built against")
    if facts["torch_cuda"] is None and not c.rehearse:
        c.add("machine.torch", FAIL, expected="a CUDA build of torch", actual=f"torch {facts['torch']}, a CPU build")
        raise Stop("this torch is no CUDA build")
    c.add("machine.torch", PASS, expected=f"torch {built_for}", actual=f"torch {facts['torch']}, CUDA {facts['torch_cuda']}, "
          f"{c.gpus} GPU(s) visible", detail="a CPU build: the rehearsal loads no CUDA op" if facts["torch_cuda"] is None else "")
    if not c.gpus and not c.rehearse:
        c.add("machine.gpu", FAIL, expected="a CUDA device", actual="none visible to torch",
              detail="`bash run.sh --rehearse` runs the steps that need no GPU")


def pip(c, name, args, timeout):
    """pip with nothing from the machine's configuration (--isolated) and no index."""
    return c.run(name, [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args], timeout)


def missing(c, name, requirements, timeout):
    """What pip would install for requirements, given what this machine (and site) already has."""
    report = os.path.join(c.work, f"{name}.json")
    rc, log = pip(c, name, ["install", "--dry-run", "--quiet", "--no-index", "--find-links",
                            os.path.join(c.bundle, "wheels"), "--report", report, *requirements], timeout)
    if rc != 0:
        return None, log
    with open(report) as f:
        return [(i["metadata"]["name"], i["metadata"]["version"], i["download_info"]["url"].removeprefix("file://"))
                for i in json.load(f)["install"]], log


def install(c, name, files, timeout):
    rc, log = pip(c, name, ["install", "--quiet", "--no-deps", "--no-index", "--no-compile", "--target", c.site, *files],
                  timeout)
    return rc == 0, log


def install_dependencies(c, step):
    """Only what the machine lacks: its own numpy, pydantic... stay, the bundle fills the gaps."""
    todo, log = missing(c, "install.dependencies", sorted(c.desc["wheels"]), step.bound)
    ok, log = install(c, "install.dependencies", [f for _, _, f in todo], step.bound) if todo else (todo is not None, log)
    c.add("install.dependencies", PASS if ok else FAIL, expected=f"{len(c.desc['wheels'])} requirements met, --no-index",
          actual=(f"installed {len(todo)} ({', '.join(f'{n} {v}' for n, v, _ in todo)}); the machine had the rest" if todo
                  else "the machine had every one") if ok else tail(log), detail="" if ok else f"log {log}")
    if not ok:
        raise Stop("the bundle's wheels did not install")


def install_deepspeed(c, step):
    """The prebuilt wheel, nothing compiled: its requirements are met already (the step before)."""
    wheel = os.path.join(c.bundle, c.desc["ops_wheel"]["file"])
    todo, log = missing(c, "install.deepspeed-plan", [wheel], step.bound)
    extra = [f"{n} {v}" for n, v, _ in todo or [] if n.lower() != "deepspeed"]
    ok, log = install(c, "install.deepspeed", [wheel], step.bound) if todo is not None and not extra else (False, log)
    c.add("install.deepspeed", PASS if ok else FAIL, expected="the prebuilt wheel installs beside the machine's torch",
          actual=f"{os.path.basename(wheel)} ({', '.join(c.desc['ops_wheel']['ops'])} prebuilt for "
                 f"{c.desc['ops_wheel']['arch_list']})" if ok else (f"also needs {', '.join(extra)}" if extra else tail(log)))
    if not ok:
        raise Stop("DeepSpeed did not install")
    os.environ.update({k: c.env()[k] for k in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")})  # the smoke suite's children
    start_suite(c)


# ---- the smoke suite's GPU-only mode, one family a step

def effective_manifest(c):
    """The row's manifest as this check reads it: the bundle's Python, the wheel's ops and arch list."""
    with open(os.path.join(c.bundle, "manifest.json")) as f:
        manifest = json.load(f)
    wheel = c.desc["ops_wheel"]
    manifest.update(python=c.desc["python"], prebuilt_ops=wheel["ops"], ops_accelerator="cuda")
    path = os.path.join(c.work, "manifest", "manifest.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=2)
    # Beside it, as an image keeps them: torch's arch list (measured from this machine's torch, which
    # machine.torch found to be the row's) and the ops' build facts, when the bundle has them.
    with open(os.path.join(os.path.dirname(path), "torch-facts.json"), "w") as f:
        json.dump({"cuda_arch_list": c.facts.get("arch_flags", [])}, f)
    facts = os.path.join(c.bundle, os.path.dirname(wheel["file"]), "ops-facts.json")
    if os.path.isfile(facts):
        shutil.copy(facts, os.path.join(os.path.dirname(path), "ops-facts.json"))
    return mf.load(path), path


def start_suite(c):
    c.manifest, path = effective_manifest(c)
    args = SimpleNamespace(report=os.path.join(c.report_dir, "smoke", "report.json"), manifest=path, timeout=60,
                           ranks=1, require_gpu=not c.rehearse, cpu=False, gpu_only=True, only=list(smoke.FAMILIES))
    c.suite = smoke.Suite(args)


def smoke_versions(c, step):
    facts = c.suite.probe("host")
    c.facts.update({k: facts.get(k) for k in ("cudnn", "nccl", "deepspeed", "ds_build_accelerator")})
    recs = versions.check(c.manifest, facts)
    if c.rehearse:  # the manifest is the row's; a rehearsal's torch build may be a CPU one
        recs = [dict(r, status=INFO, detail="rehearsal: recorded, not compared") if r["check"] in
                ("versions.torch_cuda", "versions.cudnn", "versions.nccl", "versions.cuda_arch_list") else r for r in recs]
    families = [(s.family, "cuda", c.gpus) for s in c.steps if s.family and not skip_reason(c, s)]
    return recs + smoke.world_of_one(c.gpus, families)


def smoke_gpu(c, step):
    return smoke.run_gpu_basics(c.suite, c.gpus, "no CUDA device visible")


def smoke_ops(c, step):
    if c.facts.get("torch_cuda") is None:
        return [record("nocompile.ops", SKIP, detail="the wheel's ops are built for cuda and link torch's CUDA "
                                                     "libraries; this torch is a CPU build")]
    return nocompile.run_ops(c.suite, c.manifest)


def smoke_family(c, step):
    return smoke.run_family(c.suite, step.family, "cuda", 1 if step.family in smoke.GPU_ONLY else c.gpus)


def smoke_extras(c, step):
    return smoke.run_extras(c.suite, c.manifest, c.gpus)


def smoke_nocompile(c, step):
    return [nocompile.empty_check("nocompile.torch_extensions_training", f"cuda x{c.gpus}", c.suite.ext["cuda"],
                                  "GPU families")]


# ---- the preflight's GPU checks (preflight/health.py, preflight/compute.py), the machine as a job of one node

def preflight_health(c, step):
    """NVML's faults of each GPU, each a FAIL naming the GPU by index and serial."""
    out = os.path.join(c.report_dir, "preflight-health.json")
    rc, log = c.run("preflight.health", [sys.executable, "-m", "pytorch_cuda_runtime.preflight.health", "--out", out],
                    step.bound)
    if rc is None or not os.path.isfile(out):
        c.add("preflight.health", FAIL, expected="every GPU's health read", actual=tail(log),
              detail="did not end within its bound" if rc is None else f"exit {rc}")
        return
    with open(out) as f:
        record = json.load(f)
    for g in record["gpus"]:
        lines = [health.Finding(**f).line() for f in g["findings"]]
        c.add(f"preflight.health.gpu{g['index']}", FAIL if lines else PASS, expected="no fault NVML reports",
              actual="; ".join(lines) or f"{g['name']}, serial {g.get('serial')}: no fault",
              detail="; ".join([f"read through {record['source']}", *g["notes"],
                                *(f"{k} not read: {v}" for k, v in g["unread"].items())]))


def preflight_compute(c, step):
    """The bf16 matmul on each GPU: TFLOP/s against the product's peak and the others, the checksum, PCIe."""
    out, node = os.path.join(c.report_dir, "preflight-compute.json"), platform.node().split(".")[0]
    bound = min(step.bound, compute.GPU_TIMEOUT_S)
    rc, log = c.run("preflight.compute", [sys.executable, "-m", "pytorch_cuda_runtime.preflight.compute", "--node", node,
                                          "--out", out], bound)
    if rc is None or not os.path.isfile(out):
        c.add("preflight.compute", FAIL, expected=f"the bf16 matmul on every GPU within {bound:g} s", actual=tail(log),
              detail="did not end within its bound" if rc is None else f"exit {rc}")
        return
    with open(out) as f:
        figures = json.load(f)
    found, rows = compute.judge({node: figures})
    for r in rows:
        peak = (f"{r['x_peak']:.2f} x the dense bf16 peak {r['peak']}" if r.get("x_peak") is not None
                else f"peak: {r['peak']}")
        c.add(f"preflight.compute.gpu{r['gpu']}", INFO, actual=f"{r['tflops']:.1f} TFLOP/s",
              detail=f"{r['name']}, serial {r.get('serial')}: {figures['size']}x{figures['size']} bf16, seed "
                     f"{figures['seed']}; {peak}; checksum {r['checksum']}")
    for f in [*compute.local(figures), *(f for _, f in found)]:
        c.add(f"preflight.{f.check}", FAIL, expected=health.CHECKS[f.check], actual=f.line())
    if not found and not compute.local(figures) and figures.get("gpus"):
        c.add("preflight.compute", PASS, expected="each GPU within its thresholds, one checksum",
              actual=f"{len(figures['gpus'])} GPU(s)")


def plan(gpus):
    """Every step in order; a world of one still runs the sharding families (one rank)."""
    steps = [Step("bundle.files", verify_files), Step("machine.python", check_python), Step("machine.torch", probe_torch),
             Step("install.dependencies", install_dependencies), Step("install.deepspeed", install_deepspeed),
             Step("smoke.versions", smoke_versions), Step("smoke.gpu", smoke_gpu, needs_gpu=True),
             Step("smoke.ops", smoke_ops), Step("preflight.health", preflight_health, needs_gpu=True),
             Step("preflight.compute", preflight_compute, needs_gpu=True)]
    for family, _, _ in smoke.plan(smoke.MULTI + smoke.SINGLE, max(gpus, 1), 1, gpu_only=True):
        steps.append(Step(f"smoke.{family}", smoke_family, needs_gpu=True, family=family))
    steps += [Step("smoke.extras", smoke_extras), Step("smoke.measure", smoke_family, needs_gpu=True, family="measure"),
              Step("smoke.nocompile", smoke_nocompile, needs_gpu=True)]
    return steps


def estimate(steps, path=ESTIMATES):
    """Each step's estimate and time bound from the estimates file; the plan's total."""
    with open(path) as f:
        est = json.load(f)
    for s in steps:
        e = est["steps"].get(s.name, {"seconds": est["min_bound_s"], "basis": "no estimate recorded: one bound"})
        s.estimate, s.basis = float(e["seconds"]), e["basis"]
        s.bound = max(3 * s.estimate, float(est["min_bound_s"]))
    return round(sum(s.estimate for s in steps), 1), est


def print_plan(c, total, est):
    where = f"{c.gpus} GPU(s) per nvidia-smi" + (", rehearsal: the GPU steps are skipped" if c.rehearse else "")
    print(f"gpucheck: plan for {c.desc['image']} ({where}): {len(c.steps)} steps, about {total:g} s on {est['device']} "
          f"(estimates from {est['source']}); budget {c.budget:g} s", file=sys.stderr)
    for s in c.steps:
        print(f"  {s.name:<24} {s.estimate:>6g} s  (bound {s.bound:g} s; {s.basis})", file=sys.stderr)
    sys.stderr.flush()


def skip_reason(c, step):
    if step.needs_gpu and c.rehearse:
        return "rehearsal: this step needs a GPU"
    if step.needs_gpu and not c.gpus:
        return "no CUDA device visible to torch"
    return None


def run_step(c, step):
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
    recs = step.run(c, step)
    step.seconds, step.state = round(time.monotonic() - t0, 1), "done"
    if recs is not None:  # a smoke step: its records join ours as smoke.<check>
        c.records += [dict(r, check=f"smoke.{r['check']}") for r in recs]
        failed = [r["check"] for r in recs if r["status"] == FAIL]
        print(f"gpucheck: {step.name}: {'FAIL: ' + ', '.join(failed[:4]) if failed else 'done'} in {step.seconds:g} s",
              file=sys.stderr, flush=True)
    c.write()


def steps(c):
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


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gpucheck", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=BUNDLE, help="the bundle (default: the one this package came in)")
    p.add_argument("--report", help="directory for report.json, report.md and logs/ (default: BUNDLE/report)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help=f"seconds for the whole run: no step starts that would not fit (default {DEFAULT_BUDGET})")
    p.add_argument("--rehearse", action="store_true", help="a machine without a GPU: run every step that needs none")
    a = p.parse_args(argv)
    if a.budget <= 0:
        p.exit(2, f"gpucheck: error: --budget {a.budget:g}: expected a positive number of seconds\n")
    return a


def load(a):
    """bundle.json and a writable report directory, or one line and exit 2."""
    with open(os.path.join(a.bundle, "bundle.json")) as f:
        desc = json.load(f)
    if desc.get("schema") != 2 or "ops_wheel" not in desc:
        raise ValueError(f"{a.bundle}/bundle.json is no bundle of this gpucheck (schema {desc.get('schema')}, "
                         "expected 2 with a prebuilt ops wheel): make it again with `build.py gpu-bundle`")
    report_dir = os.path.abspath(a.report or os.path.join(a.bundle, "report"))
    os.makedirs(report_dir, exist_ok=True)
    if not os.access(report_dir, os.W_OK):
        raise OSError(f"{report_dir} is not writable (name another with --report)")
    return desc, report_dir


def main(argv=None):
    a = parse_args(argv)
    try:
        desc, report_dir = load(a)
    except (OSError, ValueError) as e:
        print(f"gpucheck: error: {e}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="pytorch-cuda-gpucheck-")
    c = Check(os.path.abspath(a.bundle), desc, report_dir, work, a.budget, a.rehearse)
    smi = banner.query_gpus() or []
    c.facts["nvidia_smi"] = [{"name": n, "driver": d, "capability": cap} for n, d, cap in smi]
    c.gpus = len(smi)  # for the plan; torch's own count replaces it (machine.torch)
    c.steps = plan(c.gpus)
    total, est = estimate(c.steps)
    c.facts["plan_estimate_s"] = total
    print_plan(c, total, est)
    stopped = None
    try:
        with catching():
            try:
                c.write()
                steps(c)
            except Interrupted as e:  # what finished still makes a report, and the cut step is named
                stopped = e
                for s in c.steps:
                    s.state = "cut" if s.state == "running" else ("not run" if s.state == "planned" else s.state)
                c.add("interrupted", FAIL, expected="every step run", actual=f"{e} during {c.current}",
                      detail="the steps after it did not run")
    finally:
        for d in (work, c.suite.work if c.suite else None):
            if d:
                shutil.rmtree(d, ignore_errors=True)
    paths = c.write()
    failed = sum(r["status"] == FAIL for r in c.records)
    print(f"gpucheck: {len(c.records)} checks, {failed} failed, in {c.elapsed():g} s; {paths[0]} and {paths[1]}",
          file=sys.stderr)
    return stopped.exit_code if stopped else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
